"""A step without speculation on a CPU, run as the target's plain decode forward.

SGLang's speculative worker serves a step without drafting as a one-token target verify: it
builds a one-node verify input, runs the target in ``TARGET_VERIFY`` mode and goes through the
tree sampler and the verify bookkeeping for a tree of one node. The result is a plain decode's,
but on a CPU, with no graphs to amortise it, that walk is serial host work on every such step
that ``ar``'s decode does not do. Here the same step is the decode ``ar`` runs: the
request's pending token (the last step's bonus token) at the slot SGLang reserved for it, the
target in ``DECODE`` mode, the greedy token by argmax. The result object is the one SGLang's
verify returns for a one-node tree (every request accepts its root and emits one token), so
the scheduler's result processing is unchanged.

Only for what the shortcut reproduces exactly: a CPU (on a GPU the target's graphs are captured
for the verify), greedy sampling, no logprobs, grammar, penalties, logit bias or watermark, no
data-parallel attention (its padding is planned for the verify), and a step that skips the
draft's extend (a draft extend needs the verify's hidden states). Everything else takes
SGLang's path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
)
from sglang.srt.speculative.eagle_info import EagleDraftInput


def runs_as_plain_decode(batch: Any, target_worker: Any) -> bool:
    """Whether ``batch``'s step without speculation can be the target's plain decode."""
    spec = batch.spec_info
    if not isinstance(spec, EagleDraftInput) or spec.bonus_tokens is None:
        return False
    if batch.forward_mode.is_idle() or batch.return_logprob or batch.has_grammar:
        return False
    info = batch.sampling_info
    if info is None or not info.is_all_greedy:
        return False
    if (
        info.acc_additive_penalties is not None
        or info.acc_scaling_penalties is not None
        or info.logit_bias is not None
    ):
        return False
    if getattr(batch, "hisparse_coordinator", None) is not None:
        return False
    if getattr(batch, "mamba_track_indices", None) is not None:
        return False
    if getattr(batch, "global_num_tokens", None) is not None:  # data-parallel attention
        return False
    return getattr(target_worker.model_runner, "watermark_state", None) is None


def plain_decode_step(
    batch: Any,
    target_worker: Any,
    req_to_token: torch.Tensor,  # [max_reqs, max_context_len] int32 KV slots
    on_publish: Callable[[torch.Tensor], None] | None = None,
) -> GenerationBatchResult:
    """One step without speculation for ``batch`` (``runs_as_plain_decode`` holds) as the
    target's decode forward, returned as SGLang's verify of a one-node tree returns it.

    Edits ``batch``'s fields the way SGLang's verify does; the scheduler restores them after
    the forward and carries ``next_draft_input`` and ``new_seq_lens`` to the next step."""
    seq_lens = batch.seq_lens  # [batch] committed lengths, the pending token excluded
    bs = seq_lens.shape[0]
    bonus = batch.spec_info.bonus_tokens  # [batch] each request's pending token
    # The slot SGLang reserved for the pending token, the one its one-node verify writes.
    batch.out_cache_loc = req_to_token[batch.req_pool_indices.long(), seq_lens.long()].to(
        torch.int64
    )  # [batch]
    batch.input_ids = bonus
    # A decode forward counts the token it writes in the request's length.
    batch.seq_lens = seq_lens + 1
    if batch.seq_lens_cpu is not None:
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    elif batch.seq_lens_sum is not None:
        batch.seq_lens_sum += bs
    batch.forward_mode = ForwardMode.DECODE
    batch.spec_info = None
    forward_batch = ForwardBatch.init_new(
        batch,
        target_worker.model_runner,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        return_hidden_states_before_norm=False,
    )
    output = target_worker.forward_batch_generation(
        batch=None, forward_batch=forward_batch, is_verify=True
    )
    logits = output.logits_output
    predict = torch.argmax(logits.next_token_logits, dim=-1).to(torch.int32)  # [batch]
    new_seq_lens = seq_lens + 1  # [batch]
    accept_lens = torch.ones(bs, dtype=torch.int32, device=seq_lens.device)  # [batch]: the root
    accept_index = torch.arange(bs, dtype=torch.int32, device=seq_lens.device)  # [batch]
    if on_publish is not None:
        on_publish(new_seq_lens)
    return GenerationBatchResult(
        logits_output=logits,
        next_token_ids=predict,
        can_run_cuda_graph=output.can_run_cuda_graph,
        speculative_num_draft_tokens=1,
        next_draft_input=EagleDraftInput(bonus_tokens=predict),
        accept_lens=accept_lens,
        accept_index=accept_index.unsqueeze(1),  # [batch, 1]: each request's root node
        new_seq_lens=new_seq_lens,
        routed_experts_output=output.routed_experts_output,
        indexer_topk_output=output.indexer_topk_output,
        extra_keep_alive_refs=[forward_batch],
    )
