"""A step-time model tabulated over bucketed batches, so a decision costs array lookups.

One ``Booster.inplace_predict`` of 16 rows costs about 0.4 ms on a CPU, far over the decision
budget, so when a model is activated its predictions are tabulated once for every candidate
shape over a grid of batches:

* batch size: every integer 1 .. ``max_batch_size`` (exact: padding jumps live here);
* mean context per request and longest-to-mean context ratio: a few grid points each,
  linearly interpolated between (clamped at the ends).

The padded batch size of each tabulated batch comes from the serving engine's ``GraphPadding``,
the same the decode steps' features carry. ``lookup(features)`` returns the ``[num_shapes]``
row for a batch: one basic slice of the table and two interpolations. Batches larger than
``max_batch_size`` return None and the caller predicts directly. ``table_error`` measures how
far lookups are from direct predictions.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_adatree.core.cost_model import MIN_STEP_MS, StepTimeModel
from sglang_adatree.core.features import (
    NO_GRAPHS,
    GraphPadding,
    StepFeatures,
    build_feature_matrix,
    feature_rows,
    shape_columns,
)
from sglang_adatree.core.shapes import TreeShape


@dataclass(frozen=True)
class TableGrid:
    """Grid points of the interpolated axes; every axis needs at least two points."""

    max_batch_size: int = 256
    mean_context: tuple[float, ...] = (
        64.0,
        256.0,
        1024.0,
        2048.0,
        4096.0,
        8192.0,
        16384.0,
        32768.0,
    )
    longest_ratio: tuple[float, ...] = (1.0, 2.0, 4.0)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        for name in ("mean_context", "longest_ratio"):
            points = getattr(self, name)
            if len(points) < 2 or list(points) != sorted(set(points)):
                raise ValueError(f"{name} needs >= 2 increasing grid points, got {points}")

    @property
    def rows_per_shape(self) -> int:
        return self.max_batch_size * len(self.mean_context) * len(self.longest_ratio)


class CostTable:
    """Predictions of one step-time model over ``grid`` x ``shapes``; see the module docstring."""

    def __init__(self, shapes: Sequence[TreeShape], grid: TableGrid, values: np.ndarray) -> None:
        self.shapes = tuple(shapes)
        self.index = {s: i for i, s in enumerate(self.shapes)}
        self.grid = grid
        expected = (
            grid.max_batch_size,
            len(grid.mean_context),
            len(grid.longest_ratio),
            len(self.shapes),
        )
        assert values.shape == expected, f"table {values.shape}, grid needs {expected}"
        # [batch_size - 1, mean_context, longest_ratio, shape] ms
        self.values = values
        self._axes = (list(grid.mean_context), list(grid.longest_ratio))

    @classmethod
    def build(
        cls,
        model: StepTimeModel,
        shapes: Sequence[TreeShape],
        grid: TableGrid | None = None,
        padding: GraphPadding = NO_GRAPHS,
        chunk_rows: int = 200_000,
    ) -> CostTable:
        """Tabulate ``model`` (seconds for an XGBoost model; run it off the decode loop)."""
        grid = grid or TableGrid()
        shapes = tuple(shapes)
        b = np.arange(1, grid.max_batch_size + 1, dtype=np.float64)
        mesh = np.meshgrid(
            b,
            np.asarray(grid.mean_context),
            np.asarray(grid.longest_ratio),
            np.arange(len(shapes)),
            indexing="ij",
        )
        bs, mean, ratio, shape_idx = (m.ravel() for m in mesh)  # each [rows]
        padded = padding.padded_array(bs)
        total = bs * mean
        longest = np.minimum(total, mean * ratio)
        cols = shape_columns(shapes)[shape_idx.astype(np.int64)]  # [rows, 3]
        out = np.empty(bs.size)
        for start in range(0, bs.size, chunk_rows):
            sl = slice(start, start + chunk_rows)
            x = build_feature_matrix(bs[sl], padded[sl], total[sl], longest[sl], cols[sl])
            out[sl] = model.predict_matrix(x)
        values = np.maximum(out, MIN_STEP_MS).reshape(mesh[0].shape)
        return cls(shapes, grid, values)

    def lookup(self, features: StepFeatures) -> np.ndarray | None:
        """``[len(shapes)]`` interpolated predictions, or None past ``max_batch_size``."""
        b = features.batch_size
        if b > self.grid.max_batch_size:
            return None
        mean = features.sum_context_len / b
        ratio = features.max_context_len / mean if mean > 0 else 1.0
        i, wi = _bracket(self._axes[0], mean)
        j, wj = _bracket(self._axes[1], ratio)
        vi, vj = 1.0 - wi, 1.0 - wj
        # Bilinear weights of the 4 surrounding grid points, in the block's C order.
        weights = np.array([vi * vj, vi * wj, wi * vj, wi * wj])
        block = self.values[b - 1, i : i + 2, j : j + 2]  # [2, 2, shapes]
        return weights @ block.reshape(4, -1)  # [shapes]


def _bracket(axis: list[float], value: float) -> tuple[int, float]:
    """Lower grid index and interpolation weight for ``value``, clamped to the axis ends."""
    i = min(max(bisect.bisect_right(axis, value) - 1, 0), len(axis) - 2)
    lo, hi = axis[i], axis[i + 1]
    return i, min(max((value - lo) / (hi - lo), 0.0), 1.0)


def table_error(
    model: StepTimeModel, table: CostTable, features: Sequence[StepFeatures]
) -> tuple[float, float]:
    """Mean and 99th-percentile relative error of lookups against direct predictions.

    Every batch in ``features`` is checked under every shape of the table; batches past the
    grid are skipped (they are predicted directly anyway).
    """
    inside = [f for f in features if f.batch_size <= table.grid.max_batch_size]
    if not inside:
        raise ValueError("no batch inside the table's grid")
    looked_up = np.stack([table.lookup(f) for f in inside])  # [batches, shapes]
    n = len(table.shapes)
    direct = model.predict_matrix(
        feature_rows([f for f in inside for _ in range(n)], list(table.shapes) * len(inside))
    ).reshape(len(inside), n)
    err = np.abs(looked_up - np.maximum(direct, MIN_STEP_MS)) / np.maximum(direct, MIN_STEP_MS)
    return float(err.mean()), float(np.quantile(err, 0.99))
