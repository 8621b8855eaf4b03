"""The draft tree: which draft nodes are verified, its attention mask, positions and links.

Pure-torch stand-ins for SGLang 0.5.23's tree kernels (``organize_draft_results`` and
``build_tree_kernel_efficient`` in ``srt/speculative/eagle_utils.py``, the Triton kernel
``sgl_build_tree_kernel_efficient_triton`` in ``kernels/ops/speculative/spec_tree.py``), with
the same inputs, dtypes and outputs, batched and vectorised (loops run over tree depth only).

Vocabulary, for one request with shape ``(steps, topk, num_draft_tokens)`` (``N`` below):

* candidate: a node the draft scored. Step 0 scores ``topk`` children of the root, every later
  step ``topk**2`` (``topk`` children of each of the ``topk`` nodes it expanded). Candidate ``c``
  of the flattened score list has parent slot ``c // topk`` (0: the root) and sibling rank
  ``c % topk`` (0: the draft's most likely child of that parent).
* node: one of the ``N`` verified tokens. Node 0 is the root (the last verified token, SGLang's
  ``bonus_tokens`` / verified id); node ``i >= 1`` is the candidate ``top_scores_index[i - 1]``.
  The candidates are kept in increasing candidate order, so a parent precedes its children.
* links: SGLang's first-child / next-sibling encoding. ``retrieve_next_token[i]`` is the
  smallest child of node ``i`` (-1: a leaf), ``retrieve_next_sibling[i]`` the next larger child
  of the same parent (-1: the last), ``retrieve_index[b, i] = b * N + i`` (the node's row in the
  flattened verify batch).

Worked example (one request, topk 2, steps 2, N 4): candidates 0, 1 are the root's children,
2..5 the children of the two step-0 nodes. ``parent_list = [-1, 0, 1]`` (slot 0 is the root,
slots 1, 2 the step-0 nodes 0 and 1), ``top_scores_index = [0, 1, 2]`` keeps both root children
and the best child of candidate 0, so ``retrieve_next_token = [1, 3, -1, -1]``,
``retrieve_next_sibling = [-1, 2, -1, -1]``, positions ``seq_len + [0, 1, 1, 2]`` and the
``N x N`` mask rows (who each node attends to inside the tree) are ``1000, 1100, 1010, 1101``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

import torch

from sglang_adatree.core.acceptance import AcceptedPathStats


class TreeMaskMode(IntEnum):
    """Layouts of the verify attention mask; the values equal SGLang's ``TreeMaskMode``.

    * FULL_MASK: per request ``N`` rows of ``seq_len + N`` booleans (the prefix columns come
      from the fill, the kernel writes the last ``N``), requests back to back.
    * QLEN_ONLY: per request ``N`` rows of ``N`` booleans.
    * QLEN_ONLY_BITPACKING: per request ``N`` little-endian bit rows of 1, 2 or 4 bytes
      (``N`` <= 8, 16, 32); bit ``j`` of row ``i`` is column ``j``.
    """

    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2


@dataclass(frozen=True)
class DraftSelection:
    """The verified subset of the draft candidates: SGLang's ``organize_draft_results`` tuple."""

    parent_list: torch.Tensor  # [batch, (steps - 1) * topk + 1] int64; [batch, 0] when steps == 1
    top_scores_index: torch.Tensor  # [batch, num_draft_tokens - 1] int64, increasing candidates
    draft_tokens: torch.Tensor  # [batch, num_draft_tokens - 1] token ids of those candidates


@dataclass(frozen=True)
class VerifyTree:
    """SGLang's ``build_tree_kernel_efficient`` 6-tuple, in the same order."""

    tree_mask: torch.Tensor  # flat, layout per TreeMaskMode; bool (packed: uint8/16/32)
    positions: torch.Tensor  # [batch * num_draft_tokens] int64: seq_len + depth of the node
    retrieve_index: torch.Tensor  # [batch, num_draft_tokens] int64: b * N + i
    retrieve_next_token: torch.Tensor  # [batch, num_draft_tokens] int64: first child or -1
    retrieve_next_sibling: torch.Tensor  # [batch, num_draft_tokens] int64: next sibling or -1
    draft_tokens: torch.Tensor  # [batch * num_draft_tokens]: the root token, then the nodes


