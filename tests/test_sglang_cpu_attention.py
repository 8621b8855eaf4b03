"""The CPU attention backend against per-request reference attention.

SGLang objects (runner, KV pool, forward batch, layer) are small fakes (``attention_fakes``);
the end-to-end tests run the backend inside a real SGLang server.
"""

from types import SimpleNamespace

import pytest
import torch
from attention_fakes import FakePool, Mode, attention_layer, fused_qkv

from sglang_adatree.sglang.cpu.attention import (
    AdaTreeCpuAttnBackend,
    AdaTreeCpuMultiStepDraftBackend,
)

HEADS, KV_HEADS, DIM = 4, 2, 8
torch.manual_seed(0)


LAYER = attention_layer(HEADS, KV_HEADS, DIM)


def _runner(slots: int = 400, reqs: int = 4, width: int = 64):
    req_to_token = torch.randperm(slots)[: reqs * width].view(reqs, width).to(torch.int32)
    return SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=FakePool(slots, KV_HEADS, DIM),
        kv_index_translator=None,
        sliding_window_size=None,
    )


def _reference(q, keys, values, allowed):
    """q [H, D]; keys/values [L, KVH, D]; allowed [L] bool -> [H, D]."""
    k = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)  # [L, H, D]
    v = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("hd,lhd->hl", q, k) * LAYER.scaling
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    return torch.einsum("hl,lhd->hd", scores.softmax(-1), v)


