"""The serving loop of adatree, without SGLang: decide, observe, record, obey the operator.

The SGLang worker (``sglang_adatree.sglang.worker``) calls two methods per decode step:

* ``decide(context_lens, draft_behind)`` before the step: features of the batch, then the
  policy's shape (or first a catch-up step when the draft skipped its extend last step);
* ``complete_step(...)`` once the step's accept counts reach the CPU (one step late under
  SGLang's overlap scheduler): feeds the cost model and the acceptance estimator, records one
  telemetry row, updates the Prometheus series.

Everything slow happens on a background control thread, never in those two calls:

* at start and then every ``control_poll_s`` it reads the active pins and policy version from
  the store; a newly activated policy version is loaded and tabulated there (seconds for an
  XGBoost model) and handed over ready to use;
* without a trained policy version it refits the analytic step-time model on the steps this
  server measured (TurboSpec's closed loop), so the fallback learns this deployment.

Hand-over is one attribute assignment that ``decide`` picks up at the next step boundary.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_adatree.acceptance import AcceptanceEstimator
from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.cost_model import AnalyticStepTime, OnlineCostModel, mape
from sglang_adatree.cost_table import CostTable, TableGrid
from sglang_adatree.features import StepFeatures, feature_rows
from sglang_adatree.metrics import AdaTreeMetrics
from sglang_adatree.policy import CATCH_UP, Decision, Pin, Policy
from sglang_adatree.shapes import NO_SPEC, TreeShape
from sglang_adatree.telemetry.control import read_control_state
from sglang_adatree.telemetry.records import RunRecord, StepRecord
from sglang_adatree.telemetry.writer import TelemetryWriter
from sglang_adatree.xgb_cost import ArtifactError, XGBoostStepTime

logger = logging.getLogger(__name__)

# Analytic refits need measurements of more than one shape to separate the terms. Until the
# first, every shape is priced by the default model (a GPU's costs on a CPU: 10-25x too low)
# and its own few measurements, shrunk towards that model (``cost_model.PRIOR_STEPS``). The
# first refit comes once every candidate was measured (the warm-up's first round) and there
# are FIRST_REFIT_ROWS measured steps, about twice the fit's 7 terms (on this CPU a fit of the
# first 16 steps of a warm-up predicted the next 700 within 17-20%, as well as one of 64), or
# else after MIN_REFIT_ROWS (no warm-up, or pins). Later ones come each time the measured steps
# have doubled, then every REFIT_EVERY_ROWS. Before, the first came after 64 steps: after the
# warm-up the policy spent 20 steps on the largest trees, 250-530 ms each, predicted at 25-65.
FIRST_REFIT_ROWS = 16
MIN_REFIT_ROWS = 64
REFIT_EVERY_ROWS = 128
HISTORY_ROWS = 4096


@dataclass(frozen=True)
class ControlUpdate:
    """What the control thread hands to the decode loop, applied at a step boundary."""

    pins: tuple[Pin, ...]
    cost_model: OnlineCostModel | None  # None: keep the current one
    policy_version: int | None
    source: str  # why the cost model changed: 'policy', 'refit' or '' (pins only)


@dataclass(frozen=True)
class _Measured:
    features: StepFeatures
    shape: TreeShape
    measured_ms: float


def accepted_counts(
    stats: Any, topk: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(offered per depth, accepted per depth, accepted per sibling rank), batch totals.

    ``stats`` is a ``tree.AcceptedPathStats`` on the CPU.
    """
    ranks = stats.accepted_rank  # [batch, steps]
    accepted = ranks >= 0
    offered_by_depth = tuple(int(x) for x in stats.num_children.sum(0).tolist())
    accepted_by_depth = tuple(int(x) for x in accepted.sum(0).tolist())
    kept = ranks[accepted]
    by_rank = [0] * topk
    for rank in kept.tolist():
        if 0 <= rank < topk:
            by_rank[rank] += 1
    return offered_by_depth, accepted_by_depth, tuple(by_rank)


