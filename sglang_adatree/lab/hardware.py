"""Analytic step-time profiles of GPUs: a roofline of published hardware figures.

The target is shaped like Llama-3.1-8B (32 layers, hidden 4096, 32 query / 8 KV heads of 128,
intermediate 14336, vocabulary 128256, bf16, untied lm_head); the draft is a one-layer
EAGLE-style head: ``fc`` from the token's embedding and the target's hidden state (2H -> H), one
decoder layer with its own KV cache, and the target's lm_head (``draft="eagle3"``: three fused
hidden states, 3H -> H, a decoder layer whose attention reads 2H, and a 32000-token draft
vocabulary). A decode step is composed of its passes by ``passes.compose_step_ms``, and every
pass costs, per kernel group,

    max(FLOPs / (peak * efficiency), bytes / (bandwidth * BANDWIDTH_EFFICIENCY))

for the linear layers (weights read once a pass, 2 FLOPs per weight per token, ``efficiency``
from ``gemm_efficiency`` of the GEMM's rows) plus the same for attention (the KV cache read once
per request, ``ATTENTION_EFFICIENCY`` for its FLOPs); ``compose_step_ms`` adds
``OVERHEADS.per_pass_ms`` for each graph's launch. The two groups are summed, not maxed as one:
they are different kernels, one after the other, so a compute-bound verify GEMM cannot hide a
memory-bound KV read. Left out, each under a few percent where it could matter: activations'
traffic (outweighed by weights at small batches and by FLOPs at large ones), the tree's few
extra keys per draft pass, and RoPE, norms and sampling kernels.

* target pass, ``T`` tokens per request: ``B*T`` tokens through every weight and the lm_head
  (verify needs logits for every node); attention of ``T`` queries over ``C + T`` keys in 32
  layers, reading ``B * C * 32 * 4 KiB`` of KV;
* draft pass, ``topk`` tokens per request: ``fc``, the layer and the lm_head over ``B*topk``
  tokens; its KV (one layer) read once per request, as SGLang's FA3 backend (the default on
  Hopper) does with the ``topk`` queries of a request together;
* draft extend, ``N`` tokens per request: ``fc`` and the layer over ``B*N`` tokens, the lm_head
  over the ``B`` rows whose logits seed the next tree; its weights are read whole all the same.

Padding: the table's batch sizes are SGLang's decode capture sizes when speculating
(``passes.SPEC_CAPTURE_SIZES``), so a batch between two sizes costs the larger one, attention
included (padded rows have no context in SGLang; the table charges them as if they had).

GPU figures (``GPU_SPECS``) are the vendors' datasheet numbers: dense bf16 tensor throughput
(not the "with sparsity" figure) and HBM (L4: GDDR6) bandwidth. Memory is not a limit here: the
table prices every cell, and ``notes["max_kv_tokens"]`` says how many KV tokens fit beside the
weights (a cell of B requests at context C needs B*C), so a simulation can tell when it priced
a batch the GPU could not hold.

Anchors (``implied_speedup``; ``tests/test_lab_profiles.py`` checks them, within a factor 1.6):

* SGLang's speculative-decoding docs (1x H100, Llama-3.1-8B-Instruct, MT-bench, batch 1):
  158.34 tok/s without speculation, 373.25 with EAGLE-3 (2.36x); the EAGLE-3 paper (arXiv
  2503.01840) gives an acceptance length of about 6, from its own, deeper tree. Here, at context
  1024: no speculation 5.98 ms a step (167 tok/s); the default set's deepest tree 6,4,16 costs
  1.66 no-spec steps, so at acceptance length 6 it implies 3.61x (the anchor implies a step
  ratio of 6 / 2.36 = 2.5). The roofline is optimistic at batch 1: a small draft pass runs at
  its kernels' latency more than at HBM speed, the paper's tree is larger than 6,4,16, and
  SGLang then ran speculative steps without its overlap scheduler.
* The EAGLE-3 paper: 1.38x throughput in SGLang at batch 64 (which shape is not stated). Here,
  at batch 64 and context 1024, the chain 3,1,4 at acceptance length 3.0 implies 1.90x (step
  ratio 1.58) and the tree 4,4,12 at 3.8 implies 1.27x (3.00), down from 2.21x and 2.60x at
  batch 1: the gain shrinks with batch size, as the anchors say, for the tree much more.

Implied speedups by GPU (EAGLE head, context 1024; chain 3,1,4 at acceptance length 3.0, tree
4,4,12 at 3.8, assumed for an EAGLE-3-class head on MT-bench):

| GPU | batch 1: chain / tree | batch 64: chain / tree |
|---|---|---|
| H100 SXM | 2.21x / 2.60x | 1.90x / 1.27x |
| H200 SXM | 2.18x / 2.57x | 1.56x / 0.97x |
| A100 SXM 80 GB | 2.24x / 2.56x | 1.51x / 0.90x |
| L4 | 2.28x / 2.68x | 2.32x / 1.62x |

The L4's batch 64 is memory-bound throughout (its ridge is ~350 tokens) and does not fit: 64
requests of 1024 tokens need 65k KV tokens, 37k fit. With ``draft="eagle3"`` (a 32000-token
draft vocabulary) every draft pass is cheaper: H100 batch 1 2.45x / 2.96x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_adatree import __version__
from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape
from sglang_adatree.core.step_profile import TableProfile
from sglang_adatree.lab.passes import (
    SPEC_CAPTURE_SIZES,
    SPEC_GRAPH_PADDING,
    StepOverheads,
    tabulate,
)


@dataclass(frozen=True)
class GPUSpec:
    """Published figures of one GPU."""

    name: str
    bandwidth_gb_s: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense bf16 tensor-core throughput, TFLOP/s (without sparsity)
    memory_gb: float
    source: str  # where the figures come from


GPU_SPECS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        # H100 SXM5 80 GB: HBM3 3.35 TB/s, 989 TFLOP/s bf16 dense (1,979 with sparsity).
        GPUSpec("h100-sxm", 3350.0, 989.0, 80.0, "NVIDIA H100 Tensor Core GPU datasheet"),
        # H200 SXM 141 GB: the H100's tensor cores with HBM3e at 4.8 TB/s.
        GPUSpec("h200-sxm", 4800.0, 989.0, 141.0, "NVIDIA H200 Tensor Core GPU datasheet"),
        # A100 SXM 80 GB: HBM2e 2,039 GB/s, 312 TFLOP/s bf16 dense (624 with sparsity).
        GPUSpec("a100-sxm-80gb", 2039.0, 312.0, 80.0, "NVIDIA A100 Tensor Core GPU datasheet"),
        # L4 24 GB: GDDR6 300 GB/s, 121 TFLOP/s bf16 dense (242 with sparsity).
        GPUSpec("l4", 300.0, 121.0, 24.0, "NVIDIA L4 Tensor Core GPU datasheet"),
    )
}
GPUS: tuple[str, ...] = tuple(GPU_SPECS)

# Achievable shares of the datasheet figures: a decode GEMV streams weights at about 80% of peak
# bandwidth, cuBLAS's large bf16 GEMMs reach about 70% of peak FLOP/s, and attention with a tree
# mask (small query tiles) about half.
BANDWIDTH_EFFICIENCY = 0.8
COMPUTE_EFFICIENCY = 0.7
ATTENTION_EFFICIENCY = 0.5
# A GEMM of few rows (tokens) fills few tensor-core tiles: it reaches COMPUTE_EFFICIENCY only
# for many rows, half of it at this many. Without this the roofline prices a verify pass of up
# to ~250 tokens (H100's ridge) like a one-token decode, so speculation at batch 64 would gain as
# much as at batch 1, against the published batch-64 figure (see the anchors).
GEMM_HALF_ROWS = 128


def gemm_efficiency(rows: float) -> float:
    """Achieved share of peak FLOP/s of a bf16 GEMM over ``rows`` rows."""
    return COMPUTE_EFFICIENCY * rows / (rows + GEMM_HALF_ROWS)


# A CUDA-graph replay costs ~30 us beyond its kernels (launch, the first kernel's ramp); every
# step pays ~0.3 ms the overlap scheduler does not hide (sampling, output processing); a
# speculative step ~0.3 ms more for the kernels SGLang runs between its graphs (tree build,
# verification, KV bookkeeping), dozens of small kernels of a few microseconds each.
OVERHEADS = StepOverheads(per_pass_ms=0.03, per_step_ms=0.3, speculative_ms=0.3)

BYTES_PER_PARAM = 2  # bf16
CONTEXT_LENS = (256, 1024, 4096, 16384)
# Share of memory the weights and KV may take (SGLang's static memory fraction is about this).
MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class ModelDims:
    """A Llama-style decoder's sizes."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def layer_params(self, attention_in: int | None = None) -> int:
        """Weights of one decoder layer (``attention_in``: its q/k/v input width, default H)."""
        h, d = self.hidden, self.head_dim
        qkv = (attention_in or h) * (self.heads + 2 * self.kv_heads) * d
        return qkv + self.heads * d * h + 3 * h * self.intermediate + 2 * h

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.kv_heads * self.head_dim * BYTES_PER_PARAM

    def attention_flops(self, queries: int, keys: int) -> float:
        """One layer: QK^T and PV, 2 FLOPs per multiply-add each."""
        return 4.0 * self.heads * self.head_dim * queries * keys


