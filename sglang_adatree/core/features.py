"""Step features: what one decode step looks like to a cost model.

``StepFeatures`` describes the batch of one decode step with numbers every tensor-parallel rank
knows identically (batch size, the batch size the engine pads it to, context lengths). A cost
model never sees it directly: it sees the fixed feature vector of a ``(StepFeatures,
TreeShape)`` pair, one column per name in ``FEATURE_NAMES``, in that order:

* ``batch_size``: requests in the decode batch, B.
* ``padded_batch_size``: the CUDA-graph batch size the engine pads B to (``GraphPadding``,
  built from the capture sizes the SGLang adapter reads off the running engine; B itself
  without graphs); graph replay runs the padded batch, so step time jumps where B crosses a
  capture size.
* ``steps``, ``topk``, ``num_draft_tokens``: the shape.
* ``speculative``: 1 for a speculative shape, 0 for no speculation (a different code path:
  no draft passes, no tree build, no verify mask).
* ``verified_tokens``: ``B * num_draft_tokens``, tokens the target runs (B for no speculation).
* ``padded_verified_tokens``: ``padded_batch_size * num_draft_tokens``, tokens the verify
  CUDA graph actually computes; matmul tiling makes time step up at multiples of its tile.
* ``draft_tokens``: ``B * steps * topk``, tokens the draft model runs over its passes.
* ``sum_context_len``, ``max_context_len``: KV tokens read by the batch and by its longest
  request (attention kernels split work by the longest sequence).
* ``attention_tokens``: ``sum_context_len * num_draft_tokens``, query-key pairs the verify
  attention scores; verify attention grows with tree size times context, not with either alone.

Worked example: B = 3 requests with contexts 100, 200 and 700 under shape ``(3, 2, 6)``,
graphs captured for batch sizes 1, 2, 4, 8: padded batch 4, verified tokens 18, padded
verified tokens 24, draft tokens 18, sum context 1000, attention tokens 6000.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_adatree.core.shapes import TreeShape


@dataclass(frozen=True)
class GraphPadding:
    """The decode batch sizes the engine captured CUDA graphs for, ascending; ``()`` when it
    runs without graphs (a CPU, ``--disable-cuda-graph``). A batch runs padded to the
    smallest capture size that holds it; past the largest, unpadded."""

    capture_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        sizes = self.capture_sizes
        if list(sizes) != sorted(set(sizes)) or (sizes and sizes[0] < 1):
            raise ValueError(f"capture sizes must be increasing and >= 1, got {sizes}")

    def padded(self, batch_size: int) -> int:
        """The batch size a batch of ``batch_size`` requests runs as."""
        sizes = self.capture_sizes
        i = bisect.bisect_left(sizes, batch_size)
        return sizes[i] if i < len(sizes) else batch_size

    def padded_array(self, batch_size: np.ndarray) -> np.ndarray:
        """``padded`` over an array of batch sizes (any shape, float or int)."""
        bs = np.asarray(batch_size, dtype=np.float64)
        if not self.capture_sizes:
            return bs.copy()
        sizes = np.asarray(self.capture_sizes, dtype=np.float64)
        i = np.searchsorted(sizes, bs, side="left")
        return np.where(i < sizes.size, sizes[np.minimum(i, sizes.size - 1)], bs)


NO_GRAPHS = GraphPadding()


@dataclass(frozen=True)
class StepFeatures:
    """The batch of one decode step, as every tensor-parallel rank sees it."""

    batch_size: int
    padded_batch_size: int
    sum_context_len: int
    max_context_len: int

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.padded_batch_size < self.batch_size:
            raise ValueError(f"padded_batch_size below batch_size: {self}")
        if self.sum_context_len < 0 or self.max_context_len < 0:
            raise ValueError(f"context lengths must be >= 0: {self}")
        if self.max_context_len > self.sum_context_len:
            raise ValueError(f"max_context_len exceeds sum_context_len: {self}")

    @classmethod
    def from_context_lens(
        cls, context_lens: Sequence[int], padding: GraphPadding = NO_GRAPHS
    ) -> StepFeatures:
        """Features of a batch with these per-request context lengths."""
        lens = [int(n) for n in context_lens]
        return cls(len(lens), padding.padded(len(lens)), sum(lens), max(lens, default=0))


FEATURE_NAMES: tuple[str, ...] = (
    "batch_size",
    "padded_batch_size",
    "steps",
    "topk",
    "num_draft_tokens",
    "speculative",
    "verified_tokens",
    "padded_verified_tokens",
    "draft_tokens",
    "sum_context_len",
    "max_context_len",
    "attention_tokens",
)
NUM_FEATURES = len(FEATURE_NAMES)
COLUMN: dict[str, int] = {name: i for i, name in enumerate(FEATURE_NAMES)}


def shape_columns(shapes: Sequence[TreeShape]) -> np.ndarray:
    """``[num_shapes, 3]`` float64 array of (steps, topk, num_draft_tokens) per shape."""
    return np.array(
        [(s.steps, s.topk, s.num_draft_tokens) for s in shapes], dtype=np.float64
    ).reshape(len(shapes), 3)


def build_feature_matrix(
    batch_size: np.ndarray,
    padded_batch_size: np.ndarray,
    sum_context_len: np.ndarray,
    max_context_len: np.ndarray,
    shape_cols: np.ndarray,
) -> np.ndarray:
    """Feature rows from per-row batch numbers and shape columns; the one place they are defined.

    All four batch arrays are ``[rows]`` and ``shape_cols`` is ``[rows, 3]`` (see
    ``shape_columns``); broadcasting lets callers pass one shape per row or one batch per row.
    Returns ``[rows, NUM_FEATURES]`` float64 in ``FEATURE_NAMES`` order.
    """
    bs = np.asarray(batch_size, dtype=np.float64)  # [rows]
    assert bs.ndim == 1 and shape_cols.ndim == 2 and shape_cols.shape[1] == 3, "bad shapes"
    rows = max(bs.shape[0], shape_cols.shape[0])
    steps, topk, ndt = shape_cols[:, 0], shape_cols[:, 1], shape_cols[:, 2]  # [rows] each
    padded = np.asarray(padded_batch_size, dtype=np.float64)  # [rows]
    ctx = np.asarray(sum_context_len, dtype=np.float64)
    out = np.empty((rows, NUM_FEATURES), dtype=np.float64)
    out[:, 0] = bs
    out[:, 1] = padded
    out[:, 2] = steps
    out[:, 3] = topk
    out[:, 4] = ndt
    out[:, 5] = steps > 0
    out[:, 6] = bs * ndt
    out[:, 7] = padded * ndt
    out[:, 8] = bs * steps * topk
    out[:, 9] = ctx
    out[:, 10] = np.asarray(max_context_len, dtype=np.float64)
    out[:, 11] = ctx * ndt
    return out


def feature_matrix(features: StepFeatures, shapes: Sequence[TreeShape]) -> np.ndarray:
    """``[len(shapes), NUM_FEATURES]``: one step's batch under each candidate shape."""
    f = features
    return build_feature_matrix(
        np.array([f.batch_size], dtype=np.float64),
        np.array([f.padded_batch_size], dtype=np.float64),
        np.array([f.sum_context_len], dtype=np.float64),
        np.array([f.max_context_len], dtype=np.float64),
        shape_columns(shapes),
    )


def feature_rows(features: Sequence[StepFeatures], shapes: Sequence[TreeShape]) -> np.ndarray:
    """``[len(features), NUM_FEATURES]``: row i is ``features[i]`` under ``shapes[i]``.

    This is how a training set of measured steps becomes a matrix.
    """
    if len(features) != len(shapes):
        raise ValueError(f"{len(features)} feature rows but {len(shapes)} shapes")
    return build_feature_matrix(
        np.array([f.batch_size for f in features], dtype=np.float64),
        np.array([f.padded_batch_size for f in features], dtype=np.float64),
        np.array([f.sum_context_len for f in features], dtype=np.float64),
        np.array([f.max_context_len for f in features], dtype=np.float64),
        shape_columns(shapes),
    )
