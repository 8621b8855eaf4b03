"""The values the serving worker hands to telemetry: one ``StepRecord`` per decode step and one
``RunRecord`` per server start.

Both are frozen, slotted dataclasses. The decode loop builds a ``StepRecord`` every step, so it
holds plain Python numbers and tuples only (no tensors, nothing that needs a device sync), and
everything else (encoding ``accepted_by_depth``, building database rows) happens on the writer
thread. Building one costs a few microseconds: a frozen dataclass sets each of its fields
through ``object.__setattr__``.

Words as in the package glossary: *emitted tokens* are accepted draft tokens plus one bonus token
per request; *acceptance length* is the mean emitted tokens per request of one verify step;
*goodput* is the batch's emitted tokens per second of step time.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one decode step chose and what happened; one row of ``steps``.

    ``accepted_by_depth[d]`` counts accepted draft tokens at tree depth ``d + 1`` summed over
    the batch (so ``sum(accepted_by_depth) == accepted_tokens``); ``accepted_by_rank[r]`` counts
    accepted draft tokens that were the ``r + 1``-th ranked sibling. Both are empty for a step
    without speculation. Predictions are ``None`` when the decision did not use the model
    (a pin or warm-up may skip it).
    """

    run_id: int
    step_index: int
    wall_time: float  # unix seconds at the end of the step
    batch_size: int
    padded_batch_size: int  # the CUDA-graph batch size it ran as (batch_size without graphs)
    sum_context_len: int
    max_context_len: int
    steps: int
    topk: int
    num_draft_tokens: int
    decision_source: str  # a policy.DecisionSource value
    policy_version: int | None
    predicted_step_ms: float | None
    measured_step_ms: float
    predicted_accept_len: float | None
    measured_accept_len: float  # acceptance length: emitted_tokens / batch_size
    emitted_tokens: int  # batch total
    drafted_tokens: int  # draft tokens verified, batch total (num_draft_tokens - 1 per request)
    accepted_tokens: int  # accepted draft tokens, batch total (emitted_tokens - batch_size)
    goodput: float  # emitted tokens per second of measured step time
    # The candidate priced next best ("S,K,N", ``policy.Decision.runner_up``) and what was
    # predicted for it; None where the decision priced no other shape.
    runner_up: str | None = None
    runner_up_step_ms: float | None = None
    runner_up_accept_len: float | None = None
    # How the machine priced steps against the step-time model when the step was decided
    # (``cost_model.PriceSplit``, log units); None under a cost model without a correction.
    price_drift: float | None = None
    price_tilt: float | None = None
    price_offset: float | None = None
    accepted_by_depth: tuple[int, ...] = ()
    accepted_by_rank: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One server start (one rank of it); one row of ``runs``."""

    target_model: str
    draft_model: str | None
    device: str
    sglang_version: str | None
    package_version: str
    config: Mapping[str, Any] = field(default_factory=dict)  # AdaTreeConfig.to_dict()
    node: str = ""
    rank: int = 0
    started_at: float | None = None  # unix seconds; None means now


def encode_counts(counts: tuple[int, ...] | None) -> str:
    """``(12, 7, 3)`` -> ``"12,7,3"``: the compact column form of per-depth / per-rank counts.

    Cached: the same few count tuples recur step after step, and a lookup is cheaper than a
    join. A list (unhashable) is encoded uncached rather than failing the writer.
    """
    if not counts:
        return ""
    try:
        return _encode_cached(counts)
    except TypeError:
        return ",".join(map(str, counts))


@lru_cache(maxsize=4096)
def _encode_cached(counts: tuple[int, ...]) -> str:
    return ",".join(map(str, counts))


def decode_counts(text: str | None) -> tuple[int, ...]:
    """The inverse of ``encode_counts``; ``""`` and ``None`` are no counts."""
    if not text:
        return ()
    return tuple(int(x) for x in text.split(","))


# Columns of ``steps`` that a record fills, in ``step_row`` order: the record's fields, with the
# two count tuples encoded last.
STEP_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord))
assert STEP_COLUMNS[-2:] == ("accepted_by_depth", "accepted_by_rank")
_SCALARS = operator.attrgetter(*STEP_COLUMNS[:-2])


def step_row(rec: StepRecord) -> tuple[Any, ...]:
    """The ``steps`` insert parameters for one record, in ``STEP_COLUMNS`` order (runs on the
    writer thread; a C-level attribute fetch plus two short joins)."""
    return (
        *_SCALARS(rec),
        encode_counts(rec.accepted_by_depth),
        encode_counts(rec.accepted_by_rank),
    )


def config_json(config: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-safe copy of an effective config (unknown objects become their ``str``)."""
    return json.loads(json.dumps(dict(config), default=str))
