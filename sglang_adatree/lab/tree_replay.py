"""Draft trees as SGLang 0.5.23 builds them, verified greedily against a known answer.

For one request and one ``topk``, ``expand`` runs the draft passes of every position of the
answer at once (positions as batch rows) and keeps SGLang's per-step lists
(``select_top_k_tokens`` in ``srt/speculative/spec_utils.py``):

* step 0: the root's ``topk`` children, the top-k of the draft's distribution after the root;
  their scores are their probabilities;
* step ``i >= 1``: every frontier node's ``topk`` best children, scored ``parent score x child
  probability`` (``topk**2`` candidates); the ``topk`` best of them are the next frontier.

A shape ``(steps, topk, num_draft_tokens)`` reads the first ``steps`` lists (a pass does not
depend on later ones, so one expansion at the largest ``steps`` serves every shape of that
``topk``) and keeps the ``num_draft_tokens - 1`` best-scored candidates (``organize_draft_results``;
a chain keeps all). ``verify`` walks that tree as greedy verification does: below an accepted
node, the child whose token is the answer's next token is accepted. Candidate numbering, parent
slots and sibling ranks are ``sglang/tree.py``'s.

Worked example (topk 2, steps 2, 4 verified tokens, answer continues ``a b``): step 0 scores
``a: 0.6, x: 0.25``; step 1 expands both, ``a -> b: 0.6*0.5 = 0.30, a -> y: 0.6*0.4 = 0.24``,
``x -> z: 0.25*0.8 = 0.20, ...``; the tree keeps the best 3 candidates ``a, x, b`` (0.6, 0.25,
0.30), so the target accepts ``a`` then ``b``: 2 accepted, 3 emitted; ``num_children`` per
depth 2, 1; ``accepted_rank`` 0, 0; the draft expected ``0.6 + 0.25 + 0.30 = 1.15`` accepted
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.lab.draft_forward import BranchCache, DraftContext, DraftRunner


@dataclass(frozen=True)
class DraftLayers:
    """SGLang's per-step draft lists for one ``topk``, one row per answer position."""

    topk: int
    scores: tuple[torch.Tensor, ...]  # step 0 [rows, topk], later [rows, topk**2] float32
    tokens: tuple[torch.Tensor, ...]  # same shapes: full-vocabulary token ids, int64
    parents: tuple[torch.Tensor, ...]  # step 0 [rows, topk + 1], later [rows, topk] int64

    @property
    def steps(self) -> int:
        return len(self.scores)


@dataclass(frozen=True)
class ShapeOutcome:
    """What one shape's verify step does at every row (answer position)."""

    emitted: torch.Tensor  # [rows] int64, capped at what is left of the answer
    num_children: torch.Tensor  # [rows, steps] int64, 0 past the path or the answer's end
    accepted_rank: torch.Tensor  # [rows, steps] int64, -1 where nothing was accepted
    draft_expected: torch.Tensor  # [rows] float32: sum of the kept candidates' scores


def _to_full_ids(runner: DraftRunner, index: torch.Tensor) -> torch.Tensor:
    return index if runner.vocab_ids is None else runner.vocab_ids[index]


