"""Per-step data of one benchmark point, read back from the telemetry store.

Servers that run under ``adatree serve`` (adatree and the re-implemented baselines) record one
row per decode step. For a point, the bench reads that server's run between the point's first
request and its last response: which shapes the policy chose and how often, why (decision
sources), the measured acceptance length and step time. SGLang's own algorithms (``ar``,
``static``, the built-in adaptive rule) record nothing here; their acceptance length comes from
the requests' ``spec_verify_ct``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select

from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.store import session_scope

# The writer flushes every telemetry_flush_s (0.5 s by default); wait this long for the last rows.
FLUSH_WAIT_S = 1.5


@dataclass(frozen=True)
class StepPoint:
    """One recorded decode step, as the report needs it."""

    wall_time: float  # unix seconds
    batch_size: int
    shape: str  # "S,K,N"
    decision_source: str
    measured_step_ms: float
    emitted_tokens: int


@dataclass(frozen=True)
class ShapeGoodput:
    """What one shape delivered while it ran during a point, from its measured steps."""

    shape: str  # "S,K,N"
    num_steps: int
    step_ms_p50: float
    accept_len: float  # emitted tokens per request per step
    tok_s: float  # emitted tokens / measured step time, over its steps


# A shape needs this many measured steps at a point to stand for its goodput there.
MIN_SHAPE_STEPS = 3


@dataclass(frozen=True)
class StepSummary:
    """What the steps of one point show; empty (``num_steps`` 0) without telemetry."""

    num_steps: int
    shape_counts: dict[str, int]  # shape -> steps, most used first
    source_counts: dict[str, int]  # decision source -> steps
    accept_len: float | None  # emitted tokens per request per step
    batch_size_mean: float | None
    step_ms_p50: float | None
    by_shape: tuple[ShapeGoodput, ...] = ()  # shapes with >= MIN_SHAPE_STEPS, best first
    step_tok_s: float | None = None  # emitted tokens / measured step time, all steps

    @property
    def bound(self) -> ShapeGoodput | None:
        """The physical bound: the shape with the best measured tokens per second of step
        time (measured acceptance over measured cost), had it run on every step."""
        return self.by_shape[0] if self.by_shape else None

    @property
    def top_shape(self) -> str | None:
        return next(iter(self.shape_counts), None)


EMPTY = StepSummary(0, {}, {}, None, None, None)


def shape_goodputs(
    steps: Sequence[StepPoint], min_steps: int = MIN_SHAPE_STEPS
) -> tuple[ShapeGoodput, ...]:
    """Per shape with at least ``min_steps`` steps: its measured goodput, best first.

    Tokens per second of the shape's own step time (sum of emitted tokens over the sum of its
    measured step times), so batch sizes weigh as they ran; time between steps (scheduling,
    prefill) is left out, for every shape alike.
    """
    groups: dict[str, list[StepPoint]] = {}
    for s in steps:
        groups.setdefault(s.shape, []).append(s)
    out = []
    for shape, group in groups.items():
        if len(group) < min_steps:
            continue
        times = sorted(s.measured_step_ms for s in group)
        out.append(
            ShapeGoodput(
                shape=shape,
                num_steps=len(group),
                step_ms_p50=times[len(times) // 2],
                accept_len=sum(s.emitted_tokens for s in group) / sum(s.batch_size for s in group),
                tok_s=1000.0 * sum(s.emitted_tokens for s in group) / max(sum(times), 1e-9),
            )
        )
    return tuple(sorted(out, key=lambda g: (-g.tok_s, g.shape)))


def read_steps(db_url: str, run_id: int, start: float, end: float) -> list[StepPoint]:
    """Steps of ``run_id`` with ``start <= wall_time <= end``, in step order."""
    query = (
        select(
            Step.wall_time,
            Step.batch_size,
            Step.steps,
            Step.topk,
            Step.num_draft_tokens,
            Step.decision_source,
            Step.measured_step_ms,
            Step.emitted_tokens,
        )
        .where(Step.run_id == run_id, Step.wall_time >= start, Step.wall_time <= end)
        .order_by(Step.step_index)
    )
    with session_scope(db_url) as session:
        rows = session.execute(query).all()
    return [StepPoint(r[0], r[1], f"{r[2]},{r[3]},{r[4]}", r[5], r[6], r[7]) for r in rows]


def wait_for_steps(db_url: str, run_id: int, start: float, end: float) -> list[StepPoint]:
    """``read_steps`` after the writer's flush interval, so the point's last steps are in."""
    time.sleep(FLUSH_WAIT_S)
    return read_steps(db_url, run_id, start, end)


def summarize_steps(steps: Sequence[StepPoint]) -> StepSummary:
    """Shape and decision-source counts, acceptance length, batch size and step time."""
    if not steps:
        return EMPTY
    shapes = Counter(s.shape for s in steps)
    sources = Counter(s.decision_source for s in steps)
    requests = sum(s.batch_size for s in steps)
    times = sorted(s.measured_step_ms for s in steps)
    return StepSummary(
        num_steps=len(steps),
        shape_counts=dict(shapes.most_common()),
        source_counts=dict(sources.most_common()),
        accept_len=sum(s.emitted_tokens for s in steps) / requests,
        batch_size_mean=requests / len(steps),
        step_ms_p50=times[len(times) // 2],
        by_shape=shape_goodputs(steps),
        step_tok_s=1000.0 * sum(s.emitted_tokens for s in steps) / max(sum(times), 1e-9),
    )
