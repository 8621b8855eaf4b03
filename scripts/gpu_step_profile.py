"""Measure a GPU's decode passes for a Llama-3.1-8B-shaped target and a one-layer EAGLE-style
head, and write the policy lab's step-time profile of the default candidate shapes.

Torch and NumPy only (and this package's lab modules: the shapes, the composition, the JSON): random
bf16 weights, nothing downloaded, no SGLang. The passes a decode step runs
(``sglang_adatree.lab.passes``), each timed with CUDA events around a CUDA-graph replay, warm-up
first, then the median of ``--repeats``:

* the target's pass over ``T`` tokens per request (T = 1: no speculation; else a tree's verify,
  logits for every node, then their argmax), attention over a preallocated KV cache of ``C``
  tokens per request plus the ``T`` new ones (written into the cache first), through torch SDPA
  with an explicit mask (the prefix, then a causal block for the new tokens: a tree mask has the
  same cost); the 4 query heads of a KV head are folded into the query length, so the KV is read
  once per request as FlashAttention-3 does;
* a draft pass over ``topk`` tokens per request: fc (2H -> H) over the token's embedding and a
  hidden state, one decoder layer with its own KV cache, the target's lm_head, top-k;
* the draft's extend over ``N`` tokens per request, the lm_head over the last row of each.

Left out: RoPE, sampling, the tree build and verification kernels (``passes.StepOverheads``
prices them as ``hardware`` does). Grid: batch sizes 1-128, contexts 512 / 2048 / 8192, the
token counts the shapes need plus tree sizes up to 64. Batch sizes go in ascending order, so a
time budget (``--budget-s``) that runs out leaves the largest ones; a cell that was not measured
(past the budget, or whose KV does not fit) takes the time of the largest measured batch size
below it at the same pass, tokens and context, scaled by the batch ratio. ``notes`` count them
and keep every pass time.

Usage (on one H200 an estimated 3 minutes, not yet timed there; measuring stops at
``--budget-s``, default 540 s, so a run ends within 10 minutes):

    PYTHONPATH=. python scripts/gpu_step_profile.py --out h200-measured.json

and on any CPU, in seconds, with a small model (what ``tests/test_lab_gpu_script.py`` runs):

    PYTHONPATH=. python scripts/gpu_step_profile.py --tiny --out /tmp/tiny.json
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, TreeShape, parse_candidates
from sglang_adatree.lab.hardware import LLAMA_31_8B, OVERHEADS, ModelDims
from sglang_adatree.lab.passes import StepOverheads, step_passes, tabulate

TINY = ModelDims(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (512, 2048, 8192)
EXTRA_TREE_NODES = (24, 32, 48, 64)  # verify sizes beyond the default shapes', for the notes
TINY_BATCHES = (1, 2)
TINY_CONTEXTS = (16, 48)
RESERVE_GIB = 16.0  # left free beside weights and KV: activations, graph pools, the allocator
KINDS = ("target", "draft", "extend")
EXTEND_TOPK = 4
Key = tuple[str, int, int, int]  # (pass kind, batch size, tokens per request, context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + 1e-5).to(x.dtype)) * weight


@dataclass
class KVCache:
    """One layer's keys and values, ``[max_tokens, kv_heads, head_dim]`` each, flat."""

    k: torch.Tensor
    v: torch.Tensor

    def views(self, batch: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, keys, kv_heads, head_dim]`` views of the first ``batch * keys`` slots."""
        n = batch * keys
        return self.k[:n].view(batch, keys, *self.k.shape[1:]), self.v[:n].view(
            batch, keys, *self.v.shape[1:]
        )


class Layer:
    """One Llama decoder layer's weights (fused q/k/v and gate/up, as SGLang loads them)."""

    def __init__(self, dims: ModelDims, device: str, dtype: torch.dtype):
        h, d = dims.hidden, dims.head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        self.dims = dims
        self.qkv = w((dims.heads + 2 * dims.kv_heads) * d, h)
        self.o = w(h, dims.heads * d)
        self.gate_up = w(2 * dims.intermediate, h)
        self.down = w(h, dims.intermediate)
        self.norm_in = torch.ones(h, device=device, dtype=dtype)
        self.norm_post = torch.ones(h, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cache: KVCache, batch: int, context: int) -> torch.Tensor:
        """``x`` ``[batch * tokens, hidden]`` -> the same; the new tokens' KV written at
        ``context`` in each request's slots."""
        dims, d = self.dims, self.dims.head_dim
        tokens = x.shape[0] // batch
        group = dims.heads // dims.kv_heads
        qkv = F.linear(rms_norm(x, self.norm_in), self.qkv)
        q, k, v = qkv.split([dims.heads * d, dims.kv_heads * d, dims.kv_heads * d], dim=-1)
        k_cache, v_cache = cache.views(batch, context + tokens)
        k_cache[:, context:] = k.view(batch, tokens, dims.kv_heads, d)
        v_cache[:, context:] = v.view(batch, tokens, dims.kv_heads, d)
        # [batch, kv_heads, group * tokens, d]: a KV head's query heads share its keys.
        q = q.view(batch, tokens, dims.kv_heads, group, d).permute(0, 2, 3, 1, 4)
        q = q.reshape(batch, dims.kv_heads, group * tokens, d)
        mask = None
        if tokens > 1:
            new = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).tril()
            prefix = torch.ones(tokens, context, dtype=torch.bool, device=x.device)
            mask = torch.cat([prefix, new], dim=1).repeat(group, 1)  # [group * tokens, keys]
        out = F.scaled_dot_product_attention(
            q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=mask
        )  # [batch, kv_heads, group * tokens, d]
        out = out.view(batch, dims.kv_heads, group, tokens, d).permute(0, 3, 1, 2, 4)
        h = x + F.linear(out.reshape(batch * tokens, dims.heads * d), self.o)
        gate, up = F.linear(rms_norm(h, self.norm_post), self.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, self.down)


