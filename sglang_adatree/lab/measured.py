"""Step-time profiles from measured decode steps: a deployment's telemetry, or a profiled server.

Two sources, one rule:

* ``profile_from_telemetry``: the ``steps`` rows a deployment recorded (the learnable ones,
  ``telemetry.learning.learnable``: a measured time, not a catch-up step), of one run or all,
  so an operator can ask what adatree would do with their GPU's own step times
  (``source="telemetry"``);
* ``profile_from_served_steps``: the step log of an ``adatree profile --concurrency ...`` server
  (``ADATREE_PROFILE_PATH``; ``source="measured"``).

The rule (``profile_from_steps``): the grid's batch sizes are the padded batch sizes the steps
ran at (thinned to ``MAX_BATCH_POINTS`` spread geometrically when there are more), its contexts
the powers of two nearest the steps' mean context per request; each step counts in the cell of
its shape at the nearest grid point of each axis. A cell with at least ``min_rows`` steps holds
their median step time (measured). Every other cell is filled from the analytic model
(``core.cost_model.AnalyticStepTime.fit``) fitted on all the steps, every shape's together so
the batch and context terms come from all of them, times the shape's own median ratio of
measured to fitted time (1 for a shape that has no steps): the fit gives the cell's trend, the
shape's steps its level. ``notes`` count the cells measured and filled, per shape too.

The CUDA-graph padding of a telemetry profile is the set of padded batch sizes seen, when any
step ran padded (a GPU with graphs), and none otherwise; a batch then runs padded to the next
size the deployment was seen to use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import URL, Engine, select

from sglang_adatree.core.cost_model import MIN_STEP_MS, AnalyticStepTime
from sglang_adatree.core.features import NO_GRAPHS, GraphPadding, build_feature_matrix
from sglang_adatree.core.policy import teaches_cost_model
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.core.step_profile import TableProfile
from sglang_adatree.telemetry.learning import learnable
from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.store import check_schema_at_head, display_url, get_engine

MIN_CELL_ROWS = 5  # steps a cell needs for its median to stand; fewer: filled by the fit
MAX_BATCH_POINTS = 64
MAX_FIT_ROWS = 200_000


@dataclass(frozen=True)
class MeasuredSteps:
    """Measured decode steps, one row each."""

    batch_size: np.ndarray  # [rows] requests in the step
    padded_batch_size: np.ndarray  # [rows] the batch size it ran as
    sum_context_len: np.ndarray  # [rows] context tokens of its requests
    shape_cols: np.ndarray  # [rows, 3] steps, topk, num_draft_tokens
    step_ms: np.ndarray  # [rows] measured step time

    def __post_init__(self) -> None:
        n = self.step_ms.shape[0]
        for a in (self.batch_size, self.padded_batch_size, self.sum_context_len, self.step_ms):
            assert a.shape == (n,), f"every column must be [rows], got {a.shape} for {n} rows"
        assert self.shape_cols.shape == (n, 3), (
            f"shape_cols must be [rows, 3], got {self.shape_cols.shape}"
        )

    def __len__(self) -> int:
        return int(self.step_ms.shape[0])

    @property
    def mean_context_len(self) -> np.ndarray:  # [rows]
        return self.sum_context_len / np.maximum(self.batch_size, 1)

    def feature_matrix(self) -> np.ndarray:  # [rows, NUM_FEATURES]
        mean = self.mean_context_len
        return build_feature_matrix(
            self.batch_size, self.padded_batch_size, self.sum_context_len, mean, self.shape_cols
        )


def _batch_grid(padded: np.ndarray) -> tuple[int, ...]:
    sizes = np.unique(padded.astype(np.int64))
    if sizes.size > MAX_BATCH_POINTS:
        targets = np.geomspace(sizes[0], sizes[-1], MAX_BATCH_POINTS)
        nearest = np.abs(np.log(sizes)[None, :] - np.log(targets)[:, None]).argmin(axis=1)
        sizes = np.unique(sizes[nearest])
    return tuple(int(s) for s in sizes)


def _nearest(grid: Sequence[int], values: np.ndarray) -> np.ndarray:
    """``[rows]`` index of the point of the ascending ``grid`` nearest each value, in log
    scale."""
    logs = np.log(np.asarray(grid, dtype=np.float64))  # [grid]
    v = np.log(np.maximum(values, 1.0))  # [rows]
    if logs.size == 1:
        return np.zeros(v.shape, dtype=np.int64)
    hi = np.clip(np.searchsorted(logs, v), 1, logs.size - 1)
    lo = hi - 1
    return np.where(v - logs[lo] <= logs[hi] - v, lo, hi)


def _shape_keys(shape_cols: np.ndarray) -> np.ndarray:
    """``[rows]`` int64 key of each (steps, topk, num_draft_tokens) row of ``[rows, 3]``."""
    c = np.asarray(shape_cols, dtype=np.int64).reshape(-1, 3)
    return (c[:, 0] * 1000 + c[:, 1]) * 1000 + c[:, 2]


def _cols_of(shapes: Sequence[TreeShape]) -> np.ndarray:
    """``[shapes, 3]`` float64 (steps, topk, num_draft_tokens)."""
    return np.array([[s.steps, s.topk, s.num_draft_tokens] for s in shapes], dtype=np.float64)


def _unkey(key: int) -> tuple[int, int, int]:
    return key // 1_000_000, key // 1000 % 1000, key % 1000


def _cell_medians(
    cell: np.ndarray, ms: np.ndarray, num_cells: int
) -> tuple[np.ndarray, np.ndarray]:
    """(median step time, steps) per flat cell index, ``[num_cells]`` each (NaN, 0 where none)."""
    order = np.lexsort((ms, cell))
    cell, ms = cell[order], ms[order]
    keys, starts, counts = np.unique(cell, return_index=True, return_counts=True)
    medians = np.full(num_cells, np.nan)
    medians[keys] = 0.5 * (ms[starts + (counts - 1) // 2] + ms[starts + counts // 2])
    full_counts = np.zeros(num_cells, dtype=np.int64)
    full_counts[keys] = counts
    return medians, full_counts


def _context_grid(mean_context: np.ndarray) -> tuple[int, ...]:
    exponents = np.round(np.log2(np.maximum(mean_context, 1.0))).astype(np.int64)
    return tuple(2**e for e in range(int(exponents.min()), int(exponents.max()) + 1))


def profile_from_steps(
    steps: MeasuredSteps,
    *,
    name: str,
    source: str,
    made_by: str,
    shapes: Sequence[TreeShape] | None = None,
    padding: GraphPadding = NO_GRAPHS,
    min_rows: int = MIN_CELL_ROWS,
    notes: dict[str, Any] | None = None,
) -> TableProfile:
    """A profile of ``steps``' medians per cell, filled where they are too few; see the module
    docstring. ``shapes`` defaults to the shapes the steps ran."""
    if len(steps) == 0:
        raise ValueError("no measured steps to build a profile from")
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    row_keys = _shape_keys(steps.shape_cols)  # [rows]
    if shapes is None:
        shapes = tuple(sorted(TreeShape(*_unkey(k)) for k in np.unique(row_keys).tolist()))
    shapes = tuple(shapes)
    batch_sizes = _batch_grid(steps.padded_batch_size)
    context_lens = _context_grid(steps.mean_context_len)
    nb, nc = len(batch_sizes), len(context_lens)
    # [rows] the row's shape in ``shapes``, -1 for a shape the profile leaves out
    position = {k: i for i, k in enumerate(_shape_keys(_cols_of(shapes)).tolist())}
    seen, inverse = np.unique(row_keys, return_inverse=True)
    shape_index = np.array([position.get(k, -1) for k in seen.tolist()])[inverse]
    hit = shape_index >= 0
    cell = (
        shape_index * (nb * nc)
        + _nearest(batch_sizes, steps.padded_batch_size) * nc
        + _nearest(context_lens, steps.mean_context_len)
    )  # [rows] flat index into ms; negative for rows left out
    medians, counts = _cell_medians(cell[hit], steps.step_ms[hit], len(shapes) * nb * nc)

    x = steps.feature_matrix()  # [rows, NUM_FEATURES]
    every = max(1, len(steps) // MAX_FIT_ROWS)  # seven coefficients need no million rows
    model = AnalyticStepTime.fit(x[::every], steps.step_ms[::every])
    ratio = steps.step_ms / np.maximum(model.predict_matrix(x), MIN_STEP_MS)  # [rows]
    grid_b = np.repeat(np.asarray(batch_sizes, dtype=np.float64), nc)  # [nb * nc]
    grid_c = np.tile(np.asarray(context_lens, dtype=np.float64), nb)  # [nb * nc]
    fitted = np.empty((len(shapes), nb * nc))  # [shapes, nb * nc]
    per_shape: dict[str, dict[str, Any]] = {}
    enough = (counts >= min_rows).reshape(len(shapes), nb * nc)  # [shapes, nb * nc]
    for i, shape in enumerate(shapes):
        mine = shape_index == i  # [rows]
        scale = float(np.median(ratio[mine])) if mine.any() else 1.0
        cols = np.repeat(_cols_of([shape]), nb * nc, axis=0)  # [nb * nc, 3]
        grid_x = build_feature_matrix(grid_b, grid_b, grid_b * grid_c, grid_c, cols)
        fitted[i] = np.maximum(scale * model.predict_matrix(grid_x), MIN_STEP_MS)
        measured = int(enough[i].sum())
        per_shape[str(shape)] = {
            "rows": int(mine.sum()),
            "cells_measured": measured,
            "cells_filled": nb * nc - measured,
            "fit_scale": round(scale, 4),
        }
    ms = np.where(enough, medians.reshape(len(shapes), nb * nc), fitted).reshape(
        len(shapes), nb, nc
    )
    cells_measured = sum(v["cells_measured"] for v in per_shape.values())
    return TableProfile(
        name=name,
        source=source,
        made_by=made_by,
        shapes=shapes,
        batch_sizes=batch_sizes,
        context_lens=context_lens,
        ms=ms,
        padding=padding,
        notes={
            **(notes or {}),
            "rows": len(steps),
            "min_rows_per_cell": min_rows,
            "cells_measured": cells_measured,
            "cells_filled": int(ms.size) - cells_measured,
            "fill": (
                "AnalyticStepTime fitted on every shape's steps, times the shape's median "
                "measured / fitted ratio"
            ),
            "fit": {k: round(v, 8) for k, v in model.to_dict().items()},
            "per_shape": per_shape,
        },
    )


def _read_learnable(engine: Engine, run_id: int | None) -> MeasuredSteps:
    stmt = select(
        Step.batch_size,
        Step.padded_batch_size,
        Step.sum_context_len,
        Step.steps,
        Step.topk,
        Step.num_draft_tokens,
        Step.measured_step_ms,
    ).where(learnable(), Step.batch_size >= 1)
    if run_id is not None:
        stmt = stmt.where(Step.run_id == run_id)
    with engine.connect() as conn:
        rows = conn.execute(stmt).all()
    # Tuples, not Rows: numpy's probing of a Row is slow.
    table = np.array(list(map(tuple, rows)), dtype=np.float64).reshape(len(rows), 7)
    return MeasuredSteps(table[:, 0], table[:, 1], table[:, 2], table[:, 3:6], table[:, 6])


def profile_from_telemetry(
    db_url: str | URL | Engine,
    run_id: int | None = None,
    shapes: Sequence[TreeShape] | None = None,
    *,
    min_rows: int = MIN_CELL_ROWS,
    made_by: str | None = None,
) -> TableProfile:
    """The profile of a deployment's recorded steps (of ``run_id``, or of every run); see the
    module docstring. Raises ``ValueError`` when there are no learnable steps."""
    engine = db_url if isinstance(db_url, Engine) else get_engine(db_url)
    check_schema_at_head(engine)
    steps = _read_learnable(engine, run_id)
    shown = display_url(engine.url)
    which = "every run" if run_id is None else f"run {run_id}"
    if len(steps) == 0:
        raise ValueError(f"no learnable steps in {shown} ({which})")
    padded = steps.padded_batch_size > steps.batch_size
    padding = (
        GraphPadding(tuple(int(b) for b in np.unique(steps.padded_batch_size)))
        if padded.any()
        else NO_GRAPHS
    )
    call = f"profile_from_telemetry({shown!r}, run_id={run_id})"
    return profile_from_steps(
        steps,
        name="telemetry" if run_id is None else f"telemetry-run{run_id}",
        source="telemetry",
        made_by=made_by or f"sglang_adatree.lab.measured.{call} on {date.today().isoformat()}",
        shapes=shapes,
        padding=padding,
        min_rows=min_rows,
        notes={"db": shown, "runs": which},
    )


def follows_a_change(row: Mapping[str, Any]) -> bool:
    """Whether a step-log row ran right after a step of another shape. Such a step pays for the
    change (on a CPU a plain decode after a speculative step costs most of a step more than the
    next one), which a server that keeps a shape for a stretch pays once in the stretch; a
    profile prices the stretch. Lines that do not name the shape before them count as not."""
    previous = row.get("previous_shape")
    return previous is not None and previous != row["shape"]


def read_step_log(path: Path) -> MeasuredSteps:
    """The steps of an ``ADATREE_PROFILE_PATH`` log that a profile can use.

    Left out: catch-up steps (no speculation plus the draft's extend: neither a plain step nor
    a speculative one), steps right after a step of another shape (``follows_a_change``),
    steps without model forwards, and lines without ``sum_context_len`` (logs of servers from
    before it was logged). A step without speculation is charged its time less the draft's
    forwards, so that one that ran the draft's extend (a server with ``skip_idle_draft_extend``
    off) is priced as the step adatree serves, which skips it.
    """
    values: list[tuple[float, ...]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        source = row.get("source") or "model"
        if not teaches_cost_model(source, row.get("step_ms")) or row.get("forward_ms", 0.0) <= 0:
            continue
        if row.get("sum_context_len") is None or follows_a_change(row):
            continue
        shape = TreeShape.parse(row["shape"])
        ms = row["step_ms"]
        if not shape.speculative:
            ms -= row.get("draft_forward_ms", 0.0)
        b = row["batch_size"]
        values.append(
            (b, b, row["sum_context_len"], shape.steps, shape.topk, shape.num_draft_tokens, ms)
        )
    table = np.array(values, dtype=np.float64).reshape(len(values), 7)
    return MeasuredSteps(table[:, 0], table[:, 1], table[:, 2], table[:, 3:6], table[:, 6])


def profile_from_served_steps(
    path: Path,
    *,
    made_by: str,
    name: str = "cpu-served",
    shapes: Sequence[TreeShape] | None = None,
    min_rows: int = MIN_CELL_ROWS,
    notes: dict[str, Any] | None = None,
) -> TableProfile:
    """The profile of a profiled server's step log (``read_step_log``); no CUDA graphs."""
    steps = read_step_log(path)
    if len(steps) == 0:
        raise ValueError(
            f"{path}: no usable steps (a log from before sum_context_len was logged, or only "
            "catch-up steps or steps after a change of shape)"
        )
    return profile_from_steps(
        steps,
        name=name,
        source="measured",
        made_by=made_by,
        shapes=shapes,
        min_rows=min_rows,
        notes={**(notes or {}), "step_log": path.name},
    )
