"""Pure-torch attention for SGLang on a CPU: prefill, decode, draft and tree verify.

SGLang's ``torch_native`` backend loops over requests, serves one query per sequence in decode
and has no target-verify or multi-step draft path. This backend builds, once per forward, a
padded gather index of KV slots and a boolean mask per request, and then runs every layer as
one batched ``scaled_dot_product_attention`` over the gathered keys. Keys are gathered with
``index_select`` over whole slot rows (several times faster on a CPU than advanced indexing),
and a forward in which every query may see every key runs without a mask (a decode whose rows
all have the same length, a verify of one token per request: batch size 1 always does): there
a masked SDPA call costs two to three times an unmasked one. Extend-like forwards gather their
keys after writing the new tokens' K/V to the cache, prefix and new slots in one gather; when
every request brings the same number of new tokens (every verify), queries and outputs are
views of the flat rows instead of a gather and a scatter per layer (which made a one-token
verify, adatree's step without speculation, cost ~1.3x a decode's attention).

* extend (prefill, draft extend, mixed): keys = the request's cached prefix + its new tokens
  (causal among the new tokens);
* target verify: keys = the cached prefix + the verified tree, masked by the tree mask (each
  node sees its ancestors and itself);
* decode: keys = the request's cached tokens, the current one included;
* multi-step draft decode (``AdaTreeCpuMultiStepDraftBackend``): each top-k branch row attends
  to its request's prefix plus that branch's own draft slots, exactly the slots SGLang's
  ``generate_draft_decode_kv_indices`` kernel selects (``seq_len + branch * steps + j``).

Slot ids come straight from ``req_to_token``; a translating (unified) KV pool is refused at
construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from torch.nn.functional import scaled_dot_product_attention

BACKEND_NAME = "adatree_cpu"


@dataclass(frozen=True)
class ExtendMetadata:
    """Gather plan of one extend-like forward (prefill, draft extend, target verify)."""

    prefix_slots: torch.Tensor  # [batch, max_prefix] int64 KV slots (0 where padded)
    # [batch, max_prefix + max_q] int64: the prefix slots, then the new tokens' own slots
    # (out_cache_loc), the keys' layout; read once the new K/V are written to the cache.
    # None when the forward has no out_cache_loc.
    slots: torch.Tensor | None
    token_index: torch.Tensor  # [batch, max_q] int64 row of each query in the flat input
    token_valid: torch.Tensor  # [batch, max_q] bool
    # [batch, 1, max_q, max_prefix + max_q] bool, True = may attend; None when every query
    # sees every key (one new token per request and no padding, as in adatree's verify
    # without speculation): SDPA without a mask is the decode path's cost
    mask: torch.Tensor | None
    num_tokens: int
    # Every request has max_q new tokens (a verify; a prefill of equal lengths): the flat
    # input is then [batch * max_q] rows in request order, and queries and outputs are views
    # of it rather than a gather and a masked scatter per layer.
    dense: bool = False


@dataclass(frozen=True)
class DecodeMetadata:
    """Gather plan of one decode forward: every query row reads its own slot list."""

    slots: torch.Tensor  # [rows, max_kv] int64 KV slots (0 where padded)
    mask: torch.Tensor | None  # [rows, 1, 1, max_kv] bool; None when no slot is padding


def _mask_if_needed(mask: torch.Tensor) -> torch.Tensor | None:
    """``mask`` (bool, True = may attend), or None when it hides nothing: SDPA runs faster
    without one. One host read per forward (not per layer); this backend only runs on a CPU."""
    return None if bool(mask.all()) else mask


def _decode_metadata_of(slots: torch.Tensor, valid: torch.Tensor) -> DecodeMetadata:
    """Decode metadata; the mask is dropped when every row uses all its slots."""
    return DecodeMetadata(slots=slots, mask=_mask_if_needed(valid[:, None, None, :]))


def _gather_slots(
    cache: torch.Tensor,  # [pool_size, kv_heads, head_dim]
    slots: torch.Tensor,  # [rows, n] int64
) -> torch.Tensor:
    """``cache[slots]`` as [rows, n, kv_heads, head_dim], copied row by row."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _padded_prefix_slots(
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len]
    req_pool_indices: torch.Tensor,  # [batch]
    lens: torch.Tensor,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``lens[b]`` slots of each request, padded: ([batch, max_len], valid mask)."""
    max_len = int(lens.max()) if lens.numel() else 0
    cols = torch.arange(max_len, device=lens.device)
    valid = cols.unsqueeze(0) < lens.unsqueeze(1)  # [batch, max_len]
    slots = req_to_token[req_pool_indices.long()][:, :max_len].long()
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def _attend(
    q: torch.Tensor,  # [rows, q_len, heads, head_dim]
    k: torch.Tensor,  # [rows, kv_len, kv_heads, head_dim]
    v: torch.Tensor,  # [rows, kv_len, kv_heads, v_head_dim]
    mask: torch.Tensor | None,  # [rows, 1, q_len, kv_len] bool; None: every key visible
    scale: float,
) -> torch.Tensor:
    """Batched (masked) attention; returns [rows, q_len, heads, v_head_dim]."""
    out = scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


class AdaTreeCpuAttnBackend(AttentionBackend):
    """One-query-set-per-request attention over gathered KV slots (see the module docstring)."""

    def __init__(self, model_runner, skip_prefill: bool = False) -> None:
        super().__init__()
        translator = getattr(model_runner, "kv_index_translator", None)
        if translator is not None and getattr(translator, "is_translating", False):
            raise ValueError(
                f"attention backend {BACKEND_NAME!r} reads physical slots from req_to_token "
                "and does not support a translating (unified) KV pool"
            )
        if getattr(model_runner, "sliding_window_size", None):
            raise ValueError(
                f"attention backend {BACKEND_NAME!r} does not support sliding-window layers"
            )
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.skip_prefill = skip_prefill
        self.forward_metadata: ExtendMetadata | DecodeMetadata | None = None

    # -- metadata ---------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = None
        elif mode.is_decode():
            self.forward_metadata = self._decode_metadata(forward_batch)
        elif mode.is_target_verify():
            self.forward_metadata = self._verify_metadata(forward_batch)
        else:
            self.forward_metadata = self._extend_metadata(
                forward_batch.out_cache_loc,
                forward_batch.req_pool_indices,
                forward_batch.extend_prefix_lens,
                forward_batch.extend_seq_lens,
                tree_mask=None,
            )

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture=False):
        self.init_forward_metadata(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def support_triton(self) -> bool:
        return False

    def _decode_metadata(self, forward_batch: ForwardBatch) -> DecodeMetadata:
        slots, valid = _padded_prefix_slots(
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
        )
        return _decode_metadata_of(slots, valid)

    def _verify_metadata(self, forward_batch: ForwardBatch) -> ExtendMetadata:
        spec_info = forward_batch.spec_info
        batch = forward_batch.req_pool_indices.shape[0]
        num_tokens = spec_info.draft_token_num
        q_lens = torch.full((batch,), num_tokens, dtype=torch.int64, device=self.device)
        prefix_lens = forward_batch.seq_lens.long()
        return self._extend_metadata(
            forward_batch.out_cache_loc,
            forward_batch.req_pool_indices,
            prefix_lens,
            q_lens,
            tree_mask=_tree_mask_qlen(spec_info.custom_mask, prefix_lens, num_tokens),
        )

    def _extend_metadata(
        self,
        out_cache_loc: torch.Tensor | None,  # [num_tokens] KV slot of each new token
        req_pool_indices: torch.Tensor,  # [batch]
        prefix_lens: torch.Tensor,  # [batch]
        q_lens: torch.Tensor,  # [batch]
        tree_mask: torch.Tensor | None,  # [batch, n, n] bool, target verify only
    ) -> ExtendMetadata:
        prefix_lens = prefix_lens.long()
        q_lens = q_lens.long()
        prefix_slots, prefix_valid = _padded_prefix_slots(
            self.req_to_token_pool.req_to_token, req_pool_indices, prefix_lens
        )
        max_q = int(q_lens.max())
        starts = torch.cumsum(q_lens, 0) - q_lens  # [batch]
        cols = torch.arange(max_q, device=q_lens.device)
        token_valid = cols.unsqueeze(0) < q_lens.unsqueeze(1)  # [batch, max_q]
        token_index = torch.where(token_valid, starts.unsqueeze(1) + cols, 0)
        if tree_mask is not None:
            new_mask = tree_mask
        else:
            causal = cols.unsqueeze(1) >= cols.unsqueeze(0)  # [max_q, max_q]
            new_mask = causal.unsqueeze(0) & token_valid.unsqueeze(1)
        # Padded query rows still see one valid key (their own column or the first new
        # token), so softmax never meets an all-masked row.
        prefix_mask = prefix_valid.unsqueeze(1).expand(-1, max_q, -1)
        mask = torch.cat([prefix_mask, new_mask], dim=2).unsqueeze(1)
        slots = None
        if out_cache_loc is not None:
            new_slots = torch.where(token_valid, out_cache_loc.long()[token_index], 0)
            slots = torch.cat([prefix_slots, new_slots], dim=1)
        return ExtendMetadata(
            prefix_slots=prefix_slots,
            slots=slots,
            token_index=token_index,
            token_valid=token_valid,
            mask=_mask_if_needed(mask),
            num_tokens=int(q_lens.sum()),
            dense=bool(token_valid.all()),
        )

    # -- forward ----------------------------------------------------------------------------

    def _save_kv(self, layer, forward_batch: ForwardBatch, k, v, save_kv_cache: bool) -> None:
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc), k, v
            )

    def forward_extend(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kw):
        self._save_kv(layer, forward_batch, k, v, save_kv_cache)
        meta = self.forward_metadata
        assert isinstance(meta, ExtendMetadata), "extend forward without extend metadata"
        heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
        q_ = q.reshape(-1, heads, layer.qk_head_dim)
        k_new = k.reshape(-1, kv_heads, layer.qk_head_dim)
        v_new = v.reshape(-1, kv_heads, layer.v_head_dim)
        key_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        value_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        idx = meta.token_index  # [batch, max_q]
        saved = save_kv_cache and meta.slots is not None
        if saved and key_cache.dtype == value_cache.dtype == q_.dtype:
            # The new K/V are in the cache now (same dtype, same values): one gather of
            # prefix + new slots instead of two gathers and a torch.cat copy per layer.
            keys = _gather_slots(key_cache, meta.slots)  # [batch, max_prefix + max_q, Hkv, D]
            values = _gather_slots(value_cache, meta.slots)
        else:
            prefix_keys = _gather_slots(key_cache, meta.prefix_slots).to(q_.dtype)
            prefix_values = _gather_slots(value_cache, meta.prefix_slots).to(q_.dtype)
            keys = torch.cat([prefix_keys, _gather_slots(k_new, idx)], dim=1)
            values = torch.cat([prefix_values, _gather_slots(v_new, idx)], dim=1)
        # A verify (every request the same number of new tokens) reads its queries and writes
        # its outputs as views of the flat rows; a ragged prefill gathers and scatters them.
        dense = meta.dense and q_.shape[0] == meta.num_tokens
        queries = (  # [batch, max_q, H, D]
            q_.view(*idx.shape, heads, layer.qk_head_dim) if dense else _gather_slots(q_, idx)
        )
        out = _attend(queries, keys, values, meta.mask, layer.scaling)  # [batch, max_q, H, Dv]
        if dense:
            return out.reshape(q_.shape[0], heads * layer.v_head_dim)
        o = q.new_empty((q_.shape[0], heads, layer.v_head_dim))
        o[idx[meta.token_valid]] = out[meta.token_valid]
        return o.reshape(q_.shape[0], heads * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch: ForwardBatch, save_kv_cache=True, **kw):
        self._save_kv(layer, forward_batch, k, v, save_kv_cache)
        meta = self.forward_metadata
        assert isinstance(meta, DecodeMetadata), "decode forward without decode metadata"
        heads = layer.tp_q_head_num
        q_ = q.reshape(-1, 1, heads, layer.qk_head_dim)
        key_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        value_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        keys = _gather_slots(key_cache, meta.slots).to(q_.dtype)  # [rows, max_kv, kv_heads, D]
        values = _gather_slots(value_cache, meta.slots).to(q_.dtype)
        out = _attend(q_, keys, values, meta.mask, layer.scaling)
        return out.reshape(q_.shape[0], heads * layer.v_head_dim)


def _tree_mask_qlen(
    custom_mask: torch.Tensor,  # flat bool: QLEN_ONLY [batch*n*n] or FULL [sum n*(len+n)]
    prefix_lens: torch.Tensor,  # [batch]
    num_tokens: int,
) -> torch.Tensor:
    """The tree part of a verify mask as [batch, n, n], from either of SGLang's layouts."""
    batch = prefix_lens.shape[0]
    n = num_tokens
    if custom_mask.numel() == batch * n * n:
        return custom_mask.view(batch, n, n).bool()
    # FULL_MASK: request b owns n rows of (prefix_len + n) columns; keep the last n.
    row_len = prefix_lens + n  # [batch]
    starts = torch.cumsum(n * row_len, 0) - n * row_len  # [batch]
    rows = torch.arange(n, device=prefix_lens.device)
    cols = torch.arange(n, device=prefix_lens.device)
    flat = (
        starts.view(batch, 1, 1)
        + rows.view(1, n, 1) * row_len.view(batch, 1, 1)
        + prefix_lens.view(batch, 1, 1)
        + cols.view(1, 1, n)
    )
    return custom_mask[flat].bool()


