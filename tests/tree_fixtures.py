"""Draft trees for the tree and verify tests: SGLang's draft loop on random draft outputs."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_adatree.sglang.tree import (
    DraftSelection,
    TreeMaskMode,
    VerifyTree,
    build_verify_tree,
    organize_draft_results,
)


def random_draft(
    batch: int, steps: int, topk: int, vocab: int, gen: torch.Generator
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``score_list, token_list, parents_list`` as SGLang's ``select_top_k_tokens`` builds them.

    Each expanded node's draft distribution is random: ``topk`` sorted probabilities over
    ``topk`` distinct tokens.
    """

    def top_probs(rows: int) -> torch.Tensor:  # [rows, topk], descending like torch.topk
        return torch.rand(rows, topk, generator=gen).sort(dim=1, descending=True).values

    def top_tokens(rows: int) -> torch.Tensor:  # [rows, topk], distinct per row
        return torch.rand(rows, vocab, generator=gen).argsort(dim=1)[:, :topk]

    scores = top_probs(batch)  # [batch, topk] cumulative score of the expanded nodes
    score_list = [scores.unsqueeze(1)]
    token_list = [top_tokens(batch)]
    parents_list = [torch.arange(-1, topk).expand(batch, -1)]
    for step in range(1, steps):
        expanded = scores.unsqueeze(2) * top_probs(batch * topk).view(batch, topk, topk)
        scores, best = torch.topk(expanded.flatten(1), topk, dim=-1)
        score_list.append(expanded)
        token_list.append(top_tokens(batch * topk).reshape(batch, topk * topk))
        parents_list.append(best + topk * topk * (step - 1) + topk)
    return score_list, token_list, parents_list


@dataclass(frozen=True)
class DraftTree:
    """A random draft tree of one shape, organised and built."""

    steps: int
    topk: int
    num_draft_tokens: int
    selection: DraftSelection
    tree: VerifyTree
    seq_lens: torch.Tensor  # [batch] int64

    @property
    def candidates(self) -> torch.Tensor:  # [batch, N] node tokens, root first
        return self.tree.draft_tokens.view(-1, self.num_draft_tokens)


def random_tree(
    batch: int,
    steps: int,
    topk: int,
    num_draft_tokens: int,
    vocab: int,
    gen: torch.Generator,
    mode: TreeMaskMode = TreeMaskMode.QLEN_ONLY,
) -> DraftTree:
    score_list, token_list, parents_list = random_draft(batch, steps, topk, vocab, gen)
    selection = organize_draft_results(score_list, token_list, parents_list, num_draft_tokens)
    seq_lens = torch.randint(1, 9, (batch,), generator=gen)
    bonus = torch.randint(0, vocab, (batch,), generator=gen, dtype=torch.int32)
    tree = build_verify_tree(
        bonus,
        selection.parent_list,
        selection.top_scores_index,
        selection.draft_tokens,
        seq_lens,
        int(seq_lens.sum()),
        topk,
        steps,
        num_draft_tokens,
        mode,
    )
    return DraftTree(steps, topk, num_draft_tokens, selection, tree, seq_lens)


def random_shape(gen: torch.Generator, max_tokens: int = 20) -> tuple[int, int, int]:
    """A random valid ``(steps, topk, num_draft_tokens)``; chains when topk is 1."""
    steps = int(torch.randint(1, 6, (1,), generator=gen))
    topk = int(torch.randint(1, 5, (1,), generator=gen))
    if topk == 1:
        return steps, topk, steps + 1
    candidates = topk + (steps - 1) * topk * topk
    return steps, topk, int(torch.randint(2, min(candidates, max_tokens) + 2, (1,), generator=gen))


def children_of(tree: VerifyTree, b: int, node: int) -> list[int]:
    """Children of a node in link order, by walking the links one at a time."""
    n = tree.retrieve_index.shape[1]
    out, child = [], int(tree.retrieve_next_token[b, node])
    while child != -1:
        out.append(child)
        child = int(tree.retrieve_next_sibling[b, child])
        assert len(out) < n, "sibling links loop"
    return out


def six_node_draft(batch: int = 1) -> tuple[list, list, list]:
    """The hand-made draft of the tests: topk 2, steps 3, exact (power-of-two) scores.

    Candidate scores (token): c0 .5 (10), c1 .25 (11) | c2 .375 (20), c3 .0625 (21),
    c4 .125 (22), c5 .0625 (23) | c6 .1875 (30), c7 .09375 (31), c8 .0625 (32), c9 .03125 (33).
    Step 1 expands c2 and c4, so step 2's candidates are c2's (c6, c7) and c4's (c8, c9).
    The best five, c0 c1 c2 c4 c6, become nodes 1..5 of this tree (root 0)::

        0 ─┬─ 1 (c0, token 10) ── 3 (c2, token 20) ── 5 (c6, token 30)
           └─ 2 (c1, token 11) ── 4 (c4, token 22)
    """

    def rows(values: list) -> torch.Tensor:
        one = torch.tensor(values)
        return one.expand(batch, *one.shape)

    score_list = [
        rows([[0.5, 0.25]]),
        rows([[0.375, 0.0625], [0.125, 0.0625]]),  # c0's children, then c1's
        rows([[0.1875, 0.09375], [0.0625, 0.03125]]),  # c2's children, then c4's
    ]
    token_list = [rows([10, 11]), rows([20, 21, 22, 23]), rows([30, 31, 32, 33])]
    parents_list = [rows([-1, 0, 1]), rows([2, 4]), rows([6, 7])]  # the last is never read
    return score_list, token_list, parents_list


def run_sglang_triton(code: str, payload: dict, tmp_path: Path) -> dict:
    """Run ``code`` against SGLang's own Triton tree kernels under the Triton interpreter.

    A fresh process, since TRITON_INTERPRET must be set before triton is imported. ``code``
    sees ``payload`` and ``spec_tree`` (SGLang's module) and assigns ``result``.
    """
    source, target = tmp_path / "payload.pt", tmp_path / "result.pt"
    torch.save(payload, source)
    program = "\n".join(
        [
            "import torch",
            "from sglang.kernels.ops.speculative import spec_tree",
            f"payload = torch.load({str(source)!r})",
            code,
            f"torch.save(result, {str(target)!r})",
        ]
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(target)


def random_links(batch: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child / next-sibling links of random trees over nodes 0..N-1 (root 0).

    Unlike the tree builder's, node ids are not in depth order and children are linked in a
    random order: the verifiers must follow the links, not assume a layout.
    """
    next_token = torch.full((batch, n), -1, dtype=torch.long)
    next_sibling = torch.full((batch, n), -1, dtype=torch.long)
    for b in range(batch):
        order = [0, *(1 + torch.randperm(n - 1, generator=gen)).tolist()]  # insertion order
        children: dict[int, list[int]] = {}
        for k in range(1, n):
            parent = order[int(torch.randint(0, k, (1,), generator=gen))]
            children.setdefault(parent, []).append(order[k])
        for parent, kids in children.items():
            kids = [kids[i] for i in torch.randperm(len(kids), generator=gen).tolist()]
            next_token[b, parent] = kids[0]
            for left, right in itertools.pairwise(kids):
                next_sibling[b, left] = right
    return next_token, next_sibling