@dataclass(frozen=True)
class TreeTopology:
    """The tree's structure recovered from its links (nodes no link reaches have no parent)."""

    parent: torch.Tensor  # [batch, N] int64: parent node, -1 for the root (and unlinked nodes)
    sibling_rank: torch.Tensor  # [batch, N] int64: place in the parent's child links, else -1
    children: torch.Tensor  # [batch, N, N] bool: [b, p, j] = node j is a child of node p


def organize_draft_results(
    score_list: list[torch.Tensor],
    token_list: list[torch.Tensor],
    parents_list: list[torch.Tensor],
    num_draft_tokens: int,
) -> DraftSelection:
    """Keep the best ``num_draft_tokens - 1`` candidates by cumulative draft score.

    Inputs are the per-step lists of SGLang's draft loop (``select_top_k_tokens``):
    ``score_list[0]`` ``[batch, 1, topk]``, later ``[batch, topk, topk]``; ``token_list[0]``
    ``[batch, topk]``, later ``[batch, topk * topk]``; ``parents_list[0]`` ``[batch, topk + 1]``
    (``-1, 0, .., topk - 1``), later ``[batch, topk]`` (candidate index of each expanded node).
    Ties are broken by ``torch.topk`` exactly as SGLang does.
    """
    assert len(score_list) == len(token_list) == len(parents_list) >= 1
    scores = torch.cat(score_list, dim=1).flatten(1)  # [batch, num_candidates]
    tokens = torch.cat(token_list, dim=1)  # [batch, num_candidates]
    assert scores.shape == tokens.shape, (scores.shape, tokens.shape)
    assert 1 <= num_draft_tokens - 1 <= scores.shape[1], (num_draft_tokens, scores.shape)
    top_scores_index = torch.topk(scores, num_draft_tokens - 1, dim=-1).indices
    top_scores_index = torch.sort(top_scores_index).values  # [batch, num_draft_tokens - 1]
    draft_tokens = torch.gather(tokens, 1, top_scores_index)
    if len(parents_list) > 1:
        # The last step's parents belong to nodes nobody expanded: not needed.
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        batch = parents_list[0].shape[0]
        parent_list = torch.empty(batch, 0, dtype=torch.long, device=parents_list[0].device)
    return DraftSelection(parent_list, top_scores_index, draft_tokens)