LLAMA_31_8B = ModelDims(
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
)


@dataclass(frozen=True)
class DraftHead:
    """A one-layer EAGLE-style head over a target of ``ModelDims``."""

    kind: str  # "eagle" or "eagle3"
    fc_in: int  # inputs of the fc layer, in hidden widths (2: embedding + hidden state)
    attention_in: int  # the layer's q/k/v input width, in hidden widths
    vocab: int  # the draft's lm_head rows


def draft_head(kind: str, target: ModelDims = LLAMA_31_8B) -> DraftHead:
    """EAGLE (the target's lm_head) or EAGLE-3 (a 32000-token draft vocabulary)."""
    if kind == "eagle":
        return DraftHead("eagle", fc_in=2, attention_in=1, vocab=target.vocab)
    if kind == "eagle3":
        return DraftHead("eagle3", fc_in=3, attention_in=2, vocab=32000)
    raise ValueError(f"draft head must be 'eagle' or 'eagle3', got {kind!r}")


EAGLE_HEAD = draft_head("eagle")


@dataclass(frozen=True)
class Roofline:
    """``passes.PassCosts`` of the target and its draft head on one GPU; see the module
    docstring."""

    gpu: GPUSpec
    target: ModelDims = LLAMA_31_8B
    draft: DraftHead = EAGLE_HEAD

    def _ms(self, flops: float, nbytes: float, compute_efficiency: float) -> float:
        compute_s = flops / (self.gpu.bf16_tflops * 1e12 * compute_efficiency)
        memory_s = nbytes / (self.gpu.bandwidth_gb_s * 1e9 * BANDWIDTH_EFFICIENCY)
        return 1e3 * max(compute_s, memory_s)

    def _linear_ms(self, params: float, tokens: float) -> float:
        # Every GEMM of the group has ``tokens`` rows: they set its efficiency.
        efficiency = gemm_efficiency(tokens)
        return self._ms(2.0 * params * tokens, params * BYTES_PER_PARAM, efficiency)

    def _attention_ms(self, layers: int, batch: int, tokens: int, context: int) -> float:
        # The cached context read once per request, the new tokens' KV written.
        t = self.target
        flops = layers * batch * t.attention_flops(tokens, context + tokens)
        kv = layers * t.kv_bytes_per_token_layer * batch * (context + tokens)
        return self._ms(flops, kv, ATTENTION_EFFICIENCY)

    def target_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        t = self.target
        params = t.layers * t.layer_params() + t.vocab * t.hidden  # [layers] + lm_head
        return self._linear_ms(params, batch_size * tokens) + self._attention_ms(
            t.layers, batch_size, tokens, context_len
        )

    def _draft_body_params(self) -> int:
        t, d = self.target, self.draft
        return d.fc_in * t.hidden * t.hidden + t.layer_params(d.attention_in * t.hidden)

    def draft_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        t = self.target
        params = self._draft_body_params() + self.draft.vocab * t.hidden
        return self._linear_ms(params, batch_size * tokens) + self._attention_ms(
            1, batch_size, tokens, context_len
        )

    def extend_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        t = self.target
        lm_head = self.draft.vocab * t.hidden
        body = self._draft_body_params()
        # The lm_head runs one row per request: the logits that seed the next tree.
        return (
            self._linear_ms(body, batch_size * tokens)
            + self._linear_ms(lm_head, batch_size)
            + self._attention_ms(1, batch_size, tokens, context_len)
        )

    def max_kv_tokens(self) -> int:
        """KV tokens (target and draft) that fit beside the weights."""
        t = self.target
        weights = (
            t.layers * t.layer_params() + 2 * t.vocab * t.hidden + self._draft_body_params()
        ) * BYTES_PER_PARAM
        if self.draft.vocab != t.vocab:
            weights += self.draft.vocab * t.hidden * BYTES_PER_PARAM
        per_token = (t.layers + 1) * t.kv_bytes_per_token_layer
        free = self.gpu.memory_gb * 1e9 * MEMORY_FRACTION - weights
        return max(0, int(free // per_token))


def analytic_gpu_profile(
    gpu: str,
    shapes: Sequence[TreeShape] = DEFAULT_CANDIDATES,
    draft: str = "eagle",
    context_lens: Sequence[int] = CONTEXT_LENS,
) -> TableProfile:
    """The roofline profile of ``gpu`` (one of ``GPUS``) for the Llama-3.1-8B-shaped target and
    a one-layer ``draft`` head, on SGLang's capture sizes up to 256; see the module docstring."""
    spec = GPU_SPECS.get(gpu)
    if spec is None:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    roofline = Roofline(spec, LLAMA_31_8B, draft_head(draft))
    call = f"analytic_gpu_profile({gpu!r}, draft={draft!r})"
    return tabulate(
        roofline,
        OVERHEADS,
        name=f"{gpu}-llama8b-{draft}",
        source="analytic",
        made_by=f"sglang_adatree.lab.hardware.{call} (sglang-adatree {__version__})",
        shapes=shapes,
        batch_sizes=SPEC_CAPTURE_SIZES,
        context_lens=context_lens,
        padding=SPEC_GRAPH_PADDING,
        notes={
            "gpu": spec.name,
            "gpu_source": spec.source,
            "bandwidth_gb_s": spec.bandwidth_gb_s,
            "bf16_tflops": spec.bf16_tflops,
            "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
            "compute_efficiency": COMPUTE_EFFICIENCY,
            "attention_efficiency": ATTENTION_EFFICIENCY,
            "overheads_ms": {
                "per_pass": OVERHEADS.per_pass_ms,
                "per_step": OVERHEADS.per_step_ms,
                "speculative": OVERHEADS.speculative_ms,
            },
            "target": "llama-3.1-8b shape, bf16",
            "draft": draft,
            "max_kv_tokens": roofline.max_kv_tokens(),
        },
    )


def implied_speedup(
    profile: TableProfile,
    shape: TreeShape,
    accept_len: float,
    batch_size: int,
    context_len: int,
) -> float:
    """Tokens per second of ``shape`` emitting ``accept_len`` tokens a request a step, over no
    speculation's, at one batch size and context: ``accept_len * t(no spec) / t(shape)``."""
    features = StepFeatures(
        batch_size,
        profile.padding.padded(batch_size),
        batch_size * context_len,
        context_len,
    )
    return accept_len * profile.step_ms(features, NO_SPEC) / profile.step_ms(features, shape)
