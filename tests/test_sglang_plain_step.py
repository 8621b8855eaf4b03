"""The step without speculation as a plain decode, on stand-ins for SGLang's batch and worker.

The server end to end (greedy output token for token equal to SGLang's non-speculative server
while plain decodes run, sampled requests on SGLang's path) is ``test_e2e_plugin.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.eagle_info import EagleDraftInput

from sglang_adatree.sglang import plain_step
from sglang_adatree.sglang.plain_step import plain_decode_step, runs_as_plain_decode

VOCAB = 11


def _sampling(**overrides):
    values = {
        "is_all_greedy": True,
        "acc_additive_penalties": None,
        "acc_scaling_penalties": None,
        "logit_bias": None,
    }
    return SimpleNamespace(**{**values, **overrides})


def _batch(**overrides):
    values = {
        "spec_info": EagleDraftInput(bonus_tokens=torch.tensor([5, 7], dtype=torch.int32)),
        "forward_mode": ForwardMode.DECODE,
        "return_logprob": False,
        "has_grammar": False,
        "sampling_info": _sampling(),
        "hisparse_coordinator": None,
        "mamba_track_indices": None,
        "global_num_tokens": None,
        "seq_lens": torch.tensor([3, 5]),
        "seq_lens_cpu": torch.tensor([3, 5]),
        "seq_lens_sum": 8,
        "req_pool_indices": torch.tensor([1, 0]),
        "input_ids": None,
        "out_cache_loc": None,
    }
    return SimpleNamespace(**{**values, **overrides})


def _worker(logits=None, watermark=None):
    seen = {}

    def forward_batch_generation(batch=None, forward_batch=None, is_verify=False):
        seen["forward_batch"] = forward_batch
        seen["is_verify"] = is_verify
        return SimpleNamespace(
            logits_output=SimpleNamespace(next_token_logits=logits),
            can_run_cuda_graph=False,
            routed_experts_output=None,
            indexer_topk_output=None,
        )

    runner = SimpleNamespace(watermark_state=watermark)
    worker = SimpleNamespace(model_runner=runner, forward_batch_generation=forward_batch_generation)
    return worker, seen


def test_a_greedy_plain_batch_runs_as_a_plain_decode():
    worker, _ = _worker()
    assert runs_as_plain_decode(_batch(), worker)


@pytest.mark.parametrize(
    "overrides",
    [
        {"spec_info": None},
        {"spec_info": EagleDraftInput()},  # no pending tokens
        {"spec_info": SimpleNamespace(bonus_tokens=torch.tensor([1]))},  # not a draft input
        {"forward_mode": ForwardMode.IDLE},
        {"return_logprob": True},
        {"has_grammar": True},
        {"sampling_info": None},
        {"sampling_info": _sampling(is_all_greedy=False)},
        {"sampling_info": _sampling(acc_additive_penalties=torch.zeros(2, VOCAB))},
        {"sampling_info": _sampling(acc_scaling_penalties=torch.ones(2, VOCAB))},
        {"sampling_info": _sampling(logit_bias=torch.zeros(2, VOCAB))},
        {"hisparse_coordinator": object()},
        {"mamba_track_indices": torch.tensor([0, 1])},
        {"global_num_tokens": [2, 2]},
    ],
)
def test_anything_the_shortcut_does_not_reproduce_takes_sglangs_path(overrides):
    worker, _ = _worker()
    assert not runs_as_plain_decode(_batch(**overrides), worker)


def test_a_watermark_takes_sglangs_path():
    worker, _ = _worker(watermark=object())
    assert not runs_as_plain_decode(_batch(), worker)


def test_the_plain_decode_writes_the_reserved_slot_and_returns_a_one_node_verify(monkeypatch):
    # [max_reqs, max_context_len] slots: request pool row 1 has its pending token's slot at
    # column 3 (its committed length), row 0 at column 5.
    req_to_token = torch.arange(2 * 8, dtype=torch.int32).reshape(2, 8) + 100
    logits = torch.zeros(2, VOCAB)
    logits[0, 4] = 1.0
    logits[1, 9] = 1.0
    worker, seen = _worker(logits)
    at_forward = {}

    def init_new(batch, runner, capture_hidden_mode, return_hidden_states_before_norm):
        at_forward.update(
            mode=batch.forward_mode,
            input_ids=batch.input_ids.tolist(),
            out_cache_loc=batch.out_cache_loc.tolist(),
            seq_lens=batch.seq_lens.tolist(),
            seq_lens_cpu=batch.seq_lens_cpu.tolist(),
            seq_lens_sum=batch.seq_lens_sum,
            spec_info=batch.spec_info,
        )
        return "forward batch"

    monkeypatch.setattr(plain_step.ForwardBatch, "init_new", staticmethod(init_new))
    published = []
    batch = _batch()
    result = plain_decode_step(batch, worker, req_to_token, published.append)

    assert at_forward == {
        "mode": ForwardMode.DECODE,
        "input_ids": [5, 7],
        "out_cache_loc": [100 + 8 + 3, 100 + 5],
        "seq_lens": [4, 6],  # a decode counts the token it writes
        "seq_lens_cpu": [4, 6],
        "seq_lens_sum": 10,
        "spec_info": None,
    }
    assert seen == {"forward_batch": "forward batch", "is_verify": True}
    assert result.next_token_ids.tolist() == [4, 9]
    assert result.next_draft_input.bonus_tokens.tolist() == [4, 9]
    assert result.accept_lens.tolist() == [1, 1]
    assert result.accept_index.tolist() == [[0], [1]]
    assert result.new_seq_lens.tolist() == [4, 6]
    assert result.speculative_num_draft_tokens == 1
    assert [t.tolist() for t in published] == [[4, 6]]
