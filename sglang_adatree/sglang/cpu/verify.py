"""Verification of a draft tree against the target: greedy and distribution-preserving.

Pure-torch stand-ins for SGLang 0.5.23's ``verify_tree_greedy`` and
``tree_speculative_sampling_target_only`` kernels: same arguments (the output buffers are
filled in place, as the kernels do), same dtypes, same results. Vectorised: every node's
accept test is computed at once, then the accepted path is followed one depth level at a time.

Glossary (one request; nodes, links and flat indices ``b * N + i`` as in ``tree.py``):

* accepted tokens: draft nodes on the accepted path below the root; ``accept_token_num``.
* accept_index ``[batch, steps + 1]``: flat indices of root, 1st, 2nd, ... accepted node;
  cells past the path keep what the caller put there (SGLang fills -1).
* predicts ``[batch * N]``: at the flat index of each path node, the token that follows it:
  the next accepted draft token, and after the last path node the bonus token (greedy: the
  target's argmax there; sampling: a sample of the target's residual distribution). Other
  cells keep what the caller put there.
* emitted tokens = accepted tokens + 1 bonus.

Greedy: a child is accepted when its token equals the target's argmax after its parent; the
walk takes the first such child in link order at each level (siblings hold distinct tokens, so
this is the longest root-to-leaf prefix that the target agrees with).

Sampling (``threshold_single = threshold_acc = 1``; SpecInfer's multi-draft speculative
sampling with a target-only proposal): at a node with target distribution ``q`` and a coin
``u``, child ``c_k`` (in link order) is accepted when ``u < q(c_1) + ... + q(c_k)``. That is
``u`` landing in ``c_k``'s slice of ``q``: child ``c_k`` is accepted with probability
``q(c_k)``, the same as accepting it with probability ``q_res(c_k)`` after rejecting
``c_1 .. c_{k-1}`` and renormalising. When every child is rejected, the bonus token is drawn
from ``q`` with the rejected children zeroed (renormalised). So every emitted token follows the
target distribution exactly. Thresholds below 1 accept more (lossy), as SGLang's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_adatree.sglang.tree import TreeTopology, tree_topology


@dataclass(frozen=True)
class VerifyResult:
    """The three output buffers of a verify kernel, after it ran (same tensors, not copies)."""

    predicts: torch.Tensor  # [batch * N] int32
    accept_index: torch.Tensor  # [batch, steps + 1] int32
    accept_token_num: torch.Tensor  # [batch] int32: accepted draft tokens (not the bonus)


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> VerifyResult:
    """Greedy tree verification, equivalent to SGLang's ``verify_tree_greedy_func``.

    ``candidates`` ``[batch, N]`` int64 are the node tokens (root first),
    ``target_predict`` ``[batch, N]`` int64 the target's argmax after each node.
    """
    batch, n = _check_verify_args(
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrieve_index,
        retrieve_next_token,
        retrieve_next_sibling,
    )
    assert target_predict.shape == (batch, n) and target_predict.dtype == torch.int64
    if batch == 0:
        return VerifyResult(predicts, accept_index, accept_token_num)
    if n == 1:
        # A one-node tree (a step without speculation): the root is the whole path and its
        # predict the target's token, with none of the walk's per-level work.
        root = retrieve_index[:, 0]  # [batch] flat index of each root
        predicts[root] = target_predict.reshape(-1)[root].to(predicts.dtype)
        accept_index[:, 0] = root.to(accept_index.dtype)
        accept_token_num.zero_()
        return VerifyResult(predicts, accept_index, accept_token_num)
    topo = tree_topology(retrieve_next_token, retrieve_next_sibling)
    target_flat = target_predict.reshape(-1)  # [batch * N], by flat node index
    parent_flat = retrieve_index.gather(1, topo.parent.clamp(min=0))  # [batch, N]
    passes = (topo.parent >= 0) & (candidates == target_flat[parent_flat])
    path = _accepted_path(topo, passes, accept_index.shape[1])  # [batch, steps + 1]
    path_flat = retrieve_index.gather(1, path)
    num_accepted = (path[:, 1:] != path[:, :-1]).sum(dim=1)
    # Every path node's predict is the target's own token there: the accepted child's token
    # (equal to it) or the bonus token.
    predicts[path_flat.flatten()] = target_flat[path_flat.flatten()].to(predicts.dtype)
    _write_path(accept_index, accept_token_num, path_flat, num_accepted)
    return VerifyResult(predicts, accept_index, accept_token_num)


def verify_tree_sampling(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,
    uniform_samples_for_final_sampling: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> VerifyResult:
    """Tree speculative sampling, equivalent to SGLang's ``tree_speculative_sampling_target_only``.

    ``uniform_samples`` ``[batch, N]`` float32: the coin used at each node for its children;
    ``uniform_samples_for_final_sampling`` ``[batch]``: the coin for the bonus token;
    ``target_probs`` ``[batch, N, vocab]`` float32 (see ``target_probs_from_logits``);
    ``draft_probs`` ``[batch, N, vocab]``: SGLang passes zeros. Like the kernel, this function
    uses ``draft_probs`` as scratch: rejected children's target probabilities are written
    there, and the bonus token is drawn from ``relu(target_probs - draft_probs)`` at the last
    path node (from ``target_probs`` alone when the path reached full depth).

    Same decisions as the kernel for the same coins, except that running sums may round
    differently in the last bit (torch's CPU cumsum accumulates in double, the kernel in float
    and, over the vocabulary, by block reduction): a coin within one rounding step of a
    boundary can fall the other way.
    """
    batch, n = _check_verify_args(
        predicts,
        accept_index,
        accept_token_num,
        candidates,
        retrieve_index,
        retrieve_next_token,
        retrieve_next_sibling,
    )
    assert target_probs.dim() == 3 and target_probs.shape[:2] == (batch, n), target_probs.shape
    assert draft_probs.shape == target_probs.shape and target_probs.dtype == torch.float32
    assert uniform_samples.shape == (batch, n) and uniform_samples.dtype == torch.float32
    assert uniform_samples_for_final_sampling.shape == (batch,)
    assert 0.0 <= threshold_single <= 1.0 and 0.0 <= threshold_acc <= 1.0
    if batch == 0:
        return VerifyResult(predicts, accept_index, accept_token_num)
    vocab = target_probs.shape[2]
    topo = tree_topology(retrieve_next_token, retrieve_next_sibling)
    linked = topo.parent >= 0  # [batch, N]
    parent = topo.parent.clamp(min=0)
    # q(child) under its parent's target distribution, as a flat index into [N * vocab].
    cell = parent * vocab + candidates  # [batch, N]
    prob = target_probs.reshape(batch, n * vocab).gather(1, cell)  # [batch, N]
    # Running sum of q over the siblings up to and including each child, in link order.
    slot = torch.where(linked, parent * n + topo.sibling_rank, n * n)  # [batch, N]
    by_parent = torch.zeros(batch, n * n + 1, dtype=prob.dtype, device=prob.device)
    by_parent.scatter_(1, slot, prob)
    cum = by_parent[:, : n * n].view(batch, n, n).cumsum(dim=2).view(batch, n * n)
    cum = torch.cat((cum, cum.new_zeros(batch, 1)), dim=1).gather(1, slot)
    coin = uniform_samples.gather(1, parent)
    # The kernel clamps threshold_acc to 1e-9 to keep the division finite.
    accept = (coin < cum / max(threshold_acc, 1e-9)) | (prob >= threshold_single)
    passes = linked & (prob > 0) & accept
    steps_plus_one = accept_index.shape[1]
    path = _accepted_path(topo, passes, steps_plus_one)
    num_accepted = (path[:, 1:] != path[:, :-1]).sum(dim=1)  # [batch]

    _record_rejections(draft_probs, topo, path, cell, prob)
    last = path[:, -1]  # [batch]
    row = torch.arange(batch, device=last.device) * n + last  # [batch] node rows of the probs
    # No draft probabilities for the bonus token after a full-depth path. In place: both
    # selections are fresh copies of vocabulary-sized rows.
    full_depth = (num_accepted == steps_plus_one - 1).unsqueeze(1)
    subtract = draft_probs.view(batch * n, vocab).index_select(0, row)  # [batch, vocab]
    residual = target_probs.view(batch * n, vocab).index_select(0, row)  # [batch, vocab]
    residual = residual.sub_(subtract.masked_fill_(full_depth, 0.0)).clamp_(min=0)
    bonus = _sample_inverse_cdf(residual, uniform_samples_for_final_sampling)

    # Path node k predicts path node k + 1's token; the last path node (repeated to the end of
    # `path`) predicts the bonus token.
    next_token = candidates.gather(1, path[:, 1:])  # [batch, steps]
    depth = torch.arange(steps_plus_one - 1, device=path.device)
    follow = torch.where(depth < num_accepted.unsqueeze(1), next_token, bonus.unsqueeze(1))
    follow = torch.cat((follow, bonus.unsqueeze(1)), dim=1)  # [batch, steps + 1]
    path_flat = retrieve_index.gather(1, path)
    predicts[path_flat.flatten()] = follow.flatten().to(predicts.dtype)
    _write_path(accept_index, accept_token_num, path_flat, num_accepted)
    return VerifyResult(predicts, accept_index, accept_token_num)


def target_probs_from_logits(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor | None,
    top_ps: torch.Tensor | None,
    num_draft_tokens: int,
) -> torch.Tensor:
    """Target probabilities per node with each request's temperature, top-k and top-p.

    ``logits`` ``[batch * N, vocab]`` (the verify forward's rows), ``temperatures`` ``[batch]``
    or ``[batch, 1]`` (> 0; SGLang gives greedy rows top-k 1), ``top_ks`` / ``top_ps``
    ``[batch]``, or None to skip that filter for the whole batch (SGLang skips it unless some
    request needs it). The same steps as SGLang's sampling verify: softmax of
    ``logits / temperature``, then ``top_k_renorm_prob``, then ``top_p_renorm_prob``.
    Returns ``[batch, N, vocab]`` float32.
    """
    rows, vocab = logits.shape
    assert rows % num_draft_tokens == 0, (logits.shape, num_draft_tokens)
    batch = rows // num_draft_tokens
    per_row = temperatures.reshape(batch, 1).repeat_interleave(num_draft_tokens, dim=0)
    probs = torch.softmax(logits.float() / per_row, dim=-1)  # [batch * N, vocab]
    if top_ks is not None:
        assert top_ks.shape == (batch,), top_ks.shape
        probs = top_k_renorm_prob(probs, top_ks.repeat_interleave(num_draft_tokens))
    if top_ps is not None:
        assert top_ps.shape == (batch,), top_ps.shape
        probs = top_p_renorm_prob(probs, top_ps.repeat_interleave(num_draft_tokens))
    return probs.view(batch, num_draft_tokens, vocab)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest probabilities and renormalise (FlashInfer semantics).

    ``probs`` ``[rows, vocab]``; ``top_k`` ``[rows]`` or one int, clamped to ``[1, vocab]``
    (SGLang writes "no top-k" as a huge k). Ties at the k-th largest value are all kept.
    """
    assert probs.dim() == 2, probs.shape
    rows, vocab = probs.shape
    probs = probs.float()
    k = torch.as_tensor(top_k, device=probs.device).long().expand(rows).clamp(1, vocab)
    limited = k < vocab  # [rows]; the others keep everything
    # Host reads of k decide how much to sort: these stand-ins run on CPU tensors, where a
    # full sort of the vocabulary costs as much as a small model's forward.
    if not bool(limited.any()):
        return _renormalise(probs)
    largest = torch.topk(probs, int(k[limited].max()), dim=-1).values  # [rows, max k]
    pivot = largest.gather(1, (k.clamp(max=largest.shape[1]) - 1).unsqueeze(1))  # [rows, 1]
    pivot = torch.where(limited.unsqueeze(1), pivot, 0.0)
    return _renormalise(probs.masked_fill(probs < pivot, 0.0))


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep each row's top-p nucleus and renormalise (FlashInfer semantics).

    ``probs`` ``[rows, vocab]``; ``top_p`` ``[rows]`` or one float in ``(0, 1]``. FlashInfer's
    rule: sorted ascending, the prefix whose mass is below ``1 - top_p`` is dropped and every
    probability at least the first one kept stays (ties included).

    Seen from the top, that pivot is the ``(m + 1)``-th largest probability, where ``m`` is the
    last rank whose preceding mass (the sum of the ``m`` largest) is at most
    ``total - (1 - top_p)``. The nucleus is usually small, so only the largest
    ``_NUCLEUS_GUESS`` are sorted; rows whose nucleus is larger are sorted in full.
    """
    assert probs.dim() == 2, probs.shape
    rows, vocab = probs.shape
    probs = probs.float()
    p = torch.as_tensor(top_p, device=probs.device).float().expand(rows)
    pivot = torch.zeros(rows, 1, device=probs.device)  # 0 keeps everything (top_p 1)
    pending = torch.nonzero(p < 1).flatten()  # rows still without their pivot
    width = min(vocab, _NUCLEUS_GUESS)
    while pending.numel() > 0:  # at most twice: the guess, then a full sort
        part = probs[pending]  # [pending, vocab]
        top = torch.topk(part, width, dim=-1).values  # [pending, width], descending
        before = top.cumsum(dim=-1) - top  # mass of the larger probabilities
        room = part.sum(dim=-1, keepdim=True) - (1 - p[pending].unsqueeze(1))
        rank = (before <= room).sum(dim=-1, keepdim=True).clamp(min=1)  # m + 1
        settled = ((rank < width) | (width == vocab)).flatten()
        pivot[pending[settled]] = top.gather(1, rank - 1)[settled]
        pending, width = pending[~settled], vocab
    return _renormalise(probs.masked_fill(probs < pivot, 0.0))


# Largest probabilities sorted first when looking for a top-p nucleus (see top_p_renorm_prob).
_NUCLEUS_GUESS = 256


def _renormalise(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(dim=-1, keepdim=True)


def _check_verify_args(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
) -> tuple[int, int]:
    """The kernels' tensor contracts; returns ``(batch, N)``."""
    batch, n = candidates.shape
    for name, t in (
        ("candidates", candidates),
        ("retrieve_index", retrieve_index),
        ("retrieve_next_token", retrieve_next_token),
        ("retrieve_next_sibling", retrieve_next_sibling),
    ):
        assert t.shape == (batch, n) and t.dtype == torch.int64, (name, t.shape, t.dtype)
    assert predicts.shape == (batch * n,) and predicts.dtype == torch.int32, predicts.shape
    assert accept_index.dim() == 2 and accept_index.shape[0] == batch, accept_index.shape
    assert accept_index.shape[1] >= 1 and accept_index.dtype == torch.int32
    assert accept_token_num.shape == (batch,) and accept_token_num.dtype == torch.int32
    return batch, n


def _accepted_path(topo: TreeTopology, passes: torch.Tensor, length: int) -> torch.Tensor:
    """Node at each depth of the accepted path; after its end the last node repeats.

    At each node the accepted child is the first child (in link order) that passes its test.
    Returns ``[batch, length]`` node ids; ``length`` is ``steps + 1`` (root included).
    """
    batch, n = passes.shape
    node = torch.arange(n, device=passes.device)
    # Among each parent's passing children, the smallest (rank, node) key wins; the node id
    # part decodes the winner.
    key = topo.sibling_rank * n + node  # [batch, N]
    none = n * n  # past every key
    eligible = topo.children & passes.unsqueeze(1)  # [batch, parent, child]
    best = torch.where(eligible, key.unsqueeze(1), none).amin(dim=2)  # [batch, N]
    # A parent without an accepted child points at itself, so the walk stays there.
    accepted_child = torch.where(best == none, node, best % n)  # [batch, N]
    path = [torch.zeros(batch, 1, dtype=torch.long, device=passes.device)]
    for _ in range(length - 1):
        path.append(accepted_child.gather(1, path[-1]))
    return torch.cat(path, dim=1)


def _write_path(
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    path_flat: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Write the path's flat indices up to its end; later cells keep the caller's values."""
    depth = torch.arange(path_flat.shape[1], device=path_flat.device)
    on_path = depth <= num_accepted.unsqueeze(1)  # [batch, steps + 1]
    accept_index.copy_(torch.where(on_path, path_flat.to(accept_index.dtype), accept_index))
    accept_token_num.copy_(num_accepted)


def _record_rejections(
    draft_probs: torch.Tensor,
    topo: TreeTopology,
    path: torch.Tensor,
    cell: torch.Tensor,
    prob: torch.Tensor,
) -> None:
    """Copy each rejected child's target probability into ``draft_probs``, as the kernel does.

    The children of a path node tried before the walk moved on are those ranked before its
    accepted child, or all of them when none passed; a full-depth path's last node is never
    expanded.
    """
    batch, n = path.shape[0], topo.parent.shape[1]
    expanded_nodes = path[:, :-1]  # [batch, steps]: nodes whose children were tried
    successor = path[:, 1:]
    moved = successor != expanded_nodes
    expanded = torch.zeros(batch, n, dtype=torch.bool, device=path.device)
    expanded.scatter_(1, expanded_nodes, True)
    # Rank of each expanded node's accepted child, n (past every rank) when none was accepted.
    # A node moves on at most once, and its repeats at the end of the path all write n.
    accepted_rank = torch.full((batch, n), n, dtype=torch.long, device=path.device)
    accepted_rank.scatter_(
        1, expanded_nodes, torch.where(moved, topo.sibling_rank.gather(1, successor), n)
    )
    parent = topo.parent.clamp(min=0)
    rejected = (
        (topo.parent >= 0)
        & expanded.gather(1, parent)
        & (topo.sibling_rank < accepted_rank.gather(1, parent))
    )  # [batch, N]
    rows = torch.arange(batch, device=path.device).unsqueeze(1).expand(batch, n)
    draft_probs.view(batch, -1)[rows[rejected], cell[rejected]] = prob[rejected]


def _sample_inverse_cdf(weights: torch.Tensor, coin: torch.Tensor) -> torch.Tensor:
    """First index whose running sum of ``weights`` exceeds ``coin * sum``, as FlashInfer.

    When rounding leaves the coin at or past the total, the last positive index wins; with no
    positive weight, the last index (both as the CUDA kernel).
    """
    vocab = weights.shape[1]
    running = weights.cumsum(dim=1)  # [batch, vocab], non-decreasing
    threshold = coin.float().unsqueeze(1) * running[:, -1:]  # [batch, 1]
    index = torch.searchsorted(running, threshold, right=True).squeeze(1)  # [batch]
    past_end = index == vocab
    if bool(past_end.any()):  # rare; a host read, as these stand-ins run on CPU tensors
        position = torch.arange(vocab, device=weights.device)
        last_positive = torch.where(weights > 0, position, -1).amax(dim=1)
        fallback = torch.where(last_positive >= 0, last_positive, vocab - 1)
        index = torch.where(past_end, fallback, index)
    return index