def _qkv(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fused_qkv(rows, HEADS, KV_HEADS, DIM)


def _fill_cache(runner, req: int, length: int) -> None:
    slots = runner.req_to_token_pool.req_to_token[req, :length].long()
    runner.token_to_kv_pool.k[slots] = torch.randn(length, KV_HEADS, DIM)
    runner.token_to_kv_pool.v[slots] = torch.randn(length, KV_HEADS, DIM)


def test_extend_matches_reference_with_prefix_and_padding():
    runner = _runner()
    backend = AdaTreeCpuAttnBackend(runner)
    reqs = torch.tensor([2, 0, 3])
    prefix = torch.tensor([5, 0, 9])
    extend = torch.tensor([3, 6, 1])
    for r, p in zip(reqs.tolist(), prefix.tolist(), strict=True):
        _fill_cache(runner, r, p)
    rtt = runner.req_to_token_pool.req_to_token
    out_cache_loc = torch.cat(
        [rtt[r, p : p + e] for r, p, e in zip(reqs, prefix, extend, strict=True)]
    ).long()
    fb = SimpleNamespace(
        forward_mode=Mode("extend"),
        req_pool_indices=reqs,
        seq_lens=prefix + extend,
        extend_prefix_lens=prefix,
        extend_seq_lens=extend,
        out_cache_loc=out_cache_loc,
    )
    n = int(extend.sum())
    q, k, v = _qkv(n)
    backend.init_forward_metadata(fb)
    # Unequal new-token counts: queries are gathered per request and scattered back.
    assert not backend.forward_metadata.dense
    out = backend.forward_extend(q, k, v, LAYER, fb).view(n, HEADS, DIM)
    pool = runner.token_to_kv_pool
    row = 0
    for r, p, e in zip(reqs.tolist(), prefix.tolist(), extend.tolist(), strict=True):
        slots = rtt[r, : p + e].long()
        for i in range(e):
            allowed = torch.arange(p + e) <= p + i
            ref = _reference(q[row + i].view(HEADS, DIM), pool.k[slots], pool.v[slots], allowed)
            torch.testing.assert_close(out[row + i], ref, atol=1e-5, rtol=1e-5)
        row += e


@pytest.mark.parametrize("layout", ["qlen", "full"])
def test_verify_applies_the_tree_mask(layout):
    runner = _runner()
    backend = AdaTreeCpuAttnBackend(runner)
    reqs = torch.tensor([1, 3])
    prefix = torch.tensor([4, 7])
    n = 4
    # Node 0 root; 1 and 2 children of the root; 3 child of 1.
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    for r, p in zip(reqs.tolist(), prefix.tolist(), strict=True):
        _fill_cache(runner, r, p)
    if layout == "qlen":
        custom_mask = tree.repeat(2, 1, 1).flatten()
    else:
        custom_mask = torch.cat(
            [torch.cat([torch.ones(n, p, dtype=torch.bool), tree], 1).flatten() for p in prefix]
        )
    rtt = runner.req_to_token_pool.req_to_token
    out_cache_loc = torch.cat([rtt[r, p : p + n] for r, p in zip(reqs, prefix, strict=True)])
    fb = SimpleNamespace(
        forward_mode=Mode("verify"),
        req_pool_indices=reqs,
        seq_lens=prefix,
        out_cache_loc=out_cache_loc.long(),
        spec_info=SimpleNamespace(draft_token_num=n, custom_mask=custom_mask),
    )
    q, k, v = _qkv(2 * n)
    backend.init_forward_metadata(fb)
    # n tokens for every request: queries and outputs are views of the flat rows.
    assert backend.forward_metadata.dense
    out = backend.forward_extend(q, k, v, LAYER, fb).view(2 * n, HEADS, DIM)
    pool = runner.token_to_kv_pool
    for b, (r, p) in enumerate(zip(reqs.tolist(), prefix.tolist(), strict=True)):
        slots = rtt[r, : p + n].long()
        for i in range(n):
            allowed = torch.cat([torch.ones(p, dtype=torch.bool), tree[i]])
            ref = _reference(q[b * n + i].view(HEADS, DIM), pool.k[slots], pool.v[slots], allowed)
            torch.testing.assert_close(out[b * n + i], ref, atol=1e-5, rtol=1e-5)


# adatree's step without speculation verifies one token per request: with equal prefixes every
# query sees every key and the forward runs without a mask; unequal ones keep it.
@pytest.mark.parametrize("prefix", [(6, 2), (5, 5)])
def test_one_token_verify_matches_decode_attention(prefix):
    runner = _runner()
    backend = AdaTreeCpuAttnBackend(runner)
    reqs = torch.tensor([2, 0])
    prefix_lens = torch.tensor(prefix)
    for r, p in zip(reqs.tolist(), prefix, strict=True):
        _fill_cache(runner, r, p)
    rtt = runner.req_to_token_pool.req_to_token
    out_cache_loc = torch.stack([rtt[r, p] for r, p in zip(reqs, prefix_lens, strict=True)])
    fb = SimpleNamespace(
        forward_mode=Mode("verify"),
        req_pool_indices=reqs,
        seq_lens=prefix_lens,
        out_cache_loc=out_cache_loc.long(),
        # SGLang's trivial verify input: an all-True mask in the FULL layout
        spec_info=SimpleNamespace(
            draft_token_num=1, custom_mask=torch.ones(int(prefix_lens.sum()) + 2, dtype=torch.bool)
        ),
    )
    q, k, v = _qkv(2)
    backend.init_forward_metadata(fb)
    assert (backend.forward_metadata.mask is None) == (prefix[0] == prefix[1])
    assert backend.forward_metadata.dense
    out = backend.forward_extend(q, k, v, LAYER, fb).view(2, HEADS, DIM)
    pool = runner.token_to_kv_pool
    for b, (r, p) in enumerate(zip(reqs.tolist(), prefix, strict=True)):
        slots = rtt[r, : p + 1].long()
        ref = _reference(
            q[b].view(HEADS, DIM), pool.k[slots], pool.v[slots], torch.ones(p + 1, dtype=torch.bool)
        )
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


def test_extend_without_saving_reads_the_new_kv_from_its_inputs():
    # save_kv_cache=False: the new tokens' K/V never reach the cache, so the keys must come
    # from the forward's own k and v (the cache's slots for them hold stale data here).
    runner = _runner()
    backend = AdaTreeCpuAttnBackend(runner)
    reqs = torch.tensor([1])
    prefix, extend = 4, 3
    _fill_cache(runner, 1, prefix + extend)  # stale values in the new tokens' slots
    rtt = runner.req_to_token_pool.req_to_token
    fb = SimpleNamespace(
        forward_mode=Mode("extend"),
        req_pool_indices=reqs,
        seq_lens=torch.tensor([prefix + extend]),
        extend_prefix_lens=torch.tensor([prefix]),
        extend_seq_lens=torch.tensor([extend]),
        out_cache_loc=rtt[1, prefix : prefix + extend].long(),
    )
    q, k, v = _qkv(extend)
    pool = runner.token_to_kv_pool
    before = pool.k.clone(), pool.v.clone()
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(q, k, v, LAYER, fb, save_kv_cache=False).view(extend, HEADS, DIM)
    assert torch.equal(pool.k, before[0]) and torch.equal(pool.v, before[1])
    slots = rtt[1, :prefix].long()
    keys = torch.cat([pool.k[slots], k.view(extend, KV_HEADS, DIM)])
    values = torch.cat([pool.v[slots], v.view(extend, KV_HEADS, DIM)])
    for i in range(extend):
        allowed = torch.arange(prefix + extend) <= prefix + i
        ref = _reference(q[i].view(HEADS, DIM), keys, values, allowed)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


# Unequal lengths take the masked path; equal ones the mask-free one.
@pytest.mark.parametrize("lens", [(6, 2), (5, 5)])
def test_decode_reads_each_request_slots(lens):
    runner = _runner()
    backend = AdaTreeCpuAttnBackend(runner)
    reqs = torch.tensor([0, 2])
    seq_lens = torch.tensor(lens)
    rtt = runner.req_to_token_pool.req_to_token
    for r, s in zip(reqs.tolist(), seq_lens.tolist(), strict=True):
        _fill_cache(runner, r, s - 1)
    out_cache_loc = torch.stack([rtt[r, s - 1] for r, s in zip(reqs, seq_lens, strict=True)])
    fb = SimpleNamespace(
        forward_mode=Mode("decode"),
        req_pool_indices=reqs,
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc.long(),
    )
    q, k, v = _qkv(2)
    backend.init_forward_metadata(fb)
    assert (backend.forward_metadata.mask is None) == (lens[0] == lens[1])
    out = backend.forward_decode(q, k, v, LAYER, fb).view(2, HEADS, DIM)
    pool = runner.token_to_kv_pool
    for b, (r, s) in enumerate(zip(reqs.tolist(), seq_lens.tolist(), strict=True)):
        slots = rtt[r, :s].long()
        ref = _reference(
            q[b].view(HEADS, DIM), pool.k[slots], pool.v[slots], torch.ones(s, dtype=torch.bool)
        )
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [(5, 8), (7, 7)])
def test_draft_branches_read_prefix_and_their_own_slots(lens):
    runner = _runner()
    topk, steps = 2, 3
    multi = AdaTreeCpuMultiStepDraftBackend(runner, topk, steps)
    assert len(multi.attn_backends) == steps - 1
    reqs = torch.tensor([3, 1])
    seq_lens = torch.tensor(lens)
    rtt = runner.req_to_token_pool.req_to_token
    for r, s in zip(reqs.tolist(), seq_lens.tolist(), strict=True):
        _fill_cache(runner, r, s + topk * steps)  # prefix and every branch slot hold data
    fb = SimpleNamespace(forward_mode=Mode("decode"), req_pool_indices=reqs, seq_lens=seq_lens)
    multi.init_forward_metadata(fb)
    pool = runner.token_to_kv_pool
    for i, backend in enumerate(multi.attn_backends):
        # Step i writes the token at slot seq_len + t * steps + i of each branch t.
        out_cache_loc = torch.stack(
            [
                rtt[r, s + t * steps + i]
                for r, s in zip(reqs.tolist(), seq_lens.tolist(), strict=True)
                for t in range(topk)
            ]
        ).long()
        rows = len(reqs) * topk
        q, k, v = _qkv(rows)
        step_fb = SimpleNamespace(out_cache_loc=out_cache_loc)
        out = backend.forward_decode(q, k, v, LAYER, step_fb).view(rows, HEADS, DIM)
        for b, (r, s) in enumerate(zip(reqs.tolist(), seq_lens.tolist(), strict=True)):
            for t in range(topk):
                own = [s + t * steps + j for j in range(i + 1)]
                slots = torch.cat([rtt[r, :s], rtt[r, own]]).long()
                ref = _reference(
                    q[b * topk + t].view(HEADS, DIM),
                    pool.k[slots],
                    pool.v[slots],
                    torch.ones(len(slots), dtype=torch.bool),
                )
                torch.testing.assert_close(out[b * topk + t], ref, atol=1e-5, rtol=1e-5)


def test_translating_pool_refused():
    runner = _runner()
    runner.kv_index_translator = SimpleNamespace(is_translating=True)
    with pytest.raises(ValueError, match="translating"):
        AdaTreeCpuAttnBackend(runner)
