"""The pure-torch bookkeeping kernels against straightforward per-request loops.

Each loop restates, request by request, what the SGLang 0.5.23 Triton kernel of the same name
does (read from ``kernels/ops/speculative/cache_locs.py``, ``eagle.py`` and
``mem_cache/allocation.py``).
"""

import torch

from sglang_adatree.sglang.cpu import kernels as cpu_kernels

torch.manual_seed(0)


def _pool(max_reqs: int = 6, width: int = 40) -> torch.Tensor:
    return torch.randperm(max_reqs * width).view(max_reqs, width).to(torch.int32)


def test_assign_draft_cache_locs_contiguous():
    req_to_token = _pool()
    req_pool_indices = torch.tensor([4, 1, 2])
    seq_lens = torch.tensor([5, 0, 11])
    topk, cols = 3, 4
    out = torch.empty(3 * topk * cols, dtype=torch.int64)
    positions = torch.empty(3 * topk, dtype=torch.int64)
    cpu_kernels.assign_draft_cache_locs_contiguous(
        req_pool_indices, req_to_token, seq_lens, out, topk, cols, positions=positions
    )
    expected, expected_pos = [], []
    for b in range(3):
        start = int(seq_lens[b])
        expected += req_to_token[req_pool_indices[b], start : start + topk * cols].tolist()
        expected_pos += [start] * topk
    assert out.tolist() == expected
    assert positions.tolist() == expected_pos


def test_assign_extend_cache_locs_and_req_to_token_round_trip():
    req_to_token = _pool()
    req_pool_indices = torch.tensor([3, 0, 5])
    start = torch.tensor([2, 7, 0])
    end = torch.tensor([6, 7, 3])  # an empty range in the middle
    got = cpu_kernels.assign_extend_cache_locs(req_pool_indices, req_to_token, start, end)
    expected = []
    for b in range(3):
        expected += req_to_token[req_pool_indices[b], start[b] : end[b]].tolist()
    assert got.tolist() == expected and got.dtype == torch.int64

    fresh = torch.zeros_like(req_to_token)
    cpu_kernels.assign_req_to_token_pool(req_pool_indices, fresh, start, end, got)
    for b in range(3):
        row = int(req_pool_indices[b])
        assert (
            fresh[row, start[b] : end[b]].tolist() == req_to_token[row, start[b] : end[b]].tolist()
        )
    assert int((fresh != 0).sum()) == len(expected) - int((got == 0).sum())


def test_assign_req_to_token_pool_for_one_request_matches_the_batched_form():
    for start, end in ((4, 9), (7, 7), (8, 3)):  # a range, an empty one, a reversed one
        slots = torch.arange(500, 520)
        before = _pool()
        one, batched = before.clone(), before.clone()
        args = (torch.tensor([start]), torch.tensor([end]), slots)
        cpu_kernels.assign_req_to_token_pool(torch.tensor([2]), one, *args)
        # The same request beside an empty one takes the batched path.
        cpu_kernels.assign_req_to_token_pool(
            torch.tensor([2, 5]),
            batched,
            torch.tensor([start, 0]),
            torch.tensor([end, 0]),
            slots,
        )
        assert torch.equal(one, batched)
        assert int((one != before).sum()) == max(end - start, 0)


def test_row_ranges_of_one_request_match_the_batched_form():
    for start, end in ((4, 9), (7, 7), (8, 3)):
        rows, cols = cpu_kernels._row_ranges(torch.tensor([start]), torch.tensor([end]))
        both_rows, both_cols = cpu_kernels._row_ranges(
            torch.tensor([start, 0]), torch.tensor([end, 0])
        )
        assert rows.tolist() == both_rows.tolist() == [0] * max(end - start, 0)
        assert cols.tolist() == both_cols.tolist() == list(range(start, max(start, end)))
        assert rows.dtype == cols.dtype == both_cols.dtype == torch.int64


def test_fill_front_out_cache_loc_writes_only_the_prefix():
    num_front = torch.tensor([1, 3, 2])
    window = torch.arange(100, 100 + 3 * 4)  # 3 requests x window 4
    out = torch.full((3 * 4,), -7, dtype=torch.int64)
    cpu_kernels.fill_front_out_cache_loc(num_front, window, out)
    assert out[:6].tolist() == [100, 104, 105, 106, 108, 109]
    assert out[6:].tolist() == [-7] * 6


def test_fill_bonus_tokens():
    accept_tokens = torch.tensor([10, 11, 12, 20, 21, 22, 30, 31, 32])  # stride 3
    accept_lens = torch.tensor([1, 3, 2])
    bonus = torch.empty(3, dtype=torch.int32)
    cpu_kernels.fill_bonus_tokens(accept_tokens, accept_lens, bonus, 3, 3)
    assert bonus.tolist() == [10, 22, 31]


def test_fill_accept_out_cache_loc_compacts_in_order():
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 9]], dtype=torch.int32)
    out_cache_loc = torch.arange(50, 62)
    out = torch.zeros(9, dtype=torch.int64)
    cpu_kernels.fill_accept_out_cache_loc(accept_index, out_cache_loc, out)
    assert out[:6].tolist() == [50, 52, 54, 56, 57, 59]
    assert out[6:].tolist() == [0, 0, 0]