class _DraftStepBackend(AdaTreeCpuAttnBackend):
    """The backend of one draft step; its metadata is filled by the multi-step owner."""

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        # The multi-step owner already planned every step; nothing per step.
        return None


class AdaTreeCpuMultiStepDraftBackend:
    """Draft decode over ``steps`` passes with ``topk`` branches per request (CPU)."""

    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner, topk: int, speculative_num_steps: int) -> None:
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.attn_backends: list[AdaTreeCpuAttnBackend] = [
            _DraftStepBackend(model_runner, skip_prefill=True)
            for _ in range(max(speculative_num_steps - 1, 0))
        ]

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Plan every draft step: prefix slots plus each branch's own draft slots."""
        topk, steps = self.topk, self.speculative_num_steps
        seq_lens = forward_batch.seq_lens.long()  # [batch]
        req_to_token = self.req_to_token_pool.req_to_token
        prefix_slots, prefix_valid = _padded_prefix_slots(
            req_to_token, forward_batch.req_pool_indices, seq_lens
        )
        # Branch t of request b owns slots seq_len + t*steps + j, j in [0, steps).
        branch = torch.arange(topk, device=seq_lens.device).view(1, topk, 1)
        step = torch.arange(steps, device=seq_lens.device).view(1, 1, steps)
        cols = seq_lens.view(-1, 1, 1) + branch * steps + step  # [batch, topk, steps]
        rows = req_to_token[forward_batch.req_pool_indices.long()]  # [batch, max_context]
        draft_slots = torch.gather(rows, 1, cols.flatten(1)).view(-1, topk, steps).long()
        # Branch rows are request-major: row = b * topk + t.
        prefix_slots = prefix_slots.repeat_interleave(topk, dim=0)  # [rows, max_prefix]
        prefix_valid = prefix_valid.repeat_interleave(topk, dim=0)
        draft_slots = draft_slots.flatten(0, 1)  # [rows, steps]
        for i, backend in enumerate(self.attn_backends):
            slots = torch.cat([prefix_slots, draft_slots[:, : i + 1]], dim=1)
            valid = torch.cat(
                [prefix_valid, torch.ones_like(draft_slots[:, : i + 1], dtype=torch.bool)],
                dim=1,
            )
            backend.forward_metadata = _decode_metadata_of(slots, valid)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture=False):
        self.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise RuntimeError(f"{BACKEND_NAME} runs without CUDA graphs")