class Models:
    """The target and its draft head, random weights, KV caches of ``max_tokens`` slots."""

    def __init__(self, dims: ModelDims, max_tokens: int, device: str, dtype: torch.dtype):
        h = dims.hidden
        self.dims, self.device = dims, device
        self.embed = torch.randn(dims.vocab, h, device=device, dtype=dtype) * 0.02
        self.lm_head = torch.randn(dims.vocab, h, device=device, dtype=dtype) * 0.02
        self.norm = torch.ones(h, device=device, dtype=dtype)
        self.layers = [Layer(dims, device, dtype) for _ in range(dims.layers)]
        self.fc = torch.randn(h, 2 * h, device=device, dtype=dtype) * 0.02
        self.draft_layer = Layer(dims, device, dtype)
        kv = (dims.kv_heads, dims.head_dim)

        def cache() -> KVCache:
            return KVCache(
                torch.zeros(max_tokens, *kv, device=device, dtype=dtype),
                torch.zeros(max_tokens, *kv, device=device, dtype=dtype),
            )

        self.caches = [cache() for _ in range(dims.layers)]
        self.draft_cache = cache()

    def target(self, ids: torch.Tensor, context: int) -> torch.Tensor:
        """Verify (or decode): ``ids`` ``[batch, tokens]`` -> the target's argmax per token."""
        batch = ids.shape[0]
        x = F.embedding(ids.flatten(), self.embed)  # [batch * tokens, hidden]
        for layer, cache in zip(self.layers, self.caches, strict=True):
            x = layer.forward(x, cache, batch, context)
        return F.linear(rms_norm(x, self.norm), self.lm_head).argmax(dim=-1)

    def draft(
        self, ids: torch.Tensor, hidden: torch.Tensor, context: int, topk: int, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft pass (``last_only``: the extend, logits of each request's last row only)."""
        batch, tokens = ids.shape
        x = F.linear(torch.cat([F.embedding(ids.flatten(), self.embed), hidden], dim=-1), self.fc)
        x = self.draft_layer.forward(x, self.draft_cache, batch, context)
        if last_only:
            x = x.view(batch, tokens, -1)[:, -1]
        logits = F.linear(rms_norm(x, self.norm), self.lm_head)
        return torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)


def timer(device: str, graphs: bool, warmup: int, repeats: int) -> Callable[[Callable], float]:
    """A function that times a pass: median ms of ``repeats`` runs after ``warmup``."""

    def on_cpu(fn: Callable) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    def on_cuda(fn: Callable) -> float:
        run = fn
        if graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # allocations and lazy initialisation before capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
        for _ in range(warmup):
            run()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    return on_cuda if device.startswith("cuda") else on_cpu


def plan(shapes: Sequence[TreeShape], extra_nodes: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Tokens per request each pass kind needs for ``shapes``."""
    passes = [step_passes(s) for s in shapes]
    return {
        "target": tuple(sorted({p.target_tokens for p in passes} | set(extra_nodes))),
        "draft": tuple(sorted({p.draft_tokens for p in passes if p.draft_passes})),
        "extend": tuple(sorted({p.extend_tokens for p in passes if p.extend_tokens})),
    }


def measure(
    models: Models,
    tokens: dict[str, tuple[int, ...]],
    batches: Sequence[int],
    contexts: Sequence[int],
    max_tokens: int,
    time_pass: Callable[[Callable], float],
    deadline: float,
) -> dict[Key, float]:
    """Median ms per (kind, batch, tokens, context), batch sizes ascending, until ``deadline``."""
    dims, device = models.dims, models.device
    todo = [
        (kind, b, t, c)
        for b in batches
        for c in contexts
        for kind in KINDS
        for t in tokens[kind]
        if b * (c + t) <= max_tokens
    ]
    times: dict[Key, float] = {}
    started = time.monotonic()
    for i, (kind, b, t, c) in enumerate(todo):
        if time.monotonic() > deadline:
            print(f"time budget spent: {len(todo) - i} passes left unmeasured", flush=True)
            break
        ids = torch.randint(0, dims.vocab, (b, t), device=device)
        hidden = torch.randn(b * t, dims.hidden, device=device, dtype=models.embed.dtype)
        if kind == "target":
            run = functools.partial(models.target, ids, c)
        elif kind == "draft":
            run = functools.partial(models.draft, ids, hidden, c, t, False)
        else:  # the extend's top-k seeds the next tree: the default shapes' largest, 4
            run = functools.partial(models.draft, ids, hidden, c, EXTEND_TOPK, True)
        times[kind, b, t, c] = time_pass(run)
        print(
            f"[{i + 1}/{len(todo)}] {kind} batch {b} tokens {t} context {c}: "
            f"{times[kind, b, t, c]:.3f} ms ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return times


def fill(
    times: dict[Key, float],
    tokens: dict[str, tuple[int, ...]],
    batches: Sequence[int],
    contexts: Sequence[int],
) -> tuple[dict[Key, float], int]:
    """Every cell of the grid: measured, or the largest measured batch below it scaled by the
    batch ratio (the smallest above, unscaled, when none is below); and how many were filled."""
    full, filled = dict(times), 0
    for kind in KINDS:
        for t in tokens[kind]:
            for c in contexts:
                measured = sorted(b for b in batches if (kind, b, t, c) in times)
                if not measured:
                    raise SystemExit(
                        f"no {kind} pass of {t} tokens at context {c} was measured: the time "
                        "budget ran out within the first batch size (raise --budget-s)"
                    )
                for b in batches:
                    if (kind, b, t, c) in times:
                        continue
                    below = [m for m in measured if m < b]
                    ref = below[-1] if below else measured[0]
                    scale = b / ref if below else 1.0
                    full[kind, b, t, c] = times[kind, ref, t, c] * scale
                    filled += 1
    return full, filled


@dataclass(frozen=True)
class MeasuredPasses:
    """``passes.PassCosts`` read from a full grid of pass times."""

    ms: dict[Key, float]

    def target_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        return self.ms["target", batch_size, tokens, context_len]

    def draft_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        return self.ms["draft", batch_size, tokens, context_len]

    def extend_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        return self.ms["extend", batch_size, tokens, context_len]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the profile's JSON file")
    parser.add_argument("--tiny", action="store_true", help="a small model and grid, seconds")
    parser.add_argument("--device", help="default: cuda when there is one, else cpu")
    parser.add_argument("--shapes", help="candidate shapes 'S,K,N;...' (default: the defaults)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="stop measuring after")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-graphs", action="store_true", help="time eager passes")
    parser.add_argument("--name", help="the profile's name (default: from the device)")
    parser.add_argument(
        "--kv-tokens", type=int, help="cap the KV cache (tokens per layer; default: what fits)"
    )
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0 or args.budget_s <= 0 or (args.kv_tokens or 1) < 1:
        parser.error("--repeats and --kv-tokens must be >= 1, --warmup >= 0, --budget-s > 0")
    deadline = time.monotonic() + args.budget_s
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dims = TINY if args.tiny else LLAMA_31_8B
    batches = TINY_BATCHES if args.tiny else BATCHES
    contexts = TINY_CONTEXTS if args.tiny else CONTEXTS
    shapes = parse_candidates(args.shapes) if args.shapes else DEFAULT_CANDIDATES
    tokens = plan(shapes, () if args.tiny else EXTRA_TREE_NODES)
    needed = max(b * (c + max(max(t) for t in tokens.values())) for b in batches for c in contexts)
    max_tokens = needed
    if on_gpu:
        total = torch.cuda.get_device_properties(device).total_memory
        params = (dims.layers + 1) * dims.layer_params() + 2 * dims.hidden * (
            dims.vocab + dims.hidden
        )
        weights = 2 * params  # bf16: the layers, embedding, lm_head and fc
        per_token = (dims.layers + 1) * dims.kv_bytes_per_token_layer
        budget = total - weights - RESERVE_GIB * 2**30
        max_tokens = max(1, min(needed, int(budget // per_token)))
    if args.kv_tokens:
        max_tokens = min(max_tokens, args.kv_tokens)
    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(f"{device_name}: KV cache of {max_tokens} tokens per layer; passes {tokens}", flush=True)
    torch.manual_seed(0)
    if not on_gpu:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads, and shares the CPU
    with torch.inference_mode():
        models = Models(dims, max_tokens, device, dtype)
        time_pass = timer(device, on_gpu and not args.no_graphs, args.warmup, args.repeats)
        times = measure(models, tokens, batches, contexts, max_tokens, time_pass, deadline)
    full, filled = fill(times, tokens, batches, contexts)
    slug = device_name.lower().replace("nvidia ", "").replace(" ", "-")
    command = "python " + shlex.join(["scripts/gpu_step_profile.py", *sys.argv[1:]])
    profile = tabulate(
        MeasuredPasses(full),
        # The passes' times include their graphs' launch; the rest is priced as hardware does.
        StepOverheads(0.0, OVERHEADS.per_step_ms, OVERHEADS.speculative_ms),
        name=args.name or f"{slug}-{'tiny' if args.tiny else 'llama8b'}-eagle-measured",
        source="measured",
        made_by=f"{command} ({date.today().isoformat()}, {device_name}, torch {torch.__version__})",
        shapes=shapes,
        batch_sizes=batches,
        context_lens=contexts,
        notes={
            "device": device_name,
            "model": "tiny" if args.tiny else "llama-3.1-8b shape, random bf16 weights",
            "graphs": on_gpu and not args.no_graphs,
            "passes_measured": len(times),
            "passes_filled": filled,
            "kv_tokens": max_tokens,
            "overheads_ms": {
                "per_step": OVERHEADS.per_step_ms,
                "speculative": OVERHEADS.speculative_ms,
            },
            "pass_ms": [[*key, round(ms, 4)] for key, ms in sorted(full.items())],
        },
    )
    profile.save(args.out)
    print(f"wrote {args.out}: {len(times)} passes measured, {filled} filled", flush=True)


if __name__ == "__main__":
    main()