def packed_mask_dtype(num_draft_tokens: int) -> torch.dtype:
    """Element type of a QLEN_ONLY_BITPACKING mask: one element per row, as SGLang allocates."""
    assert 1 <= num_draft_tokens <= 32, num_draft_tokens
    return (torch.uint8, torch.uint16, torch.uint32)[
        math.ceil(math.log2((num_draft_tokens + 7) // 8))
    ]


def build_verify_tree(
    bonus_tokens: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_sum: int,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: TreeMaskMode = TreeMaskMode.FULL_MASK,
    tree_mask_buf: torch.Tensor | None = None,
    fill_prefix_mask: bool = True,
) -> VerifyTree:
    """Equivalent of SGLang's ``build_tree_kernel_efficient`` (same arguments, same outputs).

    ``bonus_tokens`` ``[batch]`` is the root token of each request, ``seq_lens`` ``[batch]``
    int64 the verified lengths, ``seq_lens_sum`` at least their sum (it only sizes a freshly
    allocated FULL_MASK). With ``tree_mask_buf`` (a preallocated, CUDA-graph style buffer) the
    mask is written there: filled with True first (QLEN_ONLY; FULL_MASK when
    ``fill_prefix_mask``) or 0 (bit-packed), then the tree cells.
    """
    batch = seq_lens.numel()
    device = seq_lens.device
    n = num_verify_tokens
    # Type promotion as in SGLang: int32 bonus tokens next to int64 draft tokens give int64.
    tokens = torch.cat((bonus_tokens.unsqueeze(1), draft_tokens), dim=1).flatten()
    mode = TreeMaskMode(tree_mask_mode)
    cells = _tree_cells(parent_list, top_scores_index, seq_lens, topk, spec_steps, n)
    if tree_mask_buf is not None:
        tree_mask = tree_mask_buf
        if mode == TreeMaskMode.QLEN_ONLY or (mode == TreeMaskMode.FULL_MASK and fill_prefix_mask):
            tree_mask.fill_(True)
        elif mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
            tree_mask.fill_(0)
        _write_mask(tree_mask, cells.block, seq_lens, mode)
    elif mode == TreeMaskMode.QLEN_ONLY:
        tree_mask = cells.block.flatten()  # the kernel writes every cell of this layout
    elif mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        tree_mask = torch.zeros((n * batch,), dtype=packed_mask_dtype(n), device=device)
        _write_mask(tree_mask, cells.block, seq_lens, mode)
    else:
        numel = seq_lens_sum * n + n * n * batch
        tree_mask = torch.empty((numel,), dtype=torch.bool, device=device)
        if fill_prefix_mask:  # skipped only when the caller says nobody reads the prefix
            tree_mask.fill_(True)
        _write_mask(tree_mask, cells.block, seq_lens, mode)
    return VerifyTree(
        tree_mask,
        cells.positions,
        cells.retrieve_index,
        cells.retrieve_next_token,
        cells.retrieve_next_sibling,
        tokens,
    )


def write_verify_tree(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    spec_steps: int,
    num_verify_tokens: int,
    tree_mask_mode: TreeMaskMode,
) -> None:
    """Equivalent of SGLang's kernel ``build_tree_kernel_efficient_func``: writes in place.

    Writes the same cells as the kernel: every tree cell of the mask (not FULL_MASK's prefix
    columns), all positions, and the three link tensors completely (the kernel leaves cells
    without a link at the -1 its caller filled in; here they are written as -1).
    """
    batch, n = seq_lens.shape[0], num_verify_tokens
    assert retrieve_index.shape == retrieve_next_token.shape == (batch, n)
    assert retrieve_next_sibling.shape == (batch, n) and positions.shape == (batch * n,)
    cells = _tree_cells(parent_list, top_scores_index, seq_lens, topk, spec_steps, n)
    positions.copy_(cells.positions)
    retrieve_index.copy_(cells.retrieve_index)
    retrieve_next_token.copy_(cells.retrieve_next_token)
    retrieve_next_sibling.copy_(cells.retrieve_next_sibling)
    _write_mask(tree_mask, cells.block, seq_lens, TreeMaskMode(tree_mask_mode))


@dataclass(frozen=True)
class _TreeCells:
    """Everything the tree kernel writes, before it goes into a mask layout."""

    block: torch.Tensor  # [batch, N, N] bool: row i attends to node j (the tree part)
    positions: torch.Tensor  # [batch * N] int64
    retrieve_index: torch.Tensor  # [batch, N] int64
    retrieve_next_token: torch.Tensor  # [batch, N] int64
    retrieve_next_sibling: torch.Tensor  # [batch, N] int64


def _tree_cells(
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    spec_steps: int,
    n: int,
) -> _TreeCells:
    """Links, positions and the tree block, as the Triton kernel computes them.

    A node whose parent candidate was not kept (SGLang warns "invalid eagle tree"; only NaN or
    tied scores cause it) is handled as the Triton kernel does: it gets no link, and its
    ancestor walk (which sets its mask row and position) stops there.
    """
    batch = seq_lens.shape[0]
    assert n >= 2, "a verify tree needs the root and at least one draft token"
    assert top_scores_index.shape == (batch, n - 1), (top_scores_index.shape, batch, n)
    assert top_scores_index.dtype == torch.int64 and seq_lens.dtype == torch.int64
    assert parent_list.dim() == 2 and parent_list.shape[0] == batch, parent_list.shape
    device = seq_lens.device
    parent = _parent_nodes(parent_list, top_scores_index, topk)  # [batch, n]

    # Ancestors by the recurrence anc(i) = {i} + anc(parent(i)), spec_steps - 1 times: each
    # row then holds the node and up to spec_steps - 1 ancestors, the Triton walk's bound
    # (counting the node itself, it visits at most spec_steps non-root nodes). A missing
    # parent ends the walk like the root does.
    own = torch.eye(n, dtype=torch.bool, device=device)
    own[:, 0] = True  # every row attends to the root
    own = own.expand(batch, n, n)
    up = parent.clamp(min=0).unsqueeze(2).expand(batch, n, n)
    block = own
    for _ in range(spec_steps - 1):
        block = own | block.gather(1, up)
    depth = block[:, :, 1:].sum(dim=2)  # [batch, n] non-root nodes on the walk

    first, sibling = _links_from_parents(parent)
    return _TreeCells(
        block=block,
        positions=(seq_lens.unsqueeze(1) + depth).flatten(),
        retrieve_index=torch.arange(batch * n, device=device).view(batch, n),
        retrieve_next_token=first,
        retrieve_next_sibling=sibling,
    )


def _parent_nodes(
    parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int
) -> torch.Tensor:
    """Parent node of each node: -1 for the root and for a node whose parent was not kept."""
    batch, n = top_scores_index.shape[0], top_scores_index.shape[1] + 1
    slot = top_scores_index // topk  # [batch, n - 1] 0: a child of the root
    if parent_list.shape[1] == 0:
        # steps == 1: every candidate is a root child (the kernels never read parent_list).
        parent = torch.zeros_like(slot)
    else:
        parent_candidate = parent_list.gather(1, slot.clamp(max=parent_list.shape[1] - 1))
        # Kept candidates are distinct (torch.topk indices), so at most one matches.
        hit = top_scores_index.unsqueeze(1) == parent_candidate.unsqueeze(2)  # [b, n-1, n-1]
        node = torch.arange(1, n, device=slot.device)
        found = torch.where(hit, node, -1).amax(dim=2)  # matching node, -1 when none
        parent = torch.where(slot == 0, 0, found)
    return torch.cat((parent.new_full((batch, 1), -1), parent), dim=1)


def _links_from_parents(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling links: children in increasing node order, as SGLang's."""
    n = parent.shape[1]
    node = torch.arange(n, device=parent.device)
    none = n  # larger than any node: "no such node"
    # first[b, p] = smallest node whose parent is p.
    is_child = parent.unsqueeze(1) == node.view(1, n, 1)  # [batch, p, i]
    first = torch.where(is_child, node, none).amin(dim=2)  # [batch, n]
    # sibling[b, i] = smallest later node with the same parent.
    same = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (node > node.view(n, 1))
    sibling = torch.where(same, node, none).amin(dim=2)  # [batch, n]
    # Nodes without a parent (-1) are nobody's sibling: the root and orphans have none.
    sibling = torch.where((sibling == none) | (parent < 0), -1, sibling)
    return torch.where(first == none, -1, first), sibling


def _write_mask(
    tree_mask: torch.Tensor, block: torch.Tensor, seq_lens: torch.Tensor, mode: TreeMaskMode
) -> None:
    """Write the ``[batch, N, N]`` tree block into the flat mask in ``mode``'s layout."""
    batch, n, _ = block.shape
    if mode == TreeMaskMode.QLEN_ONLY:
        tree_mask[: batch * n * n] = block.flatten()
    elif mode == TreeMaskMode.FULL_MASK:
        # Request b starts at n * (n * b + sum(seq_lens[:b])); its rows are seq_len + n long
        # and the tree columns are the last n of each row.
        start = n * (n * torch.arange(batch, device=block.device) + seq_lens.cumsum(0) - seq_lens)
        row = (seq_lens + n).view(batch, 1, 1) * torch.arange(n, device=block.device).view(1, n, 1)
        index = (start + seq_lens).view(batch, 1, 1) + row + torch.arange(n, device=block.device)
        tree_mask[index.flatten()] = block.flatten().to(tree_mask.dtype)
    else:
        assert n <= 32, f"bit-packed masks hold at most 32 columns, not {n}"
        width = 1 if n <= 8 else 2 if n <= 16 else 4  # bytes per row, as the CUDA kernel
        bits = (block.long() << torch.arange(n, device=block.device)).sum(dim=2)  # [batch, n]
        shifts = 8 * torch.arange(width, device=block.device)
        row_bytes = ((bits.unsqueeze(2) >> shifts) & 0xFF).to(torch.uint8)  # little endian
        tree_mask.view(torch.uint8)[: batch * n * width] = row_bytes.flatten()


def tree_topology(
    retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor
) -> TreeTopology:
    """Parents, children and sibling ranks of every node, from the first-child / next-sibling
    links.

    Dense and loop-free over nodes: the sibling links become a reachability matrix, closed by
    repeated squaring (ceil(log2 N) small matrix products); a parent's children are then the
    nodes reachable from its first child.
    """
    assert retrieve_next_token.shape == retrieve_next_sibling.shape
    assert retrieve_next_token.dim() == 2 and retrieve_next_token.dtype == torch.int64
    n = retrieve_next_token.shape[1]
    node = torch.arange(n, device=retrieve_next_token.device)
    # reach[b, i, j] = 1: j is i or a later sibling of i. -1 links match no node.
    step = (retrieve_next_sibling.unsqueeze(2) == node).float()  # [batch, N, N]
    reach = step + torch.eye(n, device=node.device)
    for _ in range(max(n - 2, 0).bit_length()):  # chains are at most N - 1 nodes long
        reach = torch.bmm(reach, reach).clamp_(max=1)
    first_child = (retrieve_next_token.unsqueeze(2) == node).float()  # [batch, parent, child]
    children = torch.bmm(first_child, reach) > 0  # [batch, parent, node]
    linked = children.any(dim=1)  # [batch, N]
    parent = torch.where(linked, children.to(torch.uint8).argmax(dim=1), -1)
    # Siblings that reach a node: the ones before it in its parent's links, and itself.
    rank = torch.where(linked, reach.sum(dim=1).long() - 1, -1)
    return TreeTopology(parent, rank, children)


def accepted_path_stats(
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    top_scores_index: torch.Tensor,
    topk: int,
) -> AcceptedPathStats:
    """Per depth: children offered along the accepted path and the rank the target took.

    Inputs are the verify outputs (``accept_index`` ``[batch, steps + 1]`` with the flat node
    indices ``b * N + i`` of the path, ``accept_token_num`` ``[batch]``) and the tree they were
    verified on (links ``[batch, N]``, ``top_scores_index`` ``[batch, N - 1]``). See
    ``core.acceptance.AcceptedPathStats`` for the meaning of the outputs.
    """
    batch, n = retrieve_next_token.shape
    assert accept_index.dim() == 2 and accept_index.shape[0] == batch, accept_index.shape
    assert accept_token_num.shape == (batch,) and top_scores_index.shape == (batch, n - 1)
    steps = accept_index.shape[1] - 1
    device = accept_index.device
    depth = torch.arange(steps + 1, device=device)
    on_path = depth <= accept_token_num.long().unsqueeze(1)  # [batch, steps + 1]
    path = torch.where(on_path, accept_index.long() % n, 0)  # [batch, steps + 1] node ids

    children = tree_topology(retrieve_next_token, retrieve_next_sibling).children
    num_children = children.sum(dim=2)  # [batch, N]
    per_depth = torch.where(on_path, num_children.gather(1, path), 0)[:, :steps]

    rank = top_scores_index.long() % topk  # [batch, n - 1] rank of node i + 1
    child = path[:, 1:]  # [batch, steps] node accepted at depth d + 1
    accepted_rank = rank.gather(1, (child - 1).clamp(min=0))
    accepted_rank = torch.where(on_path[:, 1:], accepted_rank, -1)
    return AcceptedPathStats(per_depth, accepted_rank)