def make_policy(
    config: AdaTreeConfig, cost_model: OnlineCostModel, acceptance: AcceptanceEstimator
) -> Policy:
    """The decision rule named by ``config.policy``: adatree's, or a re-implemented baseline.

    Baselines (``sglang_adatree.baselines``) share ``Policy``'s interface, so the benchmark runs
    each through this same serving loop, telemetry included.
    """
    if config.policy == "adatree":
        return Policy(config, cost_model, acceptance)
    from sglang_adatree.baselines import BASELINE_POLICIES

    return BASELINE_POLICIES[config.policy](config, cost_model, acceptance)


class AdaTreeRuntime:
    """The per-server adaptive loop; see the module docstring."""

    def __init__(
        self,
        config: AdaTreeConfig,
        run: RunRecord | None = None,
        *,
        metrics: AdaTreeMetrics | None = None,
        max_batch_size: int = 256,
        control: bool = True,
    ) -> None:
        self.config = config
        self.candidate_shapes: tuple[TreeShape, ...] = tuple(config.candidate_shapes)
        self._grid = TableGrid(max_batch_size=max(1, min(max_batch_size, 256)))
        self.policy = make_policy(
            config,
            OnlineCostModel(AnalyticStepTime(), config.residual_decay),
            AcceptanceEstimator.from_config(config),
        )
        self.metrics = metrics
        self.writer: TelemetryWriter | None = None
        self.run_id: int | None = None
        if config.record_steps and run is not None:
            self.writer = TelemetryWriter.from_config(config)
            self.run_id = self.writer.start_run(run)
        self._step_index = 0
        self._history: collections.deque[_Measured] = collections.deque(maxlen=HISTORY_ROWS)
        self._measured_total = 0
        self._pending: ControlUpdate | None = None
        self._last_decision: Decision | None = None
        # A speculative decision waiting for a catch-up, with its batch's context lengths.
        self._held: tuple[Decision, list[int]] | None = None
        self._accept_len_ema: float | None = None
        self._last_refit_rows = 0
        self._refit_mape: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if control:
            self._thread = threading.Thread(
                target=self._control_loop, name="adatree-control", daemon=True
            )
            self._thread.start()

    # -- the decode loop ------------------------------------------------------------------

    def decide(
        self, context_lens: Sequence[int], prefill_tokens: int = 0, draft_behind: bool = False
    ) -> tuple[Decision, StepFeatures]:
        """The shape for a decode step over requests with these context lengths.

        ``draft_behind``: the draft of some request in the batch skipped its extend on the
        last step (a step without speculation under ``skip_idle_draft_extend``), so its next
        draft input is a placeholder and a speculative step would emit exactly one token for
        it. Measured on a CPU server before this existed: every exploration from no
        speculation emitted 1 token, the acceptance estimates learned that, and the policy
        stayed without speculation for 517 of 645 steps. A speculative decision then waits one
        step: this step runs as a ``catch-up`` (no speculation, with the draft's extend), and
        the held decision runs on the next step, without a new policy decision in between, if
        that step continues the same batch (every context one token longer, as after a step
        without speculation) and no control update (pins, a new cost model) came in between;
        otherwise it is dropped (a pin must win at once, and a new batch gets its own decision).
        """
        pending = self._pending
        held, self._held = self._held, None
        if pending is not None:
            self._pending = None
            self._apply(pending)
            held = None
        features = StepFeatures.from_context_lens(context_lens, prefill_tokens)
        if held is not None and sorted(context_lens) == [n + 1 for n in held[1]]:
            decision = held[0]
        else:
            decision = self.policy.decide(features)
        if draft_behind and decision.shape.speculative:
            self._held = (decision, sorted(context_lens))
            # Any policy's, baselines' included: its cost model prices the step as no speculation.
            predicted_ms = self.policy.cost_model.predict_ms(features, NO_SPEC)
            decision = Decision(NO_SPEC, CATCH_UP, predicted_ms, 1.0)
        self._last_decision = decision
        return decision, features

    def complete_step(
        self,
        decision: Decision,
        features: StepFeatures,
        measured_ms: float,
        num_correct_drafts_per_req: Sequence[int],
        stats: Any = None,
        record_timing: bool = True,
    ) -> None:
        """Feed one finished step back: cost model, acceptance, telemetry, metrics."""
        shape = decision.shape
        batch_size = len(num_correct_drafts_per_req)
        if batch_size == 0:
            return
        accepted_tokens = int(sum(num_correct_drafts_per_req))
        emitted_tokens = accepted_tokens + batch_size
        # A catch-up step costs a step without speculation plus the draft's extend: teaching
        # the cost model that as the price of no speculation would make it look dearer.
        learns = decision.source != CATCH_UP
        if learns:
            self.policy.observe(
                features, shape, measured_ms if record_timing else _predicted(decision), stats
            )
        if record_timing and learns:
            self._history.append(_Measured(features, shape, measured_ms))
            self._measured_total += 1
        accept_len = emitted_tokens / batch_size
        ema = self._accept_len_ema
        self._accept_len_ema = accept_len if ema is None else 0.9 * ema + 0.1 * accept_len
        offered: tuple[int, ...] = ()
        by_depth: tuple[int, ...] = ()
        by_rank: tuple[int, ...] = ()
        if stats is not None and shape.speculative:
            offered, by_depth, by_rank = accepted_counts(stats, shape.topk)
        drafted = batch_size * (shape.num_draft_tokens - 1)
        goodput = emitted_tokens / (measured_ms / 1000.0) if measured_ms > 0 else 0.0
        if self.writer is not None and self.run_id is not None:
            self.writer.record(
                StepRecord(
                    run_id=self.run_id,
                    step_index=self._step_index,
                    wall_time=time.time(),
                    batch_size=batch_size,
                    sum_context_len=features.sum_context_len,
                    max_context_len=features.max_context_len,
                    prefill_tokens=features.prefill_tokens,
                    steps=shape.steps,
                    topk=shape.topk,
                    num_draft_tokens=shape.num_draft_tokens,
                    decision_source=decision.source,
                    policy_version=self.policy.policy_version,
                    predicted_step_ms=decision.predicted_ms,
                    measured_step_ms=measured_ms,
                    predicted_accept_len=decision.predicted_emitted,
                    measured_accept_len=accept_len,
                    emitted_tokens=emitted_tokens,
                    drafted_tokens=drafted,
                    accepted_tokens=accepted_tokens,
                    goodput=goodput,
                    accepted_by_depth=by_depth,
                    accepted_by_rank=by_rank,
                )
            )
        self._step_index += 1
        if self.metrics is not None:
            self.metrics.observe(
                shape,
                decision.source,
                decision.predicted_ms,
                measured_ms,
                emitted_tokens,
                drafted,
                offered,
                by_depth,
            )

    def server_state(self) -> dict[str, Any]:
        """What ``GET /server_info`` shows under ``internal_states``."""
        d = self._last_decision
        return {
            "adatree_shape": None if d is None else str(d.shape),
            "adatree_decision_source": None if d is None else d.source,
            "adatree_policy_version": self.policy.policy_version,
            "adatree_recent_accept_length": self._accept_len_ema,
            "adatree_steps": self._step_index,
            "adatree_pins": [str(p.shape) for p in self.policy.pins],
            "adatree_candidate_shapes": [str(s) for s in self.candidate_shapes],
            "adatree_run_id": self.run_id,
        }

    def close(self) -> None:
        """Stop the control thread, then flush telemetry and close the run."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.writer is not None:
            if self.run_id is not None:
                self.writer.stop_run(self.run_id)
            self.writer.close()

    # -- applying operator control ----------------------------------------------------------

    def _apply(self, update: ControlUpdate) -> None:
        if update.pins != self.policy.pins:
            logger.info("adatree: pins now %s", [str(p.shape) for p in update.pins] or "none")
            self.policy.set_pins(update.pins)
        if update.cost_model is not None:
            self.policy.set_cost_model(update.cost_model, update.policy_version)
            logger.info(
                "adatree: cost model from %s (policy version %s)",
                update.source,
                update.policy_version,
            )

    # -- the control thread -----------------------------------------------------------------

    def _control_loop(self) -> None:
        known_version: int | None = None
        failed_version: int | None = None
        # Read first, then wait: a pin or policy version set before the server started applies
        # from its first decode steps, not a poll interval later.
        while True:
            pins: tuple[Pin, ...] = self.policy.pins
            cost_model = None
            version = self.policy.policy_version
            source = ""
            try:
                state = read_control_state(self.config.resolved_db_url, known_version)
            except Exception as exc:  # the database may be down; serving goes on
                logger.warning("adatree: cannot read pins / policy versions: %s", exc)
                state = None
            if state is not None:
                pins = tuple(
                    Pin(p.shape, p.min_batch_size, p.max_batch_size)
                    for p in state.pins
                    if p.shape in self.candidate_shapes
                )
                if state.policy is not None and state.policy.version != failed_version:
                    try:
                        model = XGBoostStepTime.from_bytes(state.policy.artifact)
                        table = CostTable.build(model, self.candidate_shapes, self._grid)
                        cost_model = OnlineCostModel(model, self.config.residual_decay, table)
                        cost_model.replay(*self._measured_matrix(list(self._history)))
                        version, source = state.policy.version, "policy"
                        known_version = version
                    except (ArtifactError, ValueError) as exc:
                        logger.error(
                            "adatree: policy version %s cannot be loaded (%s); keeping the "
                            "current cost model",
                            state.policy.version,
                            exc,
                        )
                        failed_version = state.policy.version
                elif state.active_policy_version is None and known_version is not None:
                    # Rolled back to no trained version: the refitted analytic model again.
                    known_version = version = None
                    cost_model = self._refit(force=True)
                    source = "refit"
            if cost_model is None and version is None:
                refit = self._refit(force=False)
                if refit is not None:
                    cost_model, source = refit, "refit"
            if pins != self.policy.pins or cost_model is not None:
                self._pending = ControlUpdate(pins, cost_model, version, source)
            if self._stop.wait(self.config.control_poll_s):
                return

    def _refit(self, force: bool) -> OnlineCostModel | None:
        """The analytic model refitted on this server's measured steps, when there are new ones."""
        rows = list(self._history)
        measured_shapes = {m.shape for m in rows}
        done = self._last_refit_rows
        if done:
            due = self._measured_total - done >= min(done, REFIT_EVERY_ROWS)
        else:
            covered = measured_shapes.issuperset(self.candidate_shapes)
            due = len(rows) >= (FIRST_REFIT_ROWS if covered else MIN_REFIT_ROWS)
        if len(rows) < FIRST_REFIT_ROWS or len(measured_shapes) < 2 or not (force or due):
            return None
        self._last_refit_rows = self._measured_total
        x, shapes, y = self._measured_matrix(rows)
        try:
            fitted = AnalyticStepTime.fit(x, y)
        except (ValueError, np.linalg.LinAlgError) as exc:
            logger.warning("adatree: analytic refit failed: %s", exc)
            return None
        self._refit_mape = mape(fitted.predict_matrix(x), y)
        cost_model = OnlineCostModel(fitted, self.config.residual_decay)
        cost_model.replay(x, shapes, y)
        return cost_model

    @staticmethod
    def _measured_matrix(
        rows: list[_Measured],
    ) -> tuple[np.ndarray, list[TreeShape], np.ndarray]:
        """Measured steps as (feature rows [rows, NUM_FEATURES], shapes, ms [rows]).

        What a replacing cost model is fitted on and replays: a fresh model would start every
        shape's correction at zero and forget what the measurements taught (in a CPU run,
        refits every 128 steps predicted trees at 27-38 ms that had measured 280-380 ms, and
        each tree was run again to learn it anew).
        """
        shapes = [m.shape for m in rows]
        x = feature_rows([m.features for m in rows], shapes)
        return x, shapes, np.array([m.measured_ms for m in rows])


def broadcast_decision(decision: Any, group: Any) -> Any:
    """Rank 0's decision on every rank of ``group`` (SGLang's ``GroupCoordinator``).

    Each rank's policy sees the same batches and acceptance, but measures its own step times,
    so cost corrections (and with them decisions) could drift apart; every rank runs rank 0's.
    One small object over the CPU group per step.
    """
    if group.world_size <= 1:
        return decision
    return group.broadcast_object(decision, src=0)


def _predicted(decision: Decision) -> float:
    return decision.predicted_ms
