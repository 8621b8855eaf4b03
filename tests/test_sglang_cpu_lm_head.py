"""The CPU path's lm_head product: the same logits as SGLang's, taken over only where its
plain fp32 product of 1-4 rows (1-48 with two or more threads) would run; one row over a
transposed copy of the weight that every SGLang weight update drops."""

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

from sglang_adatree.sglang.cpu import hooks as cpu
from sglang_adatree.sglang.cpu import weights as cpu_weights
from sglang_adatree.sglang.cpu.hooks import (
    LM_HEAD_MAX_ROWS_ONE_THREAD,
    LM_HEAD_MAX_ROWS_THREADED,
    LM_HEAD_MIN_VOCAB,
    WEIGHT_UPDATES,
    _lm_head,
    _weights_updated,
    lm_head_logits,
    lm_head_max_rows,
)
from sglang_adatree.sglang.cpu.weights import transposed_weight


@pytest.fixture
def threads():
    """Set torch's thread count for one test and restore it afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


class _Head(torch.nn.Module):
    """An unquantised lm_head as the logits processor sees it: a weight [vocab, hidden]."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dtype) / hidden**0.5)
        self.quant_method = None


def _processor(**overrides):
    """The two LogitsProcessor settings the plain product depends on."""
    return SimpleNamespace(**{"use_fp32_lm_head": False, "rl_on_policy_target": None, **overrides})


def _counting_original():
    from sglang.srt.layers.logits_processor import LogitsProcessor

    real = LogitsProcessor._compute_lm_head
    calls = []

    def original(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return real(self, *args, **kwargs)

    original.__signature__ = inspect.signature(real)
    return original, calls


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 48])
def test_lm_head_logits_is_the_plain_product(rows):
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 64, generator=g)
    weight = torch.randn(5000, 64, generator=g)
    out = lm_head_logits(hidden, weight)
    assert out.shape == (rows, 5000) and out.is_contiguous()
    torch.testing.assert_close(out, hidden @ weight.T, rtol=1e-5, atol=1e-4)


def test_more_rows_are_taken_over_with_two_or_more_threads(threads):
    threads(1)
    assert lm_head_max_rows() == LM_HEAD_MAX_ROWS_ONE_THREAD == 4
    threads(2)
    assert lm_head_max_rows() == LM_HEAD_MAX_ROWS_THREADED == 48


@pytest.mark.parametrize(
    ("rows", "num_threads"), [(1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (8, 2), (48, 2)]
)
def test_the_hook_takes_over_fp32_products_up_to_the_row_limit(rows, num_threads, threads):
    threads(num_threads)
    torch.manual_seed(0)
    head = _Head(LM_HEAD_MIN_VOCAB + 8, 32)
    hidden = torch.randn(rows, 32)
    original, calls = _counting_original()
    got = _lm_head(original, _processor(), hidden, head)
    assert calls == []  # computed by the hook
    want = original(_processor(), hidden, head)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize(
    ("rows", "num_threads", "vocab", "dtype", "processor"),
    [
        (5, 1, LM_HEAD_MIN_VOCAB, torch.float32, {}),  # one thread: slower past 5 rows
        (49, 2, LM_HEAD_MIN_VOCAB, torch.float32, {}),  # past the limit
        (2, 1, LM_HEAD_MIN_VOCAB - 1, torch.float32, {}),  # a small vocabulary
        (2, 1, LM_HEAD_MIN_VOCAB, torch.bfloat16, {}),  # another precision
        (2, 1, LM_HEAD_MIN_VOCAB, torch.float32, {"use_fp32_lm_head": True}),
    ],
)
def test_everything_else_goes_to_sglang(rows, num_threads, vocab, dtype, processor, threads):
    threads(num_threads)
    head = _Head(vocab, 16, dtype)
    hidden = torch.randn(rows, 16, dtype=dtype)
    original, calls = _counting_original()
    _lm_head(original, _processor(**processor), hidden, head)
    assert calls == [rows]


def test_a_lora_head_goes_to_sglang():
    original, calls = _counting_original()
    lora = _Head(LM_HEAD_MIN_VOCAB, 16)
    lora.set_lora = lora.apply_lora = lambda *a, **k: None
    lora.forward = lambda x: x @ lora.weight.T
    _lm_head(original, _processor(), torch.randn(2, 16), lora)
    assert calls == [2]


def test_one_row_reads_a_transposed_copy_made_once_per_weight():
    weight = torch.randn(LM_HEAD_MIN_VOCAB, 32)
    first = transposed_weight(weight)
    assert first.shape == (32, LM_HEAD_MIN_VOCAB) and first.is_contiguous()
    assert transposed_weight(weight) is first  # kept, not remade per call
    other = torch.randn(LM_HEAD_MIN_VOCAB, 32)
    assert transposed_weight(other) is not first
    hidden = torch.randn(1, 32)
    torch.testing.assert_close(lm_head_logits(hidden, weight), hidden @ weight.T)


def test_a_freed_weight_takes_its_copy_with_it():
    weight = torch.randn(LM_HEAD_MIN_VOCAB, 8)
    transposed_weight(weight)
    key = id(weight)
    assert key in cpu_weights._TRANSPOSED
    del weight
    assert key not in cpu_weights._TRANSPOSED


def test_a_weight_update_drops_the_copies_so_new_weights_are_read():
    head = _Head(LM_HEAD_MIN_VOCAB, 16)
    hidden = torch.randn(1, 16)
    original, _ = _counting_original()
    before = _lm_head(original, _processor(), hidden, head)
    new_weights = torch.randn_like(head.weight)

    def update_weights(self, *args, **kwargs):  # as SGLang loads: in place, no version bump
        head.weight.data.copy_(new_weights)
        return True, "ok"

    assert _weights_updated(update_weights, object()) == (True, "ok")
    after = _lm_head(original, _processor(), hidden, head)
    torch.testing.assert_close(after, hidden @ new_weights.T, rtol=1e-5, atol=1e-4)
    assert not torch.allclose(after, before)


def test_a_failed_weight_update_drops_the_copies_too():
    weight = torch.randn(LM_HEAD_MIN_VOCAB, 8)
    first = transposed_weight(weight)

    def update_weights(self):
        weight.data.mul_(2.0)  # part of the weights written, then a failure
        raise RuntimeError("load failed")

    with pytest.raises(RuntimeError):
        _weights_updated(update_weights, object())
    assert transposed_weight(weight) is not first


def test_every_sglang_method_that_writes_weights_is_hooked():
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    # Group set-up and the start of a bucketed update write no weights; anything else public
    # that names weights does, and must drop the transposed copies.
    not_writing = {
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
    }
    public = {
        name
        for name, _ in inspect.getmembers(WeightUpdater, inspect.isfunction)
        if not name.startswith("_") and "weight" in name
    }
    assert public - not_writing == set(WEIGHT_UPDATES)
    hooked = {target: hook for target, hook in cpu._HOOKS}
    for name in WEIGHT_UPDATES:
        target = f"{WeightUpdater.__module__}.WeightUpdater.{name}"
        assert hooked[target] is _weights_updated
        module, cls, attr = target.rsplit(".", 2)
        assert callable(getattr(getattr(importlib.import_module(module), cls), attr))
