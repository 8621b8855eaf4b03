"""Time the lm_head product on this CPU: SGLang's form against the CPU path's.

For 1-64 rows of hidden states (decode and top-1 draft steps are one row; verify passes carry
a request's draft tokens plus one, top-k draft steps batch x topk) and the bundled target's size
(49,152 x 576, fp32), prints
the median milliseconds of interleaved calls of ``hidden @ W.T`` (what SGLang runs), of
``(W @ hidden.T).T`` and of ``hidden @ W_t`` over a transposed copy made beforehand, and of
what the CPU path runs with this thread count: ``cpu.lm_head_logits`` (its pick among the
first three) up to ``cpu.lm_head_max_rows()`` rows, SGLang's product beyond.

Usage: ``.venv/bin/python scripts/bench_lm_head.py [--vocab 49152] [--hidden 576] [--threads 2]``
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
from interleaved import interleaved_medians  # scripts/interleaved.py

from sglang_adatree.sglang.cpu.hooks import lm_head_logits, lm_head_max_rows
from sglang_adatree.sglang.cpu.weights import transposed_weight

ROWS = (1, 2, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if args.vocab < 1 or args.hidden < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--vocab, --hidden, --threads and --rounds must be positive")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden)  # [V, H]
    weight_t = transposed_weight(weight)  # [H, V], made once as the CPU path does
    print(
        f"lm_head {args.vocab} x {args.hidden} fp32, {args.threads} threads; "
        f"median ms of {args.rounds} interleaved rounds"
    )
    for rows in ROWS:
        hidden = torch.randn(rows, args.hidden)
        forms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "h @ W.T (SGLang)": lambda h: torch.matmul(h, weight.T),
            "(W @ h.T).T": lambda h: torch.mm(weight, h.T).T.contiguous(),
            "h @ W_t (copy)": lambda h: torch.mm(h, weight_t),
            "CPU path": (
                (lambda h: lm_head_logits(h, weight))
                if rows <= lm_head_max_rows()
                else (lambda h: torch.matmul(h, weight.T))
            ),
        }
        reference = forms["h @ W.T (SGLang)"](hidden)
        for name, form in forms.items():
            torch.testing.assert_close(form(hidden), reference, rtol=1e-4, atol=1e-3, msg=name)
        calls = {name: functools.partial(form, hidden) for name, form in forms.items()}
        med = interleaved_medians(calls, args.rounds)
        cells = "  ".join(f"{name} {ms:.2f}" for name, ms in med.items())
        print(f"{rows} rows: {cells}")


if __name__ == "__main__":
    main()
