"""A decode step as SGLang 0.5.23 runs it on a GPU: its model passes, and their times composed.

One decode step of shape ``(steps, topk, num_draft_tokens)`` at batch size B is a sequence of
CUDA-graph replays (passes), each over a number of tokens per request:

* the target's pass: ``num_draft_tokens`` tokens per request (the tree's verify, its logits for
  every node), or 1 without speculation (adatree runs no speculation as a one-token verify
  through the speculative worker, and skips the draft's extend);
* ``steps - 1`` draft passes of ``topk`` tokens per request: the draft's extend already
  expanded the root (its ``topk`` best tokens), and each later pass runs the ``topk`` nodes
  the last one kept (SGLang's ``draft_forward``: "we get 1 token from draft prefill and
  (#spec steps - 1) tokens here");
* the draft's extend over the verified window, ``num_draft_tokens`` tokens per request: SGLang
  captures its graph at that width (``resolve_num_tokens_per_req(phase="draft_extend")``)
  whatever the request accepted, so the upper bound is what the GPU runs.

Outside the passes, every step pays for sampling and the scheduler's host work that overlap does
not hide, and a speculative step for the kernels SGLang runs between graphs (tree build,
verification, bookkeeping): ``StepOverheads``.

``compose_step_ms`` turns the costs of the passes (``PassCosts``: a roofline in ``hardware``, a
GPU's measured pass times in ``scripts/gpu_step_profile.py``) into a shape's step time, and
``tabulate`` into a ``TableProfile``, so both profiles are composed by the same rule.

Worked example: ``(3, 2, 6)`` at B = 8 is a target pass over 48 tokens, two draft passes over
16 tokens each and a draft extend over 48 tokens: four passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sglang_adatree.core.features import GraphPadding
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.core.step_profile import TableProfile

# SGLang 0.5.23's decode capture sizes when speculating
# (``arg_groups/cuda_graph_hook.generate_decode_cuda_graph_batch_sizes``), up to 256: less
# padding for small batches than without speculation.
SPEC_CAPTURE_SIZES: tuple[int, ...] = (
    tuple(range(1, 9))
    + tuple(range(10, 33, 2))
    + tuple(range(40, 65, 4))
    + tuple(range(72, 257, 8))
)
SPEC_GRAPH_PADDING = GraphPadding(SPEC_CAPTURE_SIZES)


@dataclass(frozen=True)
class StepPasses:
    """The passes of one decode step of a shape, in tokens per request."""

    target_tokens: int  # the target's pass: num_draft_tokens, 1 without speculation
    draft_passes: int  # steps - 1
    draft_tokens: int  # each draft pass: topk
    extend_tokens: int  # the draft's extend: num_draft_tokens; 0 without speculation

    @property
    def num_passes(self) -> int:
        """CUDA-graph replays of the step."""
        return 1 + self.draft_passes + (1 if self.extend_tokens else 0)


def step_passes(shape: TreeShape) -> StepPasses:
    """The passes SGLang runs for one decode step of ``shape``; see the module docstring."""
    if not shape.speculative:
        return StepPasses(target_tokens=1, draft_passes=0, draft_tokens=0, extend_tokens=0)
    n = shape.num_draft_tokens
    return StepPasses(
        target_tokens=n, draft_passes=shape.steps - 1, draft_tokens=shape.topk, extend_tokens=n
    )


class PassCosts(Protocol):
    """Milliseconds of one pass over ``tokens`` tokens for each of ``batch_size`` requests whose
    context (KV already cached) is ``context_len`` tokens."""

    def target_ms(self, batch_size: int, tokens: int, context_len: int) -> float: ...

    def draft_ms(self, batch_size: int, tokens: int, context_len: int) -> float: ...

    def extend_ms(self, batch_size: int, tokens: int, context_len: int) -> float: ...


@dataclass(frozen=True)
class StepOverheads:
    """What a step costs beyond its passes' kernels, in ms."""

    per_pass_ms: float  # launching one CUDA graph, beyond the kernels it replays
    per_step_ms: float  # every step: sampling, host work the overlap scheduler does not hide
    speculative_ms: float  # a speculative step: tree build, verification, bookkeeping kernels


def compose_step_ms(
    shape: TreeShape,
    batch_size: int,
    context_len: int,
    costs: PassCosts,
    overheads: StepOverheads,
) -> float:
    """One decode step of ``shape`` over ``batch_size`` requests (the padded batch the graphs
    run) with ``context_len`` tokens of context each: the sum of its passes and overheads."""
    p = step_passes(shape)
    ms = costs.target_ms(batch_size, p.target_tokens, context_len)
    if shape.speculative:
        if p.draft_passes:
            ms += p.draft_passes * costs.draft_ms(batch_size, p.draft_tokens, context_len)
        ms += costs.extend_ms(batch_size, p.extend_tokens, context_len)
        ms += overheads.speculative_ms
    return ms + p.num_passes * overheads.per_pass_ms + overheads.per_step_ms


def tabulate(
    costs: PassCosts,
    overheads: StepOverheads,
    *,
    name: str,
    source: str,
    made_by: str,
    shapes: Sequence[TreeShape],
    batch_sizes: Sequence[int],
    context_lens: Sequence[int],
    padding: GraphPadding = SPEC_GRAPH_PADDING,
    notes: dict[str, Any] | None = None,
) -> TableProfile:
    """A ``TableProfile`` of ``compose_step_ms`` at every grid point."""
    ms = np.array(
        [
            [
                [compose_step_ms(s, b, c, costs, overheads) for c in context_lens]
                for b in batch_sizes
            ]
            for s in shapes
        ],
        dtype=np.float64,
    )  # [shapes, batch_sizes, context_lens]
    return TableProfile(
        name=name,
        source=source,
        made_by=made_by,
        shapes=tuple(shapes),
        batch_sizes=tuple(int(b) for b in batch_sizes),
        context_lens=tuple(int(c) for c in context_lens),
        ms=ms,
        padding=padding,
        notes=dict(notes or {}),
    )
