"""Copies of weights in the layouts the CPU path's products run fastest on, made once per weight.

* ``transposed_weight``: an lm_head ``[V, H]`` as a contiguous ``[H, V]`` copy, over which a
  one-row product runs at full memory speed (``cpu.lm_head_logits``);
* ``packed_linear_weight``: a linear layer's ``[out, in]`` weight reordered for oneDNN, whose
  fp32 products of 2-128 rows cost 0.4-0.8x ``F.linear``'s on an AVX2 CPU (``cpu._linear``).

Copies are keyed by the weight's ``id`` and hold a weak reference to it, so a freed weight takes
its copy with it. SGLang writes new weights in place (``param.data.copy_``), which no version
counter sees: ``forget_weight_copies`` drops every copy, and the CPU path calls it after every
SGLang weight update (``cpu._weights_updated``).

Packed copies cost as much memory as the weights they copy (about 425 MB for the bundled
target's linear layers in fp32), so they count against a budget: ``ADATREE_CPU_PACKED_LINEAR_MB``
(default 1024; 0 turns packing off). A weight that does not fit gets no copy and its products
stay SGLang's.
"""

from __future__ import annotations

import logging
import os
import weakref

import torch

logger = logging.getLogger(__name__)

PACKED_LINEAR_BUDGET_ENV = "ADATREE_CPU_PACKED_LINEAR_MB"
DEFAULT_PACKED_LINEAR_MB = 1024
# oneDNN picks its blocked layout for an expected row count; one packing serves every count the
# CPU path sends (2-128 rows), and 8 is a typical verify pass (the figures in ``cpu`` use it).
PACK_FOR_ROWS = 8

# By id(weight): (a weak reference to the weight, its copy).
_TRANSPOSED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_PACKED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_packed_bytes = 0
_budget_bytes: int | None = None  # parsed once; a layer past the budget asks on every call
_over_budget_logged = False


def _remember(
    cache: dict[int, tuple[weakref.ref, torch.Tensor]], weight: torch.Tensor, copy: torch.Tensor
) -> None:
    key = id(weight)
    # The entry goes with its weight (a freed model must not leave its copies behind).
    cache[key] = (weakref.ref(weight, lambda _: _drop(cache, key)), copy)


def _drop(cache: dict[int, tuple[weakref.ref, torch.Tensor]], key: int) -> None:
    global _packed_bytes
    entry = cache.pop(key, None)
    if entry is not None and cache is _PACKED:
        _packed_bytes -= _nbytes(entry[1])


def _cached(
    cache: dict[int, tuple[weakref.ref, torch.Tensor]], weight: torch.Tensor
) -> torch.Tensor | None:
    entry = cache.get(id(weight))
    if entry is not None and entry[0]() is weight:
        return entry[1]
    return None


def _nbytes(tensor: torch.Tensor) -> int:
    # Counted by logical size: an opaque oneDNN tensor reports its elements, not its padding.
    return tensor.numel() * tensor.element_size()


def transposed_weight(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[hidden, vocab]`` copy of ``weight``, made once and kept while it lives."""
    copy = _cached(_TRANSPOSED, weight)
    if copy is None:
        copy = weight.detach().t().contiguous()  # [V, H] -> [H, V]
        _remember(_TRANSPOSED, weight, copy)
    return copy


def packed_linear_budget_bytes() -> int:
    """The packed copies' memory budget from ``ADATREE_CPU_PACKED_LINEAR_MB``."""
    raw = os.environ.get(PACKED_LINEAR_BUDGET_ENV, "")
    try:
        mb = float(raw) if raw.strip() else DEFAULT_PACKED_LINEAR_MB
    except ValueError:
        raise ValueError(
            f"{PACKED_LINEAR_BUDGET_ENV} must be a number of MB, got {raw!r}"
        ) from None
    if not 0 <= mb < float("inf"):  # also NaN
        raise ValueError(f"{PACKED_LINEAR_BUDGET_ENV} must be a number of MB >= 0, got {raw!r}")
    return int(mb * 2**20)


def packed_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ([out, in], fp32) reordered for ``torch.ops.mkldnn._linear_pointwise``, made
    once and kept while it lives; None when the copy would exceed the budget or this torch has
    no oneDNN."""
    global _packed_bytes, _budget_bytes, _over_budget_logged
    copy = _cached(_PACKED, weight)
    if copy is not None:
        return copy
    if not torch.backends.mkldnn.is_available():
        return None
    size = weight.numel() * weight.element_size()
    if _budget_bytes is None:
        _budget_bytes = packed_linear_budget_bytes()
    budget = _budget_bytes
    if _packed_bytes + size > budget:
        if not _over_budget_logged:
            _over_budget_logged = True
            logger.info(
                "packed linear weights at their budget (%.0f of %.0f MB, %s): further layers "
                "keep SGLang's product",
                _packed_bytes / 2**20,
                budget / 2**20,
                PACKED_LINEAR_BUDGET_ENV,
            )
        return None
    copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_FOR_ROWS)
    _remember(_PACKED, weight, copy)
    _packed_bytes += _nbytes(copy)
    return copy


def packed_linear_bytes() -> int:
    """Memory held by packed copies now."""
    return _packed_bytes


def forget_weight_copies() -> None:
    """Drop every copy (the weights they copy may have changed)."""
    global _packed_bytes, _budget_bytes, _over_budget_logged
    _TRANSPOSED.clear()
    _PACKED.clear()
    _packed_bytes = 0
    _budget_bytes = None
    _over_budget_logged = False


def linear_packed(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over ``packed_linear_weight(weight)``: [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
