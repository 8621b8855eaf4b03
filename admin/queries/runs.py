"""Runs and their time extent."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from sglang_adatree.telemetry.control import recorded_candidates
from sglang_adatree.telemetry.models import Run, Step, StepRollup

# Time ranges the pages offer: name -> span in seconds (None: the whole run).
RANGES: dict[str, float | None] = {"5m": 300.0, "1h": 3600.0, "1d": 86400.0, "run": None}
RANGE_LABELS: dict[str, str] = {
    "5m": "last 5 min",
    "1h": "last hour",
    "1d": "last day",
    "run": "whole run",
}
DEFAULT_RANGE = "1h"
MAX_RUNS_LISTED = 200


@dataclass(frozen=True)
class RunSummary:
    """One row of ``runs`` as the pages show it."""

    id: int
    started_at: float
    stopped_at: float | None
    target_model: str
    draft_model: str | None
    device: str
    node: str
    rank: int
    package_version: str
    sglang_version: str | None
    dropped_steps: int
    rejected_steps: int
    unfinished_steps: int
    last_step_index: int | None  # newest recorded step still in ``steps`` (None: none)
    candidate_shapes: tuple[str, ...]  # from the run's recorded config ('S,K,N')

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidate_shapes"] = list(self.candidate_shapes)
        return out


@dataclass(frozen=True)
class TimeRange:
    """``[start, end]`` in unix seconds; ``end`` is the run's newest data, not the clock, so a
    stopped run's "last hour" is the last hour it ran."""

    name: str
    start: float
    end: float

    @property
    def span_s(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "label": RANGE_LABELS[self.name], **asdict(self)}


def _last_step_index(conn: Connection, run_id: int) -> int | None:
    stmt = select(func.max(Step.step_index)).where(Step.run_id == run_id)
    return conn.execute(stmt).scalar()


def _summary(conn: Connection, row: Any) -> RunSummary:
    return RunSummary(
        id=row.id,
        started_at=row.started_at,
        stopped_at=row.stopped_at,
        target_model=row.target_model,
        draft_model=row.draft_model,
        device=row.device,
        node=row.node,
        rank=row.rank,
        package_version=row.package_version,
        sglang_version=row.sglang_version,
        dropped_steps=int(row.dropped_steps or 0),
        rejected_steps=int(row.rejected_steps or 0),
        unfinished_steps=int(row.unfinished_steps or 0),
        last_step_index=_last_step_index(conn, row.id),
        candidate_shapes=recorded_candidates(row.config),
    )


def list_runs(conn: Connection, limit: int = MAX_RUNS_LISTED) -> list[RunSummary]:
    """The newest ``limit`` runs, newest first."""
    rows = conn.execute(select(Run).order_by(Run.started_at.desc(), Run.id.desc()).limit(limit))
    return [_summary(conn, row) for row in rows.all()]


def get_run(conn: Connection, run_id: int) -> RunSummary | None:
    row = conn.execute(select(Run).where(Run.id == run_id)).first()
    return None if row is None else _summary(conn, row)


def latest_run_id(conn: Connection) -> int | None:
    """The run started last; the pages show it when no run is chosen."""
    stmt = select(Run.id).order_by(Run.started_at.desc(), Run.id.desc()).limit(1)
    return conn.execute(stmt).scalar()


def run_extent(conn: Connection, run_id: int) -> tuple[float, float] | None:
    """First and last data time of a run over ``steps`` and ``step_rollups`` (None: no data).

    Four index seeks; min and max are separate statements because SQLite only answers a lone
    ``min()`` or ``max()`` from an index.
    """
    by_run_s = Step.run_id == run_id
    by_run_r = StepRollup.run_id == run_id
    first = [
        conn.execute(select(func.min(Step.wall_time)).where(by_run_s)).scalar(),
        conn.execute(select(func.min(StepRollup.minute)).where(by_run_r)).scalar(),
    ]
    last_step = conn.execute(select(func.max(Step.wall_time)).where(by_run_s)).scalar()
    last_minute = conn.execute(select(func.max(StepRollup.minute)).where(by_run_r)).scalar()
    last = [last_step, None if last_minute is None else last_minute + 60.0]
    firsts = [t for t in first if t is not None]
    lasts = [t for t in last if t is not None]
    if not firsts:
        return None
    return min(firsts), max(lasts)


def newest_rows(conn: Connection, run_id: int, tr: TimeRange, max_rows: int) -> TimeRange:
    """``tr`` shortened to its newest ``max_rows`` steps (by step index; two index seeks), so
    pages that read rows one by one stay bounded on long ranges."""
    last = conn.execute(
        select(Step.step_index)
        .where(Step.run_id == run_id, Step.wall_time <= tr.end)
        .order_by(Step.wall_time.desc())
        .limit(1)
    ).scalar()
    if last is None:
        return tr
    start = conn.execute(
        select(Step.wall_time)
        .where(Step.run_id == run_id, Step.step_index >= int(last) - max_rows + 1)
        .order_by(Step.step_index)
        .limit(1)
    ).scalar()
    if start is None or start <= tr.start:
        return tr
    return TimeRange(tr.name, float(start), tr.end)


def resolve_range(conn: Connection, run: RunSummary, name: str) -> TimeRange:
    """The named range ending at the run's newest data (see ``TimeRange``)."""
    span = RANGES[name]
    extent = run_extent(conn, run.id)
    if extent is None:
        return TimeRange(name, run.started_at, run.started_at)
    first, last = extent
    start = first if span is None else max(first, last - span)
    return TimeRange(name, start, last)


def run_choices(conn: Connection, limit: int = 50) -> list[tuple[int, float, str]]:
    """(id, started_at, target model) of the newest runs, for the run picker on every page."""
    stmt = (
        select(Run.id, Run.started_at, Run.target_model)
        .order_by(Run.started_at.desc(), Run.id.desc())
        .limit(limit)
    )
    return [(r.id, r.started_at, r.target_model) for r in conn.execute(stmt)]