@torch.inference_mode()
def expand(
    runner: DraftRunner,
    ctx: DraftContext,
    prefix_lens: torch.Tensor,  # [rows] draft positions each row's passes attend to
    first_logits: torch.Tensor,  # [rows, draft_vocab] the draft's logits after each root
    first_hidden: torch.Tensor | None,  # [rows, hidden] the head's output there (EAGLE)
    topk: int,
    steps: int,
) -> DraftLayers:
    """SGLang's draft loop for ``steps`` steps (``steps - 1`` draft passes) at every row."""
    rows = first_logits.shape[0]
    assert prefix_lens.shape == (rows,) and steps >= 1 and topk >= 1
    # SGLang's drafts rank by probability (softmax, then top-k), not by logit.
    score, index = torch.topk(torch.softmax(first_logits, dim=-1), topk)  # [rows, topk]
    tokens = _to_full_ids(runner, index)
    scores_list, tokens_list = [score], [tokens]
    parents_list = [torch.arange(-1, topk).expand(rows, -1)]
    hidden = None
    if first_hidden is not None:
        hidden = first_hidden[:, None].expand(rows, topk, first_hidden.shape[-1])
    cache = BranchCache(len(runner.layers))
    for i in range(1, steps):
        out = runner.tree_step(ctx, prefix_lens, i - 1, tokens, hidden, cache)
        probs = torch.softmax(runner.logits(out.flatten(0, 1)), dim=-1)  # [rows * topk, V]
        child_p, child_index = torch.topk(probs, topk)
        expanded = score[:, :, None] * child_p.view(rows, topk, topk)  # [rows, topk, topk]
        flat = expanded.flatten(1)  # [rows, topk**2]
        score, chosen = torch.topk(flat, topk)  # [rows, topk] the next frontier
        child_tokens = _to_full_ids(runner, child_index).view(rows, topk * topk)
        tokens = child_tokens.gather(1, chosen)
        if hidden is not None:
            parent = (chosen // topk)[:, :, None].expand(rows, topk, out.shape[-1])
            hidden = out.gather(1, parent)  # a node's pass reads its parent's output
        scores_list.append(flat)
        tokens_list.append(child_tokens)
        parents_list.append(chosen + topk * topk * (i - 1) + topk)
    return DraftLayers(topk, tuple(scores_list), tuple(tokens_list), tuple(parents_list))


def verify(
    layers: DraftLayers,
    shape: TreeShape,
    targets: torch.Tensor,  # [rows, >= steps] the answer's token at each depth, -1 past its end
    remaining: torch.Tensor,  # [rows] answer tokens left at each row (answer_len - position)
) -> ShapeOutcome:
    """Greedy verification of the tree ``shape`` keeps, at every row."""
    steps, k, n = shape.steps, shape.topk, shape.num_draft_tokens
    assert shape.speculative and k == layers.topk and steps <= layers.steps, (shape, layers)
    rows = targets.shape[0]
    assert targets.shape[1] >= steps and remaining.shape == (rows,)
    scores = torch.cat(layers.scores[:steps], dim=1)  # [rows, candidates]
    tokens = torch.cat(layers.tokens[:steps], dim=1)
    kept = torch.sort(torch.topk(scores, n - 1, dim=1).indices, dim=1).values  # [rows, n - 1]
    values = scores.gather(1, kept)
    node_tokens = tokens.gather(1, kept)
    if steps > 1:
        parent_slots = torch.cat(layers.parents[: steps - 1], dim=1)  # [rows, 1 + (s-1) k]
        parent = parent_slots.gather(1, kept // k)  # parent candidate, -1: the root
    else:
        parent = torch.full_like(kept, -1)
    depth = torch.where(kept < k, 1, 2 + (kept - k) // (k * k))  # [rows, n - 1]
    match = node_tokens == targets.gather(1, depth - 1)

    # path[:, d]: candidate accepted at depth d (-1: the root at depth 0; -2: none).
    path = torch.full((rows, steps + 1), -2, dtype=torch.long)
    path[:, 0] = -1
    rank = torch.full((rows, steps), -1, dtype=torch.long)
    every = torch.arange(rows)
    for j in range(n - 1):  # candidates increase with depth: a parent comes before its child
        d = depth[:, j]
        on = match[:, j] & (path[every, d - 1] == parent[:, j])
        path[every[on], d[on]] = kept[on, j]
        rank[every[on], d[on] - 1] = kept[on, j] % k
    accepted = (path[:, 1:] >= 0).sum(dim=1)
    offered = (parent[:, None, :] == path[:, :steps, None]).sum(dim=2)  # [rows, steps]
    known = targets[:, :steps] >= 0  # past the answer nothing can be checked
    return ShapeOutcome(
        emitted=torch.minimum(accepted + 1, remaining),
        num_children=torch.where(known, offered, 0),
        accepted_rank=torch.where(known, rank, -1),
        draft_expected=values.sum(dim=1),
    )
