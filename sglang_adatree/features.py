"""Step features: what one decode step looks like to a cost model.

``StepFeatures`` describes the batch of one decode step with numbers every tensor-parallel rank
knows identically (batch size, context lengths, prefill tokens). A cost model never sees it
directly: it sees the fixed feature vector of a ``(StepFeatures, TreeShape)`` pair, one column
per name in ``FEATURE_NAMES``, in that order:

* ``batch_size``: requests in the decode batch, B.
* ``padded_batch_size``: the CUDA-graph batch size SGLang pads B to (``padded_batch_size()``);
  graph replay runs the padded batch, so step time jumps where B crosses a capture size.
* ``steps``, ``topk``, ``num_draft_tokens``: the shape.
* ``speculative``: 1 for a speculative shape, 0 for no speculation (a different code path:
  no draft passes, no tree build, no verify mask).
* ``verified_tokens``: ``B * num_draft_tokens``, tokens the target runs (B for no speculation).
* ``padded_verified_tokens``: ``padded_batch_size * num_draft_tokens``, tokens the verify
  CUDA graph actually computes; matmul tiling makes time step up at multiples of its tile.
* ``draft_tokens``: ``B * steps * topk``, tokens the draft model runs over its passes.
* ``sum_context_len``, ``max_context_len``: KV tokens read by the batch and by its longest
  request (attention kernels split work by the longest sequence).
* ``prefill_tokens``: new prompt tokens run in the same forward pass (0 for a pure decode step).
* ``attention_tokens``: ``sum_context_len * num_draft_tokens``, query-key pairs the verify
  attention scores; verify attention grows with tree size times context, not with either alone.

Worked example: B = 3 requests with contexts 100, 200 and 700 under shape ``(3, 2, 6)`` give
padded batch 3, verified tokens 18, draft tokens 18, sum context 1000, attention tokens 6000.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_adatree.shapes import TreeShape


def spec_cuda_graph_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """SGLang 0.5.23's decode capture sizes when speculating, up to ``max_bs``.

    Mirrors ``generate_decode_cuda_graph_batch_sizes`` (``arg_groups/cuda_graph_hook.py``),
    speculative branch: less padding at small batch sizes than without speculation.
    """
    sizes = (
        list(range(1, 9))
        + list(range(10, 33, 2))
        + list(range(40, 65, 4))
        + list(range(72, 257, 8))
        + list(range(272, max_bs + 1, 16))
    )
    sizes = [bs for bs in sizes if bs <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return tuple(sizes)


# SGLang's default decode-graph max batch size on H100 / H200 at tensor parallelism below 4
# (``arg_groups/memory_hook.py``); larger batches run without a CUDA graph and are not padded.
DEFAULT_CUDA_GRAPH_MAX_BS = 256
DEFAULT_CUDA_GRAPH_BS: tuple[int, ...] = spec_cuda_graph_batch_sizes(DEFAULT_CUDA_GRAPH_MAX_BS)

# Padded size for every batch size up to the largest capture size: a list index is cheaper
# than a bisect on the decision path.
_PADDED = [0] + [
    DEFAULT_CUDA_GRAPH_BS[bisect.bisect_left(DEFAULT_CUDA_GRAPH_BS, b)]
    for b in range(1, DEFAULT_CUDA_GRAPH_MAX_BS + 1)
]
_PADDED_TABLE = np.asarray(_PADDED, dtype=np.float64)  # [DEFAULT_CUDA_GRAPH_MAX_BS + 1]


def padded_batch_size(batch_size: int) -> int:
    """The CUDA-graph capture size SGLang pads ``batch_size`` to (itself past the largest)."""
    if batch_size <= DEFAULT_CUDA_GRAPH_MAX_BS:
        return _PADDED[batch_size]
    return batch_size


@dataclass(frozen=True)
class StepFeatures:
    """The batch of one decode step, as every tensor-parallel rank sees it.

    ``request_class`` names the workload class when the whole batch shares one (for example a
    prompt set); the acceptance estimator can keep separate statistics per class.
    """

    batch_size: int
    sum_context_len: int
    max_context_len: int
    prefill_tokens: int = 0
    request_class: str | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.sum_context_len < 0 or self.max_context_len < 0 or self.prefill_tokens < 0:
            raise ValueError(f"context lengths and prefill tokens must be >= 0: {self}")
        if self.max_context_len > self.sum_context_len:
            raise ValueError(f"max_context_len exceeds sum_context_len: {self}")

    @classmethod
    def from_context_lens(
        cls,
        context_lens: Sequence[int],
        prefill_tokens: int = 0,
        request_class: str | None = None,
    ) -> StepFeatures:
        """Features of a batch with these per-request context lengths."""
        lens = [int(n) for n in context_lens]
        return cls(len(lens), sum(lens), max(lens, default=0), prefill_tokens, request_class)


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
    "prefill_tokens",
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
    sum_context_len: np.ndarray,
    max_context_len: np.ndarray,
    prefill_tokens: np.ndarray,
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
    padded = _padded_array(bs)  # [rows]
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
    out[:, 11] = np.asarray(prefill_tokens, dtype=np.float64)
    out[:, 12] = ctx * ndt
    return out


def feature_matrix(features: StepFeatures, shapes: Sequence[TreeShape]) -> np.ndarray:
    """``[len(shapes), NUM_FEATURES]``: one step's batch under each candidate shape."""
    f = features
    return build_feature_matrix(
        np.array([f.batch_size], dtype=np.float64),
        np.array([f.sum_context_len], dtype=np.float64),
        np.array([f.max_context_len], dtype=np.float64),
        np.array([f.prefill_tokens], dtype=np.float64),
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
        np.array([f.sum_context_len for f in features], dtype=np.float64),
        np.array([f.max_context_len for f in features], dtype=np.float64),
        np.array([f.prefill_tokens for f in features], dtype=np.float64),
        shape_columns(shapes),
    )


def _padded_array(batch_size: np.ndarray) -> np.ndarray:
    """Vectorised ``padded_batch_size`` over a float array of batch sizes."""
    idx = np.minimum(batch_size, DEFAULT_CUDA_GRAPH_MAX_BS).astype(np.int64)
    return np.where(batch_size <= DEFAULT_CUDA_GRAPH_MAX_BS, _PADDED_TABLE[idx], batch_size)
