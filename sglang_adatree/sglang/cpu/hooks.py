"""The CPU path: SGLang's speculative decoding without Triton or CUDA kernels.

Every hook is registered through SGLang's ``HookRegistry`` and decides per call: with CPU
tensors (or on ``--device cpu``) it runs a pure-torch equivalent, anywhere else it calls
SGLang's original unchanged, so nothing differs on a GPU. What each hook replaces:

* tree build and greedy / sampling verification: ``sglang_adatree.sglang.tree`` / ``verify``;
* the cache-location and bookkeeping kernels: ``cpu_kernels``;
* the KV pool's start-up copy-kernel warm-up: skipped, moves use SGLang's own torch path;
* the draft's ``torch.compile``d top-k selection: run eagerly (compiling takes ~9 s);
* ``RotaryEmbedding`` construction, which imports vllm on platforms SGLang does not know;
* attention: the ``adatree_cpu`` backend (``cpu_attention``), registered in SGLang's
  attention registry and returned by the draft backend factory;
* the lm_head product of 1-4 rows, 1-48 with two or more threads (``_lm_head``): the same
  logits by a faster fp32 product (one row over a transposed copy of the weight);
* the linear layers' fp32 products of 2-128 rows (``_linear``: verify passes, top-k draft steps,
  a few decodes at once) through oneDNN over a packed copy of the weight.

The weight copies (``cpu_weights``) are made once per weight and dropped when SGLang updates
weights.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_adatree.sglang.cpu import kernels as cpu_kernels
from sglang_adatree.sglang.cpu.attention import (
    BACKEND_NAME,
    AdaTreeCpuAttnBackend,
    AdaTreeCpuMultiStepDraftBackend,
)
from sglang_adatree.sglang.cpu.weights import (
    forget_weight_copies,
    linear_packed,
    packed_linear_weight,
    transposed_weight,
)


def on_cpu_device() -> bool:
    """True when this process serves on ``--device cpu`` (published runtime config)."""
    try:
        from sglang.srt.runtime_context import get_device

        return get_device().device == "cpu"
    except Exception:  # config not published yet: not a serving process
        return False


def _is_cpu(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.device.type == "cpu"


@contextmanager
def _module_globals(module_name: str, **values: Any) -> Any:
    """Temporarily rebind globals of one SGLang module for the duration of a call."""
    module = sys.modules[module_name]
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


# -- model construction ---------------------------------------------------------------------


def _rope_init(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    # On a platform it does not know, RotaryEmbedding.__init__ imports vllm's kernel; on a CPU
    # device the pure-torch forward runs anyway, so construct it as for SGLang's CPU engine.
    if not on_cpu_device():
        return original(self, *args, **kwargs)
    with _module_globals(original.__module__, _is_cpu=True):
        return original(self, *args, **kwargs)


def _kv_copy_warmup(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    # The Triton copy kernel the pool warms up cannot run on a CPU; SGLang's own torch move
    # (``move_kv_cache_native``) serves the moves instead.
    if torch.device(self.device).type == "cpu":
        self.use_native_move_kv_cache = True
        return None
    return original(self, *args, **kwargs)


# -- attention ------------------------------------------------------------------------------


def create_cpu_attention_backend(runner: Any) -> AdaTreeCpuAttnBackend:
    return AdaTreeCpuAttnBackend(runner)


def _draft_backend_type(factory: Any, decode: bool) -> str:
    from sglang.srt.runtime_context import attention_backends, get_spec

    prefill_backend, decode_backend = attention_backends()
    if not decode and get_spec().speculative_attention_mode == "decode":
        decode = True
    return factory.draft_attn_backend or (decode_backend if decode else prefill_backend)


def _draft_decode_backend(original: Callable[..., Any], self: Any) -> Any:
    if _draft_backend_type(self, decode=True) != BACKEND_NAME:
        return original(self)
    if self.speculative_num_steps <= 1:
        return None
    return AdaTreeCpuMultiStepDraftBackend(
        self.draft_model_runner, self.topk, self.speculative_num_steps
    )


def _draft_extend_backend(original: Callable[..., Any], self: Any) -> Any:
    if _draft_backend_type(self, decode=False) != BACKEND_NAME:
        return original(self)
    return AdaTreeCpuAttnBackend(self.draft_model_runner)


# -- tree and verification ------------------------------------------------------------------


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _arguments(original: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, however the caller passed them."""
    bound = _signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _build_tree(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from sglang_adatree.sglang.tree import write_verify_tree

    a = _arguments(original, args, kwargs)
    if not _is_cpu(a["seq_lens"]):
        return original(*args, **kwargs)
    write_verify_tree(
        a["parent_list"],
        a["top_scores_index"],
        a["seq_lens"],
        a["tree_mask"],
        a["positions"],
        a["retrieve_index"],
        a["retrieve_next_token"],
        a["retrieve_next_sibling"],
        a["topk"],
        a["spec_steps"],
        a["num_verify_tokens"],
        int(a["tree_mask_mode"]),
    )
    return None


def _verify_greedy(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from sglang_adatree.sglang.cpu.verify import verify_tree_greedy

    a = _arguments(original, args, kwargs)
    if not _is_cpu(a["candidates"]):
        return original(*args, **kwargs)
    result = verify_tree_greedy(
        a["predicts"],
        a["accept_index"],
        a["accept_token_num"],
        a["candidates"].long(),
        a["retrieve_index"],
        a["retrieve_next_token"],
        a["retrieve_next_sibling"],
        a["target_predict"].long(),
    )
    return result.predicts, result.accept_index, result.accept_token_num


def tree_speculative_sampling_target_only(**a: Any) -> None:
    """SGLang's CUDA sampling-verify op, by its keyword names, on CPU tensors."""
    from sglang_adatree.sglang.cpu.verify import verify_tree_sampling

    verify_tree_sampling(
        a["predicts"],
        a["accept_index"],
        a["accept_token_num"],
        a["candidates"].long(),
        a["retrive_index"],
        a["retrive_next_token"],
        a["retrive_next_sibling"],
        a["uniform_samples"],
        a["uniform_samples_for_final_sampling"],
        a["target_probs"],
        a["draft_probs"],
        a.get("threshold_single", 1.0),
        a.get("threshold_acc", 1.0),
    )


def _eagle_sample(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # SGLang has no tree sampling kernel (nor top-k / top-p renormalisation) off CUDA; on a
    # CPU, lend it the distribution-preserving torch versions for the duration of the call.
    from sglang_adatree.sglang.cpu.verify import top_k_renorm_prob, top_p_renorm_prob

    batch = _arguments(original, args, kwargs)["batch"]
    if torch.device(batch.device).type != "cpu":
        return original(*args, **kwargs)
    with _module_globals(
        original.__module__,
        tree_speculative_sampling_target_only=tree_speculative_sampling_target_only,
        top_k_renorm_prob=top_k_renorm_prob,
        top_p_renorm_prob=top_p_renorm_prob,
    ):
        return original(*args, **kwargs)


def _select_top_k_later(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # A torch.compile'd function: on a CPU its first call spends ~9 s compiling C++ for a
    # handful of small tensor ops. Run SGLang's own function eagerly instead.
    eager = getattr(original, "_torchdynamo_orig_callable", None)
    topk_p = kwargs.get("topk_p", args[1] if len(args) > 1 else None)
    if eager is None or not _is_cpu(topk_p):
        return original(*args, **kwargs)
    return eager(*args, **kwargs)


# -- logits ---------------------------------------------------------------------------------

# Rows (tokens) of the logits products that ``_lm_head`` takes over, by the OpenMP threads of
# the process, and the smallest vocabulary. ``(W @ h.T).T`` against SGLang's ``h @ W.T``
# (scripts/bench_lm_head.py, 49,152 x 576, AVX2): one thread, 0.5-0.7x at 2-4 rows but
# 1.0-1.4x at 6-12; two threads, 0.35-0.5x at 2-4 rows and 0.5-0.95x at 5-64 (three runs), taken
# over up to 48 for a margin. More than two threads were not measured; the transposed product
# splits its 49,152 output rows among them.
LM_HEAD_MAX_ROWS_ONE_THREAD = 4
LM_HEAD_MAX_ROWS_THREADED = 48
LM_HEAD_MIN_VOCAB = 4096


def lm_head_max_rows() -> int:
    """The most rows ``_lm_head`` takes over with this process's OpenMP thread count."""
    if torch.get_num_threads() < 2:
        return LM_HEAD_MAX_ROWS_ONE_THREAD
    return LM_HEAD_MAX_ROWS_THREADED


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T``: [rows, vocab], contiguous, the fastest way on an AVX2 CPU.

    MKL's fp32 product with 2-4 rows of ``hidden`` costs about that many single-row products,
    reading the weight once per row (one thread, 49,152 x 576: 10.1 ms for 1 row, 25.3 for 2,
    23.8 for 4), while the transposed problem ``(weight @ hidden.T).T`` streams it once (15.2
    and 15.0 ms; two threads 9.0 against 24.3, and up to 48 rows still ahead: 15.1 against
    23.3 for 8). One row is a matrix-vector product, which MKL runs at half speed over the
    ``[V, H]`` layout and at full speed over a ``[H, V]`` copy (two threads 9.4 against 5.3 ms;
    one thread 9.7 against 5.6): every decode step at batch size 1, every top-1 draft step and
    each request's draft extend is one row, so the copy (vocab x hidden floats, 113 MB for the
    target) is made once and kept.
    """
    if hidden.shape[0] == 1:
        return torch.mm(hidden, transposed_weight(weight))  # [1, H] @ [H, V] -> [1, V]
    return torch.mm(weight, hidden.T).T.contiguous()  # [V, H] @ [H, R] -> [R, V]


def _weights_updated(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # SGLang writes new weights into the existing tensors (``param.data.copy_``, which no
    # version counter sees), so a transposed or packed copy would keep serving the old weights.
    try:
        return original(*args, **kwargs)
    finally:
        forget_weight_copies()


# -- linear layers ----------------------------------------------------------------------------

# Rows (tokens) of the linear products that ``_linear`` takes over. The bundled target's 30
# layers x 4 projections in a row, as a forward streams them from memory
# (scripts/bench_cpu_linear.py, AVX2, fp32), oneDNN over packed weights against ``F.linear``:
# two threads 0.4-0.5x at 2-4 rows, 0.55-0.8x at 8-128; one thread 0.7-0.8x at 2-8,
# 0.85-0.97x at 16-128. One row (a decode at batch size 1) stays with ``F.linear``: 0.7-0.9x
# there with two threads, but a server's decode was not faster for it (`ar` new / old 1.04,
# docs/notes/2026-12-02-cpu-linear-products.md), and 1.1x with one thread; larger products
# (prefill chunks) too, where its blocking pays.
LINEAR_ROWS = (2, 128)


def _linear(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # SGLang's ``UnquantizedLinearMethod.apply(layer, x, bias)``: only its plain ``F.linear``
    # branch (no AMX, no batch-invariant mode) on fp32 CPU tensors of 2-128 rows,
    # while the packed copies fit their budget; the rest goes to the original. Every linear
    # layer of every forward comes here, so the cheap tensor checks decide first.
    if len(args) >= 3 and not kwargs:
        layer, x = args[1], args[2]
        bias = args[3] if len(args) > 3 else None
    else:
        a = _arguments(original, args, kwargs)
        layer, x, bias = a["layer"], a["x"], a["bias"]
    if (
        not _is_cpu(x)
        or x.dtype != torch.float32
        or x.ndim != 2
        or not LINEAR_ROWS[0] <= x.shape[0] <= LINEAR_ROWS[1]
    ):
        return original(*args, **kwargs)
    weight = getattr(layer, "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dtype != torch.float32
        or weight.ndim != 2
        or not _is_cpu(weight)
        or (bias is not None and bias.dtype != torch.float32)
        or getattr(layer, "use_intel_amx_backend", False)
        or is_batch_invariant_mode_enabled()
    ):
        return original(*args, **kwargs)
    packed = packed_linear_weight(weight)
    if packed is None:
        return original(*args, **kwargs)
    return linear_packed(x, packed, bias)  # [rows, in] -> [rows, out]


def _lm_head(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    # Only where SGLang would run its plain product (no LoRA, quantisation, AMX, fp32 upcast or
    # on-policy bf16 path) on fp32 CPU tensors of 1 to ``lm_head_max_rows()`` rows; the rest
    # goes to the original.
    # Every logits pass comes here: the cheap tensor checks decide first, so a GPU call costs
    # one lookup.
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if (
        not _is_cpu(hidden)
        or hidden.ndim != 2
        or not 1 <= hidden.shape[0] <= lm_head_max_rows()
        or hidden.dtype != torch.float32
    ):
        return original(self, *args, **kwargs)
    from sglang.srt.layers import logits_processor as lp

    lm_head = _arguments(original, (self, *args), kwargs)["lm_head"]
    weight = getattr(lm_head, "weight", None)
    plain = (
        weight is not None
        and weight.dtype == torch.float32
        and weight.shape[0] >= LM_HEAD_MIN_VOCAB
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not lp.should_apply_lm_head_quant_method(
            lm_head, getattr(lm_head, "quant_method", None)
        )
        and not self.use_fp32_lm_head
        and not lp.use_intel_amx_backend(lm_head)
        and self.rl_on_policy_target is None
    )
    if not plain:
        return original(self, *args, **kwargs)
    return lm_head_logits(hidden, weight)


# -- bookkeeping kernels --------------------------------------------------------------------


def _cpu_or_original(
    replacement: Callable[..., Any], probe: str, position: int
) -> Callable[..., Any]:
    """An AROUND hook running ``replacement`` when argument ``probe`` is a CPU tensor."""

    def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        tensor = kwargs.get(probe, args[position] if len(args) > position else None)
        if not _is_cpu(tensor):
            return original(*args, **kwargs)
        return replacement(*args, **kwargs)

    hook.__name__ = f"adatree_cpu_{replacement.__name__}"
    return hook


def _assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device: Any,
) -> torch.Tensor:
    return cpu_kernels.assign_extend_cache_locs(
        req_pool_indices, req_to_token, start_offset, end_offset
    )


def _assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    cpu_kernels.assign_req_to_token_pool(
        req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc
    )


def _fill_accept_out_cache_loc(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
    size: int,
) -> None:
    cpu_kernels.fill_accept_out_cache_loc(accept_index, out_cache_loc, accept_out_cache_loc)


_SPEC = "sglang.srt.speculative"
_OPS = "sglang.kernels.ops.speculative"
_WEIGHTS = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
# Every WeightUpdater method that writes weights (tests/test_sglang_cpu_lm_head.py checks that
# no other public one does).
WEIGHT_UPDATES = (
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_ipc",
    "load_weights_from_distributed",
    "receive_weights_from_distributed",
    "end_weight_update",
)

_HOOKS: tuple[tuple[str, Callable[..., Any]], ...] = (
    ("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__", _rope_init),
    (
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup",
        _kv_copy_warmup,
    ),
    ("sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head", _lm_head),
    ("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply", _linear),
    *((f"{_WEIGHTS}.{name}", _weights_updated) for name in WEIGHT_UPDATES),
    (f"{_SPEC}.draft_utils.DraftBackendFactory.create_decode_backend", _draft_decode_backend),
    (
        f"{_SPEC}.draft_utils.DraftBackendFactory.create_draft_extend_backend",
        _draft_extend_backend,
    ),
    (f"{_OPS}.spec_tree.build_tree_kernel_efficient_func", _build_tree),
    (f"{_OPS}.spec_tree.verify_tree_greedy_func", _verify_greedy),
    (f"{_SPEC}.eagle_utils.eagle_sample", _eagle_sample),
    (f"{_SPEC}.spec_utils._select_top_k_tokens_later", _select_top_k_later),
    (
        f"{_OPS}.cache_locs.assign_draft_cache_locs_contiguous_func",
        _cpu_or_original(cpu_kernels.assign_draft_cache_locs_contiguous, "seq_lens", 2),
    ),
    (
        f"{_OPS}.cache_locs.assign_extend_cache_locs_func",
        _cpu_or_original(_assign_extend_cache_locs, "req_to_token", 1),
    ),
    (
        f"{_OPS}.cache_locs.fill_front_out_cache_loc_func",
        _cpu_or_original(cpu_kernels.fill_front_out_cache_loc, "out_cache_loc", 1),
    ),
    (
        f"{_OPS}.eagle.fill_bonus_tokens_func",
        _cpu_or_original(cpu_kernels.fill_bonus_tokens, "accept_lens", 1),
    ),
    (
        f"{_OPS}.eagle.fill_accept_out_cache_loc_func",
        _cpu_or_original(_fill_accept_out_cache_loc, "out_cache_loc", 1),
    ),
    (
        "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func",
        _cpu_or_original(_assign_req_to_token_pool, "req_to_token", 1),
    ),
)


def install_hooks() -> None:
    """Register the attention backend and the CPU hooks (applied by SGLang's plug-in loader)."""
    from sglang.srt.arg_groups.choices import add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_cpu_attention_backend)
        add_attention_backend_choices([BACKEND_NAME])
    for target, hook in _HOOKS:
        HookRegistry.register(target, hook, HookType.AROUND)
