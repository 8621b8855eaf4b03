"""Time the pure-torch tree functions once per decode step's worth of work.

Shape (steps, topk, draft tokens) = (5, 4, 8) by default, batch 1 and 16, one CPU thread;
prints the median and p99 microseconds of thread CPU time per call, and the cost of one tiny
torch op on this machine to compare runs across machines.

Usage: ``.venv/bin/python scripts/bench_tree.py [--batch 1 16] [--vocab 49152]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from sglang_adatree.sglang.cpu.verify import (
    target_probs_from_logits,
    verify_tree_greedy,
    verify_tree_sampling,
)
from sglang_adatree.sglang.tree import (
    TreeMaskMode,
    accepted_path_stats,
    build_verify_tree,
    organize_draft_results,
)


def draft_outputs(batch: int, steps: int, topk: int, vocab: int) -> tuple[list, list, list]:
    """Random draft-loop outputs in SGLang's layout (``select_top_k_tokens``)."""
    scores = torch.rand(batch, topk).sort(dim=1, descending=True).values
    score_list, token_list = [scores.unsqueeze(1)], [torch.randint(0, vocab, (batch, topk))]
    parents_list = [torch.arange(-1, topk).expand(batch, -1)]
    for step in range(1, steps):
        expanded = scores.unsqueeze(2) * torch.rand(batch, topk, topk)
        scores, best = torch.topk(expanded.flatten(1), topk, dim=-1)
        score_list.append(expanded)
        token_list.append(torch.randint(0, vocab, (batch, topk * topk)))
        parents_list.append(best + topk * topk * (step - 1) + topk)
    return score_list, token_list, parents_list


def timed(fn: Callable[[], object], seconds: float) -> tuple[float, float]:
    """Median and p99 microseconds per call over about ``seconds`` of calls.

    Thread CPU time, not wall time: on a machine shared with other jobs, time spent waiting
    for a core is not the function's cost.
    """
    fn()
    start = time.thread_time()
    fn()
    reps = max(20, int(seconds / max(time.thread_time() - start, 1e-6)))
    times = []
    for _ in range(reps):
        start = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - start)
    times.sort()
    return times[len(times) // 2] / 1e3, times[int(len(times) * 0.99)] / 1e3


def bench(batch: int, steps: int, topk: int, n: int, vocab: int, seconds: float) -> None:
    score_list, token_list, parents_list = draft_outputs(batch, steps, topk, vocab)
    selection = organize_draft_results(score_list, token_list, parents_list, n)
    seq_lens = torch.randint(100, 2000, (batch,))
    bonus = torch.randint(0, vocab, (batch,), dtype=torch.int32)

    def build(mode: TreeMaskMode):
        return build_verify_tree(
            bonus,
            selection.parent_list,
            selection.top_scores_index,
            selection.draft_tokens,
            seq_lens,
            int(seq_lens.sum()),
            topk,
            steps,
            n,
            mode,
        )

    tree = build(TreeMaskMode.QLEN_ONLY)
    candidates = tree.draft_tokens.view(batch, n)
    links = (tree.retrieve_index, tree.retrieve_next_token, tree.retrieve_next_sibling)
    target_predict = candidates.roll(-1, dims=1)  # accepts part of the tree

    def buffers():
        return (
            torch.zeros(batch * n, dtype=torch.int32),
            torch.full((batch, steps + 1), -1, dtype=torch.int32),
            torch.empty(batch, dtype=torch.int32),
        )

    greedy = verify_tree_greedy(*buffers(), candidates, *links, target_predict)
    logits = torch.randn(batch * n, vocab) * 3
    temperatures = torch.full((batch,), 0.7)
    probs = target_probs_from_logits(logits, temperatures, None, None, n)
    coins, final_coins = torch.rand(batch, n), torch.rand(batch)
    scratch = torch.zeros_like(probs)  # draft_probs: the caller's zeros, reused (not timed)
    cases = {
        "organize_draft_results": lambda: organize_draft_results(
            score_list, token_list, parents_list, n
        ),
        "build_verify_tree QLEN_ONLY": lambda: build(TreeMaskMode.QLEN_ONLY),
        "build_verify_tree FULL_MASK": lambda: build(TreeMaskMode.FULL_MASK),
        "verify_tree_greedy": lambda: verify_tree_greedy(
            *buffers(), candidates, *links, target_predict
        ),
        "accepted_path_stats": lambda: accepted_path_stats(
            greedy.accept_index,
            greedy.accept_token_num,
            tree.retrieve_next_token,
            tree.retrieve_next_sibling,
            selection.top_scores_index,
            topk,
        ),
        "verify_tree_sampling": lambda: verify_tree_sampling(
            *buffers(),
            candidates,
            *links,
            coins,
            final_coins,
            probs,
            scratch,
        ),
        "target_probs temperature": lambda: target_probs_from_logits(
            logits, temperatures, None, None, n
        ),
        "target_probs top-k 50 + top-p 0.9": lambda: target_probs_from_logits(
            logits,
            temperatures,
            torch.full((batch,), 50),
            torch.full((batch,), 0.9),
            n,
        ),
    }
    for name, fn in cases.items():
        p50, p99 = timed(fn, seconds)
        print(f"batch {batch:3d}  {name:36s} p50 {p50:9.1f} us   p99 {p99:9.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--shape", default="5,4,8", help="steps,topk,num_draft_tokens")
    parser.add_argument("--vocab", type=int, default=49152, help="SmolLM2's vocabulary")
    parser.add_argument("--seconds", type=float, default=1.0, help="per measurement")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    steps, topk, n = (int(x) for x in args.shape.split(","))
    a, b = torch.arange(8).view(1, 8), torch.arange(8).view(1, 8)
    p50, _ = timed(lambda: a.gather(1, b), args.seconds)
    print(f"one tiny torch op (gather of 8 values): {p50:.1f} us")
    for batch in args.batch:
        bench(batch, steps, topk, n, args.vocab, args.seconds)


if __name__ == "__main__":
    main()
