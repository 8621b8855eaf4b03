"""The steps this server measured, and the cost models built from them.

TurboSpec's closed loop: without a trained policy version the step-time model is the analytic
one refitted on the steps this deployment measured, so the fallback learns its hardware. A model
that replaces another (a refit, or a newly activated XGBoost version) first replays the
measured steps through its residual correction, so it starts with the corrections the
measurements imply instead of none: a fresh correction would price every shape the bare model
gets wrong by that error until the shape ran again.

Which steps count is ``policy.teaches_cost_model``: a catch-up step, or one without a measured
time, teaches nothing. The step controller adds the others here as they finish.

Refit schedule: an analytic fit needs measurements of more than one shape to separate its terms.
The first refit comes once every candidate was measured (the warm-up's first round) and there
are ``FIRST_REFIT_ROWS`` measured steps, about twice the fit's 7 terms, or else after
``MIN_REFIT_ROWS`` (no warm-up, or pins hold the server on few shapes). Until then the default
model prices the steps (a GPU's costs) scaled by the residual correction's drift, which on a CPU
leaves every shape's part of the error to its own few steps: the first refit should come as soon as
the fit is determined, so the step controller runs it itself, on the step that makes it due.
Later ones come each time the measured steps have doubled, then every ``REFIT_EVERY_ROWS``, from
the control poller.

A fitted model does not extrapolate below the smallest batch it was fitted on
(``OnlineCostModel.at_floor``): steps of one batch size cannot separate a step's fixed cost from
its cost per request.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import numpy as np

from sglang_adatree.core.cost_model import (
    AnalyticStepTime,
    OnlineCostModel,
    StepTimeModel,
    mape,
    starting_cost_model,
)
from sglang_adatree.core.cost_table import CostTable, TableGrid
from sglang_adatree.core.features import COLUMN, GraphPadding, StepFeatures, feature_rows
from sglang_adatree.core.shapes import TreeShape

logger = logging.getLogger(__name__)

FIRST_REFIT_ROWS = 16
MIN_REFIT_ROWS = 64
REFIT_EVERY_ROWS = 128
HISTORY_ROWS = 4096


@dataclass(frozen=True)
class MeasuredStep:
    """One finished step a cost model may learn from."""

    features: StepFeatures
    shape: TreeShape
    measured_ms: float


class MeasuredSteps:
    """The newest ``HISTORY_ROWS`` measured steps, and the models fitted or replayed on them.

    ``add`` runs on the decode loop; ``refit`` and ``tabulate`` on a background thread (or
    inline, in a simulation). A snapshot of the history is one C-level copy of the deque, safe
    against a concurrent ``add``.
    """

    def __init__(
        self,
        candidates: tuple[TreeShape, ...],
        residual_decay: float,
        padding: GraphPadding,
        max_batch_size: int = 256,
    ) -> None:
        self.candidates = candidates
        self.residual_decay = residual_decay
        self.padding = padding
        self.grid = TableGrid(max_batch_size=max(1, min(max_batch_size, 256)))
        self._rows: collections.deque[MeasuredStep] = collections.deque()
        self._shape_rows: collections.Counter[TreeShape] = collections.Counter()  # in _rows
        self.total = 0  # steps ever added
        self._last_refit_total = 0
        self.last_refit_mape: float | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, features: StepFeatures, shape: TreeShape, measured_ms: float) -> None:
        if len(self._rows) >= HISTORY_ROWS:
            self._shape_rows[self._rows.popleft().shape] -= 1
        self._rows.append(MeasuredStep(features, shape, measured_ms))
        self._shape_rows[shape] += 1
        self.total += 1

    def _measured_shapes(self) -> set[TreeShape]:
        return {s for s, n in list(self._shape_rows.items()) if n > 0}

    def matrix(self) -> tuple[np.ndarray, list[TreeShape], np.ndarray]:
        """A snapshot as (feature rows ``[rows, NUM_FEATURES]``, shapes, ms ``[rows]``)."""
        rows = list(self._rows)
        shapes = [m.shape for m in rows]
        x = feature_rows([m.features for m in rows], shapes)
        return x, shapes, np.array([m.measured_ms for m in rows], dtype=np.float64)

    @property
    def fitted(self) -> bool:
        """Whether a refit has run on measured steps (a forced one before any is not
        counted: it had nothing to fit)."""
        return self._last_refit_total > 0

    def refit_due(self) -> bool:
        """Whether the schedule in the module docstring calls for a refit now (cheap: it is
        asked after every step in a simulation, every poll in a server)."""
        done = self._last_refit_total
        if done:
            return self.total - done >= min(done, REFIT_EVERY_ROWS)
        measured = self._measured_shapes()
        if len(self._rows) < FIRST_REFIT_ROWS or len(measured) < 2:
            return False  # a fit of fewer rows or one shape cannot separate its terms
        covered = measured.issuperset(self.candidates)
        return len(self._rows) >= (FIRST_REFIT_ROWS if covered else MIN_REFIT_ROWS)

    def refit(self, force: bool = False) -> OnlineCostModel | None:
        """The analytic model refitted on the measured steps, with their corrections replayed;
        None when not due. ``force``: now, and when the fit is not determined (too few rows or
        shapes) the default analytic model with the corrections replayed."""
        if not force and not self.refit_due():
            return None
        x, shapes, y = self.matrix()
        determined = len(y) >= FIRST_REFIT_ROWS and len(set(shapes)) >= 2
        if not force and not determined:
            return None
        self._last_refit_total = self.total
        fitted = AnalyticStepTime()
        floor: StepFeatures | None = None  # the model fitted prices smaller batches as this
        if determined:
            try:
                fitted = AnalyticStepTime.fit(x, y)
            except (ValueError, np.linalg.LinAlgError) as exc:
                logger.warning("adatree: analytic refit failed: %s", exc)
                if not force:
                    return None
            else:
                self.last_refit_mape = mape(fitted.predict_matrix(x), y)
                floor = _smallest_batch(x)
        cost_model = OnlineCostModel(fitted, self.residual_decay, batch_floor=floor)
        cost_model.replay(x, shapes, y)
        return cost_model

    def replayed(self, step_time: StepTimeModel) -> OnlineCostModel:
        """``step_time`` (a deployment's profile) with the measured steps' corrections
        replayed; no table, no fit."""
        cost_model = starting_cost_model(self.residual_decay, step_time)
        cost_model.replay(*self.matrix())
        return cost_model

    def tabulate(self, step_time: StepTimeModel) -> OnlineCostModel:
        """``step_time`` (a trained version) tabulated over the candidates, with the measured
        steps' corrections replayed; seconds for an XGBoost model, so off the decode loop."""
        table = CostTable.build(step_time, self.candidates, self.grid, self.padding)
        cost_model = OnlineCostModel(step_time, self.residual_decay, table)
        cost_model.replay(*self.matrix())
        return cost_model


def _smallest_batch(x: np.ndarray) -> StepFeatures:
    """The features of the row with the smallest batch in ``x`` ``[rows, NUM_FEATURES]``."""
    i = int(np.argmin(x[:, COLUMN["batch_size"]]))
    return StepFeatures(
        int(x[i, COLUMN["batch_size"]]),
        int(x[i, COLUMN["padded_batch_size"]]),
        int(x[i, COLUMN["sum_context_len"]]),
        int(x[i, COLUMN["max_context_len"]]),
    )
