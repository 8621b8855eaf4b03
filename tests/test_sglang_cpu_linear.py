"""The CPU path's linear products: SGLang's ``F.linear`` result through oneDNN with a packed copy
of the weight, taken over only for fp32 CPU products of 2-128 rows while the copies fit their
budget; copies made once per weight, dropped with it and on every SGLang weight update."""

import logging

import pytest
import torch
import torch.nn.functional as F
from sglang.srt.batch_invariant_ops import batch_invariant_ops
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

from sglang_adatree.sglang.cpu import hooks as cpu
from sglang_adatree.sglang.cpu import weights as cpu_weights
from sglang_adatree.sglang.cpu.hooks import LINEAR_ROWS, _linear, _weights_updated
from sglang_adatree.sglang.cpu.weights import (
    PACKED_LINEAR_BUDGET_ENV,
    forget_weight_copies,
    packed_linear_budget_bytes,
    packed_linear_bytes,
    packed_linear_weight,
)


@pytest.fixture(autouse=True)
def _fresh_copies(monkeypatch):
    monkeypatch.delenv(PACKED_LINEAR_BUDGET_ENV, raising=False)
    forget_weight_copies()
    yield
    forget_weight_copies()


class _Layer(torch.nn.Module):
    """A linear layer as SGLang's ``UnquantizedLinearMethod`` sees it: weight [out, in]."""

    def __init__(self, out: int, inp: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(out * 1000 + inp)
        w = torch.randn(out, inp, generator=g, dtype=torch.float32) / inp**0.5
        self.weight = torch.nn.Parameter(w.to(dtype), requires_grad=False)


def _counting_original():
    """SGLang's real ``apply``, counting the calls that reach it."""
    calls = []

    def original(self, layer, x, bias=None):
        calls.append(x.shape[0])
        return UnquantizedLinearMethod.apply(self, layer, x, bias)

    return original, calls


@pytest.mark.parametrize("rows", [2, 3, 8, 16, 128])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_hook_computes_sglangs_product_for_2_to_128_rows(rows, with_bias):
    layer = _Layer(960, 576)
    x = torch.randn(rows, 576)
    bias = torch.randn(960) if with_bias else None
    original, calls = _counting_original()
    with torch.inference_mode():
        got = _linear(original, UnquantizedLinearMethod(), layer, x, bias)
        want = F.linear(x, layer.weight, bias)
    assert calls == []  # computed by the hook
    assert got.shape == (rows, 960) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_strided_input_gives_the_same_product():
    layer = _Layer(64, 32)
    x = torch.randn(4, 64)[:, ::2]  # [4, 32], not contiguous
    original, calls = _counting_original()
    got = _linear(original, UnquantizedLinearMethod(), layer, x)
    assert calls == []
    torch.testing.assert_close(got, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_without_onednn_products_stay_sglangs(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    original, calls = _counting_original()
    _linear(original, UnquantizedLinearMethod(), _Layer(64, 32), torch.randn(4, 32))
    assert calls == [4]


def test_keyword_arguments_reach_the_same_product():
    layer = _Layer(64, 32)
    x = torch.randn(4, 32)
    original, calls = _counting_original()
    got = _linear(original, UnquantizedLinearMethod(), layer=layer, x=x, bias=None)
    assert calls == []
    torch.testing.assert_close(got, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "dtype", "amx"),
    [
        (1, torch.float32, False),  # a decode at batch size 1: no faster in a server
        (LINEAR_ROWS[1] + 1, torch.float32, False),  # a prefill chunk
        (4, torch.bfloat16, False),  # another precision
        (4, torch.float32, True),  # SGLang's AMX kernel
    ],
)
def test_everything_else_goes_to_sglang(rows, dtype, amx):
    layer = _Layer(64, 32, dtype)
    layer.use_intel_amx_backend = amx
    x = torch.randn(rows, 32, dtype=dtype)
    original, calls = _counting_original()
    if amx:  # no AMX kernel here: stand in for SGLang's branch
        original = lambda self, layer, x, bias=None: calls.append(x.shape[0])  # noqa: E731
    _linear(original, UnquantizedLinearMethod(), layer, x)
    assert calls == [rows]
    assert packed_linear_bytes() == 0


def test_batch_invariant_mode_goes_to_sglang(monkeypatch):
    monkeypatch.setattr(batch_invariant_ops, "_batch_invariant_MODE", True)
    layer = _Layer(64, 32)
    original, calls = _counting_original()
    _linear(original, UnquantizedLinearMethod(), layer, torch.randn(4, 32))
    assert calls == [4]


def test_a_packed_copy_is_made_once_per_weight_and_goes_with_it():
    layer = _Layer(128, 64)
    first = packed_linear_weight(layer.weight)
    assert packed_linear_weight(layer.weight) is first  # kept, not remade per call
    assert packed_linear_bytes() == 128 * 64 * 4
    other = _Layer(128, 64)
    assert packed_linear_weight(other.weight) is not first
    assert packed_linear_bytes() == 2 * 128 * 64 * 4
    key = id(layer.weight)
    assert key in cpu_weights._PACKED
    del layer, first
    assert key not in cpu_weights._PACKED
    assert packed_linear_bytes() == 128 * 64 * 4


def test_the_budget_caps_the_copies_and_the_rest_stays_sglangs(monkeypatch, caplog):
    # Room for one 128 x 64 fp32 copy (32 KiB), not two.
    monkeypatch.setenv(PACKED_LINEAR_BUDGET_ENV, str(48 / 1024))
    first, second = _Layer(128, 64), _Layer(128, 65)
    x = torch.randn(4, 64)
    original, calls = _counting_original()
    _linear(original, UnquantizedLinearMethod(), first, x)
    assert calls == []
    with caplog.at_level(logging.INFO, logger=cpu_weights.__name__):
        out = _linear(original, UnquantizedLinearMethod(), second, torch.randn(4, 65))
        _linear(original, UnquantizedLinearMethod(), second, torch.randn(4, 65))
    assert calls == [4, 4] and out.shape == (4, 128)
    assert sum("budget" in r.getMessage() for r in caplog.records) == 1  # said once
    assert packed_linear_bytes() == 128 * 64 * 4


def test_the_budget_is_read_once_until_the_copies_are_forgotten(monkeypatch):
    # A layer past the budget asks on every forward: the setting is parsed once, not each time.
    monkeypatch.setenv(PACKED_LINEAR_BUDGET_ENV, "0")
    layer = _Layer(64, 32)
    assert packed_linear_weight(layer.weight) is None
    monkeypatch.setenv(PACKED_LINEAR_BUDGET_ENV, "1")
    assert packed_linear_weight(layer.weight) is None
    forget_weight_copies()
    assert packed_linear_weight(layer.weight) is not None


def test_a_zero_budget_turns_packing_off(monkeypatch):
    monkeypatch.setenv(PACKED_LINEAR_BUDGET_ENV, "0")
    original, calls = _counting_original()
    _linear(original, UnquantizedLinearMethod(), _Layer(64, 32), torch.randn(4, 32))
    assert calls == [4]


@pytest.mark.parametrize("raw", ["-1", "lots", "nan", "inf"])
def test_a_bad_budget_is_refused(monkeypatch, raw):
    monkeypatch.setenv(PACKED_LINEAR_BUDGET_ENV, raw)
    with pytest.raises(ValueError, match=PACKED_LINEAR_BUDGET_ENV):
        packed_linear_budget_bytes()


def test_a_bad_budget_stops_the_plugin_before_it_registers_anything(monkeypatch):
    from sglang_adatree.sglang import plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv(PACKED_LINEAR_BUDGET_ENV, "-5")
    with pytest.raises(ValueError, match=PACKED_LINEAR_BUDGET_ENV):
        plugin.register()
    assert plugin._registered is False


def test_the_default_budget_holds_the_bundled_targets_layers():
    # 30 layers x (q/k/v 960 + o 576 + gate/up 3072 rows of 576, down 576 rows of 1536), fp32.
    target = 30 * ((960 + 576 + 3072) * 576 + 576 * 1536) * 4
    assert target < packed_linear_budget_bytes() == cpu_weights.DEFAULT_PACKED_LINEAR_MB * 2**20


def test_a_weight_update_drops_the_packed_copies_so_new_weights_are_read():
    layer = _Layer(64, 32)
    x = torch.randn(4, 32)
    original, _ = _counting_original()
    before = _linear(original, UnquantizedLinearMethod(), layer, x)
    new_weights = torch.randn_like(layer.weight)

    def update_weights(self):  # as SGLang loads: in place, no version bump
        layer.weight.data.copy_(new_weights)
        return True, "ok"

    assert _weights_updated(update_weights, object()) == (True, "ok")
    assert packed_linear_bytes() == 0
    after = _linear(original, UnquantizedLinearMethod(), layer, x)
    torch.testing.assert_close(after, F.linear(x, new_weights), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after, before)


def test_the_hook_is_registered_on_sglangs_linear_method():
    hooked = dict(cpu._HOOKS)
    assert hooked["sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"] is _linear
