"""Time the CPU attention backend's decode and verify forwards at the bundled target's sizes.

adatree runs a step without speculation as a verify of one token per request, so its attention
should cost what a decode's does. For each context length this times one forward of all 30
layers (9 query heads, 3 KV heads, head dim 64, batch 1, two threads) in decode mode and as a
verify of 1 and of 4 tokens, interleaved, and prints the medians of 30 rounds and each
verify's ratio to the decode. The backend runs on small stand-ins for SGLang's runner, KV pool
and forward batch (the real ones need a server); the real server runs it in
``tests/test_e2e_cpu_path.py``.

Usage: ``.venv/bin/python scripts/bench_cpu_attention.py [--lens 100 300 600] [--threads 2]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from sglang_adatree.sglang.cpu.attention import AdaTreeCpuAttnBackend

# The stand-ins the backend's unit tests use, from the repository's tests folder.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from attention_fakes import FakePool, Mode, attention_layer, fused_qkv
from interleaved import interleaved_medians  # scripts/interleaved.py

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
POOL_SLOTS = 8192


LAYER = attention_layer(HEADS, KV_HEADS, HEAD_DIM)


def forwards(context_len: int) -> dict[str, Callable[[], torch.Tensor]]:
    """One 30-layer attention forward per mode over a request with this many cached tokens."""
    req_to_token = torch.arange(POOL_SLOTS // 2, dtype=torch.int32).view(1, -1)
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=FakePool(POOL_SLOTS, KV_HEADS, HEAD_DIM, fill="randn"),
        kv_index_translator=None,
        sliding_window_size=None,
    )
    backend = AdaTreeCpuAttnBackend(runner)
    req = torch.tensor([0])

    def decode() -> torch.Tensor:
        batch = SimpleNamespace(
            forward_mode=Mode("decode"),
            req_pool_indices=req,
            seq_lens=torch.tensor([context_len + 1]),
            out_cache_loc=torch.tensor([context_len]),
        )
        return run(batch, backend.forward_decode, 1)

    def verify(n: int) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            batch = SimpleNamespace(
                forward_mode=Mode("verify"),
                req_pool_indices=req,
                seq_lens=torch.tensor([context_len]),
                out_cache_loc=torch.arange(context_len, context_len + n),
                # a chain's tree mask in SGLang's QLEN_ONLY layout: each token sees its ancestors
                spec_info=SimpleNamespace(
                    draft_token_num=n,
                    custom_mask=torch.ones(n, n, dtype=torch.bool).tril().flatten(),
                ),
            )
            return run(batch, backend.forward_extend, n)

        return call

    def run(batch: SimpleNamespace, fwd: Callable[..., torch.Tensor], rows: int) -> torch.Tensor:
        q, k, v = fused_qkv(rows, HEADS, KV_HEADS, HEAD_DIM)
        backend.init_forward_metadata(batch)
        out = q
        for _ in range(LAYERS):
            out = fwd(q, k, v, LAYER, batch)
        return out

    return {"decode": decode, "verify 1": verify(1), "verify 4": verify(4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", type=int, nargs="+", default=[100, 300, 600])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if any(not 1 <= n <= POOL_SLOTS // 2 - 8 for n in args.lens):
        parser.error(f"--lens must lie in 1..{POOL_SLOTS // 2 - 8}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{LAYERS} layers, batch 1, {args.threads} threads; median ms of {args.rounds} rounds")
    for context_len in args.lens:
        calls = forwards(context_len)
        med = interleaved_medians(calls, args.rounds)
        ratios = ", ".join(
            f"{name} {med[name]:.2f} ({med[name] / med['decode']:.2f}x)"
            for name in calls
            if name != "decode"
        )
        print(f"context {context_len}: decode {med['decode']:.2f}, {ratios}")


if __name__ == "__main__":
    main()
