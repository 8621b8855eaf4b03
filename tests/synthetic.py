"""A synthetic step-time surface with a GPU's padding jumps, for testing cost models on a CPU.

Real decode steps do not cost a linear function of tokens: CUDA-graph replay runs the padded
batch, and matmuls run whole tiles, so time steps up each time ``padded_batch_size *
num_draft_tokens`` crosses a multiple of the tile (64 tokens here) and each time the batch
crosses a capture size. This module draws batches and shapes like a serving run would and times
them on such a surface, with multiplicative noise, so tests and ``scripts/bench_policy.py`` can
fit and check cost models without a GPU. It models no particular GPU; the constants only give
the surface a realistic scale (about 5 ms for one request, tens of ms for large trees at
batch 256).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_adatree.core.features import COLUMN, GraphPadding, StepFeatures
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.lab.passes import SPEC_GRAPH_PADDING

TILE_TOKENS = 64
# The decode capture sizes SGLang 0.5.23 uses when speculating on an H100-class GPU, as a GPU
# engine would report them.
GPU_PADDING = SPEC_GRAPH_PADDING


@dataclass(frozen=True)
class SyntheticSurface:
    """Step time in ms as a function of the feature vector; see the module docstring."""

    fixed_ms: float = 4.0
    per_tile_ms: float = 0.45  # each started tile of 64 padded verified tokens
    per_padded_request_ms: float = 0.006
    per_kv_token_ms: float = 2.0e-5
    per_attention_token_ms: float = 1.5e-6
    per_draft_pass_ms: float = 0.35
    per_draft_token_ms: float = 0.0015
    tree_build_ms: float = 0.25  # tree build and mask for any speculative shape
    noise: float = 0.01  # sigma of the log-normal noise

    def step_ms(self, x: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """``[rows]`` step times for feature rows ``x`` ``[rows, NUM_FEATURES]``."""
        assert x.ndim == 2 and x.shape[1] == len(COLUMN), f"bad feature matrix {x.shape}"
        col = {name: x[:, i] for name, i in COLUMN.items()}  # each [rows]
        tiles = np.ceil(col["padded_verified_tokens"] / TILE_TOKENS)
        ms = (
            self.fixed_ms
            + self.per_tile_ms * tiles
            + self.per_padded_request_ms * col["padded_batch_size"]
            + self.per_kv_token_ms * col["sum_context_len"]
            + self.per_attention_token_ms * col["attention_tokens"]
            + self.per_draft_pass_ms * col["steps"]
            + self.per_draft_token_ms * col["draft_tokens"]
            + self.tree_build_ms * col["speculative"]
        )
        if rng is not None and self.noise > 0:
            ms = ms * np.exp(rng.normal(0.0, self.noise, size=ms.shape))
        return ms


def sample_steps(
    n: int,
    shapes: Sequence[TreeShape],
    rng: np.random.Generator,
    max_batch_size: int = 256,
    padding: GraphPadding = GPU_PADDING,
) -> tuple[list[StepFeatures], list[TreeShape]]:
    """``n`` decode steps as a serving run sees them: batch sizes log-uniform in
    ``[1, max_batch_size]`` padded by ``padding``, mean contexts log-uniform in [64, 8192], a
    longest request up to 4x the mean, shapes uniform over ``shapes``.
    """
    bs = np.floor(np.exp(rng.uniform(0.0, np.log(max_batch_size + 1), size=n))).astype(int)
    bs = np.clip(bs, 1, max_batch_size)
    mean_ctx = np.exp(rng.uniform(np.log(64), np.log(8192), size=n))
    ratio = rng.uniform(1.0, 4.0, size=n)
    picks = rng.integers(0, len(shapes), size=n)
    features = []
    for b, m, r in zip(bs, mean_ctx, ratio, strict=True):
        total = int(b * m)
        longest = min(total, int(m * r)) if b > 1 else total
        features.append(StepFeatures(int(b), padding.padded(int(b)), total, longest))
    return features, [shapes[i] for i in picks]


def sample_path_stats(
    shape: TreeShape, batch_size: int, hazards: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Accepted paths of one verify step drawn from known hazards, as ``tree.py`` reports them.

    ``hazards`` is ``[steps, topk]`` (or larger): the chance that the rank-r child at depth d is
    accepted given its better siblings were not. Each node on a path has a uniform 1..topk
    children in the tree. Returns ``(num_children, accepted_rank)``, both ``[batch, steps]``
    int64, with the meaning ``AcceptanceEstimator.observe`` documents.
    """
    steps, topk = shape.steps, shape.topk
    h = np.asarray(hazards, dtype=np.float64)[:steps, :topk]  # [steps, topk]
    children = rng.integers(1, topk + 1, size=(batch_size, steps))  # [batch, steps]
    ranks = np.arange(topk)  # [topk]
    accept = (rng.random((batch_size, steps, topk)) < h) & (ranks < children[..., None])
    first = np.where(accept.any(axis=2), accept.argmax(axis=2), -1)  # [batch, steps]
    # A path continues below depth d only if some child at depth d was accepted.
    alive = np.concatenate(
        [np.ones((batch_size, 1), dtype=bool), np.cumprod(first >= 0, axis=1)[:, :-1] > 0],
        axis=1,
    )  # [batch, steps]
    num_children = np.where(alive, children, 0).astype(np.int64)
    accepted_rank = np.where(alive, first, -1).astype(np.int64)
    return num_children, accepted_rank
