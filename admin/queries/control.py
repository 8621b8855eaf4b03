"""What operators control, as the pages list it: pins, policy versions, retrain jobs, audit log.

Listing only; the changes themselves are in ``admin.actions``. Policy artifacts are never read
here (they can be megabytes), only their size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from admin.queries.sums import shape_label
from sglang_adatree.telemetry.models import AuditLog, Pin, Policy, RetrainJob

MAX_CLEARED_PINS = 50
MAX_JOBS = 50
MAX_AUDIT = 200


@dataclass(frozen=True)
class PinView:
    id: int
    shape: str
    min_batch_size: int | None
    max_batch_size: int | None
    reason: str
    created_at: float
    created_by: str
    cleared_at: float | None
    cleared_by: str | None

    @property
    def active(self) -> bool:
        return self.cleared_at is None

    def batch_range(self) -> str:
        lo, hi = self.min_batch_size, self.max_batch_size
        if lo is None and hi is None:
            return "all batches"
        return f"batch size {lo or 1}..{'' if hi is None else hi}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "active": self.active}


@dataclass(frozen=True)
class PolicyView:
    version: int
    created_at: float
    training_rows: int
    artifact_bytes: int
    validation_metrics: dict[str, Any]
    active: bool
    activated_at: float | None
    activated_by: str | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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
        return self.status in ("succeeded", "failed", "refused")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "finished": self.finished}


@dataclass(frozen=True)
class AuditView:
    id: int
    at: float
    actor: str
    action: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def pin_view(row: Any) -> PinView:
    return PinView(
        id=row.id,
        shape=shape_label(row.steps, row.topk, row.num_draft_tokens),
        min_batch_size=row.min_batch_size,
        max_batch_size=row.max_batch_size,
        reason=row.reason,
        created_at=row.created_at,
        created_by=row.created_by,
        cleared_at=row.cleared_at,
        cleared_by=row.cleared_by,
    )


def list_pins(conn: Connection) -> tuple[list[PinView], list[PinView]]:
    """Active pins newest first (the order the server applies them), then recently cleared."""
    pins = Pin.__table__.c
    newest_first = (pins.created_at.desc(), pins.id.desc())
    active = conn.execute(
        select(Pin.__table__).where(pins.cleared_at.is_(None)).order_by(*newest_first)
    ).all()
    cleared = conn.execute(
        select(Pin.__table__)
        .where(pins.cleared_at.is_not(None))
        .order_by(pins.cleared_at.desc(), pins.id.desc())
        .limit(MAX_CLEARED_PINS)
    ).all()
    return [pin_view(r) for r in active], [pin_view(r) for r in cleared]


def get_pin(conn: Connection, pin_id: int) -> PinView | None:
    row = conn.execute(select(Pin.__table__).where(Pin.__table__.c.id == pin_id)).first()
    return None if row is None else pin_view(row)


_POLICY_COLUMNS = (
    Policy.version,
    Policy.created_at,
    Policy.training_rows,
    func.length(Policy.artifact).label("artifact_bytes"),
    Policy.validation_metrics,
    Policy.active,
    Policy.activated_at,
    Policy.activated_by,
)


def _policy_view(row: Any) -> PolicyView:
    return PolicyView(
        version=row.version,
        created_at=row.created_at,
        training_rows=row.training_rows,
        artifact_bytes=int(row.artifact_bytes or 0),
        validation_metrics=dict(row.validation_metrics or {}),
        active=bool(row.active),
        activated_at=row.activated_at,
        activated_by=row.activated_by,
    )


def list_policies(conn: Connection) -> list[PolicyView]:
    """Every policy version, newest first."""
    rows = conn.execute(select(*_POLICY_COLUMNS).order_by(Policy.version.desc())).all()
    return [_policy_view(r) for r in rows]


def get_policy(conn: Connection, version: int) -> PolicyView | None:
    row = conn.execute(select(*_POLICY_COLUMNS).where(Policy.version == version)).first()
    return None if row is None else _policy_view(row)


def active_version(conn: Connection) -> int | None:
    """The active policy version, as the server reads it (the highest active one)."""
    stmt = select(Policy.version).where(Policy.active.is_(True)).order_by(Policy.version.desc())
    return conn.execute(stmt.limit(1)).scalar()


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


def list_audit(conn: Connection, limit: int = MAX_AUDIT) -> list[AuditView]:
    """The newest audit entries, newest first."""
    t = AuditLog.__table__
    rows = conn.execute(select(t).order_by(t.c.at.desc(), t.c.id.desc()).limit(limit)).all()
    return [AuditView(r.id, r.at, r.actor, r.action, r.before, r.after) for r in rows]
