"""Time the bundled target's linear products on this CPU: SGLang's ``F.linear`` against the CPU
path's oneDNN over packed weights.

One timed call runs the four projections of all 30 decoder layers (q/k/v 576 -> 960, o 576 ->
576, gate/up 576 -> 3,072, down 1,536 -> 576; fp32, 425 MB of weights), as a forward does, so
the weights come from memory rather than from the cache as they would if one layer were timed
alone. For 1-128 rows (a decode at batch size 1 is one row, a verify pass carries each
request's draft tokens, a chunk of prefill many), prints the median milliseconds of
interleaved calls of ``F.linear``, of oneDNN over copies packed once
(``cpu_weights.packed_linear_weight``) and of ``x @ W_t`` over transposed copies, and which one
the CPU path runs (``cpu.LINEAR_ROWS``).

Usage: ``.venv/bin/python scripts/bench_cpu_linear.py [--threads 2] [--rounds 15]``
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from interleaved import interleaved_medians  # scripts/interleaved.py

from sglang_adatree.sglang.cpu.hooks import LINEAR_ROWS
from sglang_adatree.sglang.cpu.weights import linear_packed, packed_linear_weight

PROJECTIONS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be positive")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = [
        {name: torch.randn(out, inp) / inp**0.5 for name, (out, inp) in PROJECTIONS.items()}
        for _ in range(LAYERS)
    ]  # [out, in] each
    packed = [{name: packed_linear_weight(w) for name, w in layer.items()} for layer in layers]
    transposed = [{name: w.t().contiguous() for name, w in layer.items()} for layer in layers]

    def run(product: Callable[[torch.Tensor, int, str], torch.Tensor]) -> Callable[..., None]:
        def forward(xs: dict[str, torch.Tensor]) -> None:
            for i in range(LAYERS):
                for name in PROJECTIONS:
                    product(xs[name], i, name)

        return forward

    forms = {
        "F.linear": run(lambda x, i, n: F.linear(x, layers[i][n])),
        "oneDNN packed": run(lambda x, i, n: linear_packed(x, packed[i][n])),
        "x @ W_t": run(lambda x, i, n: torch.mm(x, transposed[i][n])),
    }
    print(
        f"{LAYERS} layers x 4 linear products of the bundled target, fp32, {args.threads} "
        f"threads; median ms of {args.rounds} interleaved rounds"
    )
    low, high = LINEAR_ROWS
    with torch.inference_mode():
        for rows in ROWS:
            xs = {name: torch.randn(rows, inp) for name, (_, inp) in PROJECTIONS.items()}
            x, w = xs["down"], layers[0]["down"]
            reference = F.linear(x, w)
            got = linear_packed(x, packed[0]["down"])
            torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
            calls = {label: functools.partial(forward, xs) for label, forward in forms.items()}
            med = interleaved_medians(calls, args.rounds)
            runs = "oneDNN packed" if low <= rows <= high else "F.linear"
            cells = "  ".join(f"{label} {ms:.1f}" for label, ms in med.items())
            print(f"{rows} rows: {cells}  CPU path: {runs}")


if __name__ == "__main__":
    main()
