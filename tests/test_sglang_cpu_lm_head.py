"""The CPU path's lm_head product: the same logits as SGLang's, taken over only where its
plain fp32 product of 2-4 rows would run."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from sglang_adatree.sglang.cpu import LM_HEAD_MIN_VOCAB, _lm_head, lm_head_logits


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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_lm_head_logits_is_the_plain_product(rows):
    g = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, 64, generator=g)
    weight = torch.randn(5000, 64, generator=g)
    out = lm_head_logits(hidden, weight)
    assert out.shape == (rows, 5000) and out.is_contiguous()
    torch.testing.assert_close(out, hidden @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 3, 4])
def test_the_hook_takes_over_fp32_products_of_2_to_4_rows(rows):
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
    ("rows", "vocab", "dtype", "processor"),
    [
        (1, LM_HEAD_MIN_VOCAB, torch.float32, {}),  # one row: MKL's product is already fast
        (5, LM_HEAD_MIN_VOCAB, torch.float32, {}),  # more rows: no gain measured
        (2, LM_HEAD_MIN_VOCAB - 1, torch.float32, {}),  # a small vocabulary
        (2, LM_HEAD_MIN_VOCAB, torch.bfloat16, {}),  # another precision
        (2, LM_HEAD_MIN_VOCAB, torch.float32, {"use_fp32_lm_head": True}),
    ],
)
def test_everything_else_goes_to_sglang(rows, vocab, dtype, processor):
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
