"""Pure-torch equivalents of SGLang's speculative bookkeeping kernels, for CPU tensors.

Each function mirrors the signature and in-place effects of the SGLang 0.5.23 function named
in its docstring (whose Triton kernel cannot run on a CPU without the interpreter). They are
vectorised over the batch; none imports SGLang, so the tests exercise them directly.
"""

from __future__ import annotations

import torch


def _row_ranges(
    start: torch.Tensor,  # [batch]
    end: torch.Tensor,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened (request, column) pairs of every ``start[b] <= col < end[b]``, request-major."""
    if start.numel() == 1:
        # A batch of one in two ops, not ten: at concurrency 1 each small op costs more than
        # the work.
        first, last = int(start[0]), int(end[0])
        cols = torch.arange(first, max(first, last), device=start.device)
        return torch.zeros_like(cols), cols
    lens = (end - start).long().clamp(min=0)
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    offsets = torch.cumsum(lens, 0) - lens
    cols = start.long()[rows] + torch.arange(rows.numel(), device=lens.device) - offsets[rows]
    return rows, cols


def assign_draft_cache_locs_contiguous(
    req_pool_indices: torch.Tensor,  # [batch]
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len]
    seq_lens: torch.Tensor,  # [batch]
    out_cache_loc: torch.Tensor,  # [batch * topk * num_cols], written
    topk: int,
    num_cols: int,
    positions: torch.Tensor | None = None,  # [batch * topk], written
    mrope: torch.Tensor | None = None,  # [3, batch * topk], written
) -> None:
    """``cache_locs.assign_draft_cache_locs_contiguous_func``: each request's draft slots."""
    width = topk * num_cols
    cols = seq_lens.long().unsqueeze(1) + torch.arange(width, device=seq_lens.device)
    rows = req_to_token[req_pool_indices.long()]
    out_cache_loc.copy_(torch.gather(rows, 1, cols).reshape(-1).to(out_cache_loc.dtype))
    if positions is not None:
        positions.copy_(seq_lens.repeat_interleave(topk).to(positions.dtype))
        if mrope is not None:
            mrope.copy_(positions.unsqueeze(0).expand_as(mrope))


def assign_extend_cache_locs(
    req_pool_indices: torch.Tensor,  # [batch]
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len]
    start_offset: torch.Tensor,  # [batch]
    end_offset: torch.Tensor,  # [batch]
) -> torch.Tensor:
    """``cache_locs.assign_extend_cache_locs_func``: slots ``[start, end)`` of each request."""
    rows, cols = _row_ranges(start_offset, end_offset)
    return req_to_token[req_pool_indices.long()[rows], cols].to(torch.int64)


def fill_front_out_cache_loc(
    num_front: torch.Tensor,  # [batch]
    out_cache_loc: torch.Tensor,  # [batch * window]
    front_out_cache_loc: torch.Tensor,  # [>= sum(num_front)], its prefix written
) -> None:
    """``cache_locs.fill_front_out_cache_loc_func``: the first ``num_front[b]`` window slots.

    Packed request after request into the front of ``front_out_cache_loc``; the rest of that
    buffer is left as it was, as the kernel does.
    """
    window = out_cache_loc.view(num_front.numel(), -1)
    rows, cols = _row_ranges(torch.zeros_like(num_front), num_front)
    front_out_cache_loc[: rows.numel()] = window[rows, cols].to(front_out_cache_loc.dtype)


def fill_bonus_tokens(
    accept_tokens: torch.Tensor,  # [batch * accept_stride]
    accept_lens: torch.Tensor,  # [batch], accepted drafts + 1 bonus
    bonus_tokens: torch.Tensor,  # [batch], written
    accept_stride: int,
    batch_size: int,
) -> None:
    """``eagle.fill_bonus_tokens_func``: the last emitted token of each request."""
    index = torch.arange(batch_size, device=accept_lens.device) * accept_stride
    index = index + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[index].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc(
    accept_index: torch.Tensor,  # [batch * (steps + 1)], -1 where nothing was accepted
    out_cache_loc: torch.Tensor,  # [batch * num_draft_tokens]
    accept_out_cache_loc: torch.Tensor,  # [number of accepted entries], written
) -> None:
    """``eagle.fill_accept_out_cache_loc_func``: slots of accepted nodes, compacted in order."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def assign_req_to_token_pool(
    req_pool_indices: torch.Tensor,  # [batch]
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len], written
    start_offset: torch.Tensor,  # [batch]
    end_offset: torch.Tensor,  # [batch]
    out_cache_loc: torch.Tensor,  # [sum(end - start)]
) -> None:
    """``allocation.assign_req_to_token_pool_func``: record new slots in the slot table."""
    if req_pool_indices.numel() == 1:
        # A batch of one (every decode step at concurrency 1): one slice write instead of the
        # batched form's dozen small ops, each of which costs more on a CPU than the write.
        start, end = int(start_offset[0]), int(end_offset[0])
        if end > start:
            row = int(req_pool_indices[0])
            req_to_token[row, start:end] = out_cache_loc[: end - start].to(req_to_token.dtype)
        return
    rows, cols = _row_ranges(start_offset, end_offset)
    values = out_cache_loc[: rows.numel()].to(req_to_token.dtype)
    req_to_token[req_pool_indices.long()[rows], cols] = values
