"""Retrain jobs as the pages list them; queueing and running them is ``tools.retrain``'s."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, select

from sglang_adatree.telemetry.models import RetrainJob
from sglang_adatree.tools.retrain import FINISHED

MAX_JOBS = 50


@dataclass(frozen=True)
class JobView:
    id: int
    requested_at: float
    requested_by: str
    started_at: float | None
    finished_at: float | None
    status: str
    progress: float
    error: str | None
    rows_used: int | None
    policy_version: int | None
    force: bool

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "finished": self.finished}


def _job_view(row: Any) -> JobView:
    return JobView(**{name: getattr(row, name) for name in JobView.__dataclass_fields__})


def list_jobs(conn: Connection, limit: int = MAX_JOBS) -> list[JobView]:
    """The newest retrain jobs, newest first."""
    t = RetrainJob.__table__
    rows = conn.execute(select(t).order_by(t.c.id.desc()).limit(limit)).all()
    return [_job_view(r) for r in rows]


def get_job(conn: Connection, job_id: int) -> JobView | None:
    t = RetrainJob.__table__
    row = conn.execute(select(t).where(t.c.id == job_id)).first()
    return None if row is None else _job_view(row)
