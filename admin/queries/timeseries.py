"""The overview's series: goodput, acceptance length, batch size, step time and the chosen shape
over a time range of one run, downsampled on the server to at most ``MAX_POINTS`` per series.

The bucket width is the smallest of ``WIDTHS_S`` that gives at most ``MAX_POINTS`` buckets over
the range, and buckets align to multiples of it, so points stay put from one live refresh to
the next. The step rows come from one of three tiers, chosen by the rows in the range (read
off the step indexes at its two ends, two index seeks):

* ``step``: at most ``MAX_POINTS`` rows and nothing rolled up: every step is a point;
* ``scan``: at most ``SCAN_LIMIT`` rows and buckets under ``GRANULE_S``: one SQL ``GROUP BY``;
* ``granules``: otherwise the in-process ten-second sums (``granules.GranuleCache``), folded
  into buckets of at least ``GRANULE_S``.

Minutes that retention has rolled up come from ``step_rollups`` in every tier. All tiers yield
``sums.BucketSums``, so the means are exact for any mix (see ``sums``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_adatree.admin.queries.granules import GRANULE_S, GranuleCache
from sglang_adatree.admin.queries.runs import TimeRange
from sglang_adatree.admin.queries.sums import (
    BucketSums,
    Points,
    bucket_index,
    concat,
    fold,
    shape_label,
    shape_shares,
)
from sqlalchemy import Connection, func, literal, select

from sglang_adatree.telemetry.models import Step, StepRollup

MAX_POINTS = 2000
SCAN_LIMIT = 20_000  # rows one GROUP BY may read per request (30-100 ms on SQLite here)
# Bucket widths in seconds; from GRANULE_S up each is a multiple of it, from 60 a multiple of
# a minute, so granules and roll-up minutes fold into whole buckets.
WIDTHS_S = (
    *(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
    *(10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0),
    *(7200.0, 10800.0, 21600.0, 43200.0, 86400.0, 172800.0, 604800.0),
)


def bucket_width(span_s: float, max_points: int = MAX_POINTS) -> float:
    """The smallest width in ``WIDTHS_S`` with at most ``max_points`` buckets over the span."""
    for width in WIDTHS_S:
        # Aligned buckets over a span of k widths number up to k + 2, and granules reach one
        # granule before the range's start: three buckets of slack.
        if span_s / width + 3 <= max_points:
            return width
    return WIDTHS_S[-1]


@dataclass(frozen=True)
class LatestStep:
    """The newest recorded step of a run: what the server is doing now."""

    step_index: int
    wall_time: float
    shape: str
    decision_source: str
    policy_version: int | None
    batch_size: int
    goodput: float
    accept_len: float
    step_ms: float


@dataclass(frozen=True)
class Overview:
    """The overview of one run over one time range."""

    run_id: int
    time_range: TimeRange
    tier: str  # "step", "scan" or "granules" (see the module docstring)
    bucket_s: float | None  # None when every step is a point
    rolled_up: bool  # some points come from step_rollups
    points: Points
    num_steps: int
    goodput: float | None  # over the whole range: emitted tokens / summed step time
    accept_len: float | None
    shape_shares: dict[str, float]
    latest: LatestStep | None

    def to_json(self) -> dict[str, Any]:
        p = self.points
        return {
            "run_id": self.run_id,
            "range": self.time_range.to_json(),
            "resolution": {
                "tier": self.tier,
                "bucket_s": self.bucket_s,
                "rolled_up": self.rolled_up,
                "points": len(p),
            },
            "summary": {
                "num_steps": self.num_steps,
                "goodput": self.goodput,
                "accept_len": self.accept_len,
                "shape_shares": self.shape_shares,
            },
            "latest": None if self.latest is None else vars(self.latest),
            "series": {
                "time": p.time.tolist(),
                "goodput": p.goodput.tolist(),
                "accept_len": p.accept_len.tolist(),
                "batch_size": p.batch_size.tolist(),
                "step_ms": p.step_ms.tolist(),
                "num_steps": p.num_steps.tolist(),
                "shape": list(p.shape),
            },
        }


def overview(
    conn: Connection,
    run_id: int,
    tr: TimeRange,
    granules: GranuleCache,
    *,
    max_points: int = MAX_POINTS,
    scan_limit: int = SCAN_LIMIT,
) -> Overview:
    """The overview series of ``run_id`` over ``tr`` (see the module docstring)."""
    width = bucket_width(tr.span_s, max_points)
    rows = _rows_in_range(conn, run_id, tr)
    rollups = _rollups(conn, run_id, tr, max(width, 60.0))
    if rows <= max_points and not len(rollups):
        tier, steps = "step", _raw_steps(conn, run_id, tr)
    elif width < GRANULE_S and rows <= scan_limit:
        tier, steps = "scan", _grouped_steps(conn, run_id, tr, width)
    else:
        tier, width = "granules", max(width, GRANULE_S)
        steps = granules.sums(conn, run_id, tr.start, tr.end)
        # Granules cached before retention rolled their steps up must not count twice.
        rolled_until = _rolled_until(conn, run_id)
        if rolled_until is not None:
            steps = steps.select(steps.start >= rolled_until)
    everything = concat([steps, rollups])
    bucket = None if tier == "step" else width
    points = fold(everything, bucket)
    total_steps = float(everything.num_steps.sum())
    total_ms = float(everything.sum_step_ms.sum())
    return Overview(
        run_id=run_id,
        time_range=tr,
        tier=tier,
        bucket_s=bucket,
        rolled_up=bool(len(rollups)),
        points=points,
        num_steps=int(total_steps),
        goodput=float(everything.emitted_tokens.sum()) / total_ms * 1000.0 if total_ms else None,
        accept_len=float(everything.sum_accept_len.sum()) / total_steps if total_steps else None,
        shape_shares=shape_shares(everything),
        latest=latest_step(conn, run_id),
    )


def _rows_in_range(conn: Connection, run_id: int, tr: TimeRange) -> int:
    """Step rows of the run in the range, from the step indexes of its first and last rows
    (an upper bound when the writer dropped steps)."""
    in_run = Step.run_id == run_id
    first = conn.execute(
        select(Step.step_index)
        .where(in_run, Step.wall_time >= tr.start)
        .order_by(Step.wall_time)
        .limit(1)
    ).scalar()
    last = conn.execute(
        select(Step.step_index)
        .where(in_run, Step.wall_time <= tr.end)
        .order_by(Step.wall_time.desc())
        .limit(1)
    ).scalar()
    if first is None or last is None:
        return 0
    return max(0, int(last) - int(first) + 1)


_SHAPE = (Step.steps, Step.topk, Step.num_draft_tokens)


def _raw_steps(conn: Connection, run_id: int, tr: TimeRange) -> BucketSums:
    stmt = select(
        Step.wall_time,
        *_SHAPE,
        literal(1),
        Step.batch_size,
        Step.batch_size,
        Step.measured_step_ms,
        Step.measured_accept_len,
        Step.emitted_tokens,
    ).where(Step.run_id == run_id, Step.wall_time >= tr.start, Step.wall_time <= tr.end)
    return BucketSums.from_rows(conn.execute(stmt).all(), width=None)


def _grouped_steps(conn: Connection, run_id: int, tr: TimeRange, width: float) -> BucketSums:
    bucket = bucket_index(Step.wall_time, width, conn.dialect.name)
    stmt = (
        select(
            bucket,
            *_SHAPE,
            func.count(),
            func.sum(Step.batch_size),
            func.max(Step.batch_size),
            func.sum(Step.measured_step_ms),
            func.sum(Step.measured_accept_len),
            func.sum(Step.emitted_tokens),
        )
        .where(Step.run_id == run_id, Step.wall_time >= tr.start, Step.wall_time <= tr.end)
        .group_by(bucket, *_SHAPE)
    )
    return BucketSums.from_rows(conn.execute(stmt).all(), width=width)


def _rolled_until(conn: Connection, run_id: int) -> float | None:
    """The end of the newest rolled-up minute of the run (None: nothing rolled up)."""
    stmt = select(func.max(StepRollup.minute)).where(StepRollup.run_id == run_id)
    minute = conn.execute(stmt).scalar()
    return None if minute is None else float(minute) + 60.0


def _rollups(conn: Connection, run_id: int, tr: TimeRange, width: float) -> BucketSums:
    """Roll-up minutes overlapping the range, summed into ``width``-second buckets."""
    bucket = bucket_index(StepRollup.minute, width, conn.dialect.name)
    shape = (StepRollup.steps, StepRollup.topk, StepRollup.num_draft_tokens)
    stmt = (
        select(
            bucket,
            *shape,
            func.sum(StepRollup.num_steps),
            func.sum(StepRollup.sum_batch_size),
            func.max(StepRollup.max_batch_size),
            func.sum(StepRollup.sum_measured_step_ms),
            func.sum(StepRollup.sum_measured_accept_len),
            func.sum(StepRollup.emitted_tokens),
        )
        .where(
            StepRollup.run_id == run_id,
            StepRollup.minute > tr.start - 60.0,
            StepRollup.minute <= tr.end,
        )
        .group_by(bucket, *shape)
    )
    return BucketSums.from_rows(conn.execute(stmt).all(), width=width)


def latest_step(conn: Connection, run_id: int) -> LatestStep | None:
    """The run's newest step row (one index seek)."""
    steps = Step.__table__
    s = conn.execute(
        select(steps).where(steps.c.run_id == run_id).order_by(steps.c.step_index.desc()).limit(1)
    ).first()
    if s is None:
        return None
    return LatestStep(
        step_index=s.step_index,
        wall_time=s.wall_time,
        shape=shape_label(s.steps, s.topk, s.num_draft_tokens),
        decision_source=s.decision_source,
        policy_version=s.policy_version,
        batch_size=s.batch_size,
        goodput=s.goodput,
        accept_len=s.measured_accept_len,
        step_ms=s.measured_step_ms,
    )
