"""Operator control over the store: pins, policy versions, and the audit log of every change.

The one home of its rules; the dashboard, retrain, the bench's pinned servers and the serving
loop's poller all call it:

* a pin (``policy.Pin``: a shape for all batch sizes or a range) is active until cleared; the
  newest covering pin wins; only a shape of the candidate set can be pinned (the latest run's
  recorded ``candidate_shapes``, else the caller's configuration: ``candidate_set``);
* at most one policy version is active; activating one deactivates the others; a rollback
  re-activates the version activated most recently before the current one;
* every change writes one ``audit_log`` entry (actor, time, action, state before and after) in
  the caller's transaction, so both land or neither does.

Refusals raise ``ControlError`` with a 4xx status and a message for the operator. The serving
loop polls ``read_control_state`` (two small indexed queries; the artifact is read only when the
active version changed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select, update

from sglang_adatree.core.policy import Pin
from sglang_adatree.core.shapes import ShapeError, TreeShape, validate_candidates
from sglang_adatree.telemetry.models import AuditLog, PinRow, Policy, Run
from sglang_adatree.telemetry.store import get_engine

log = logging.getLogger(__name__)

MAX_CLEARED_PINS = 50
MAX_AUDIT = 200


class ControlError(Exception):
    """A refused change or an unknown object: ``status`` (4xx) and a message for the operator."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        assert 400 <= status < 500, f"ControlError is for 4xx answers, got {status}"
        self.status = status
        self.message = message


# ---- candidate set -------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateSet:
    """The shapes an operator may pin, and where that set came from."""

    shapes: tuple[TreeShape, ...]
    source: str  # "run" (the latest run's recorded config) or "config" (no usable run)
    run_id: int | None

    def describe(self) -> str:
        if self.source == "run":
            return f"the recorded config of run {self.run_id} (the latest run)"
        return "the configuration given (no run with a candidate set recorded)"

    def to_json(self) -> dict[str, Any]:
        return {
            "shapes": [str(s) for s in self.shapes],
            "source": self.source,
            "run_id": self.run_id,
            "description": self.describe(),
        }


def recorded_candidates(config: Any) -> tuple[str, ...]:
    """The ``candidate_shapes`` a run recorded in its config ('S,K,N' strings), if any."""
    if not isinstance(config, dict):
        return ()
    shapes = config.get("candidate_shapes")
    if not isinstance(shapes, list):
        return ()
    return tuple(str(s) for s in shapes)


def candidate_set(conn: Connection, fallback: Sequence[TreeShape]) -> CandidateSet:
    """The latest run's recorded ``candidate_shapes``, else ``fallback``.

    A running server builds runtime state for exactly its candidate shapes at start-up and
    ignores a pin outside them, so the latest run's recorded config is the best statement of
    what the serving fleet accepts.
    """
    row = conn.execute(
        select(Run.id, Run.config).order_by(Run.started_at.desc(), Run.id.desc()).limit(1)
    ).first()
    if row is not None:
        try:
            shapes = validate_candidates(
                TreeShape.parse(s) for s in recorded_candidates(row.config)
            )
        except ShapeError:
            shapes = ()
        if shapes:
            return CandidateSet(shapes, "run", row.id)
    return CandidateSet(tuple(fallback), "config", None)


# ---- records -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PinRecord:
    """One row of ``pins``: the pin, why, who set it and who cleared it."""

    id: int
    pin: Pin
    reason: str
    created_at: float
    created_by: str
    cleared_at: float | None
    cleared_by: str | None

    @property
    def shape(self) -> TreeShape:
        return self.pin.shape

    @property
    def min_batch_size(self) -> int | None:
        return self.pin.min_batch_size

    @property
    def max_batch_size(self) -> int | None:
        return self.pin.max_batch_size

    @property
    def active(self) -> bool:
        return self.cleared_at is None

    def batch_range(self) -> str:
        lo, hi = self.min_batch_size, self.max_batch_size
        if lo is None and hi is None:
            return "all batches"
        return f"batch size {lo or 1}..{'' if hi is None else hi}"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "shape": str(self.shape),
            "min_batch_size": self.min_batch_size,
            "max_batch_size": self.max_batch_size,
            "reason": self.reason,
            "created_at": self.created_at,
            "created_by": self.created_by,
            "cleared_at": self.cleared_at,
            "cleared_by": self.cleared_by,
            "active": self.active,
        }


@dataclass(frozen=True)
class PolicyRecord:
    """One policy version as operators see it (its artifact's size, never the artifact)."""

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
class AuditRecord:
    id: int
    at: float
    actor: str
    action: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ActivePolicy:
    """The active policy version with its artifact (a serialised step-time model)."""

    version: int
    artifact: bytes
    feature_names: tuple[str, ...]


@dataclass(frozen=True)
class ControlState:
    """What the serving loop polls: active pins (newest first, the order they apply in) and
    the active policy version; ``policy`` is None when no version is active or the caller
    already has it."""

    pins: tuple[PinRecord, ...]
    active_policy_version: int | None
    policy: ActivePolicy | None

    def pin_for(self, batch_size: int) -> TreeShape | None:
        """The shape pinned for this batch size: the newest pin that covers it, if any."""
        for record in self.pins:
            if record.pin.covers(batch_size):
                return record.shape
        return None


# ---- reads ---------------------------------------------------------------------------------

_NEWEST_PIN_FIRST = (PinRow.created_at.desc(), PinRow.id.desc())


def _pin_record(row: Any) -> PinRecord | None:
    try:
        pin = Pin(
            TreeShape(row.steps, row.topk, row.num_draft_tokens),
            row.min_batch_size,
            row.max_batch_size,
        )
    except (ShapeError, ValueError) as exc:
        # create_pin validates; a row written some other way must not stop serving or a page.
        log.error("control: ignoring pin %s: %s", row.id, exc)
        return None
    return PinRecord(
        row.id, pin, row.reason, row.created_at, row.created_by, row.cleared_at, row.cleared_by
    )


def _pin_records(rows: Sequence[Any]) -> list[PinRecord]:
    return [r for r in map(_pin_record, rows) if r is not None]


def active_pins(conn: Connection) -> list[PinRecord]:
    """Uncleared pins, newest first (the order the server applies them)."""
    stmt = select(PinRow.__table__).where(PinRow.cleared_at.is_(None)).order_by(*_NEWEST_PIN_FIRST)
    return _pin_records(conn.execute(stmt).all())


def list_pins(conn: Connection) -> tuple[list[PinRecord], list[PinRecord]]:
    """Active pins newest first, then the most recently cleared."""
    cleared = conn.execute(
        select(PinRow.__table__)
        .where(PinRow.cleared_at.is_not(None))
        .order_by(PinRow.cleared_at.desc(), PinRow.id.desc())
        .limit(MAX_CLEARED_PINS)
    ).all()
    return active_pins(conn), _pin_records(cleared)


def get_pin(conn: Connection, pin_id: int) -> PinRecord | None:
    row = conn.execute(select(PinRow.__table__).where(PinRow.id == pin_id)).first()
    return None if row is None else _pin_record(row)


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


def _policy_record(row: Any) -> PolicyRecord:
    return PolicyRecord(
        version=row.version,
        created_at=row.created_at,
        training_rows=row.training_rows,
        artifact_bytes=int(row.artifact_bytes or 0),
        validation_metrics=dict(row.validation_metrics or {}),
        active=bool(row.active),
        activated_at=row.activated_at,
        activated_by=row.activated_by,
    )


def list_policies(conn: Connection) -> list[PolicyRecord]:
    """Every policy version, newest first."""
    rows = conn.execute(select(*_POLICY_COLUMNS).order_by(Policy.version.desc())).all()
    return [_policy_record(r) for r in rows]


def get_policy(conn: Connection, version: int) -> PolicyRecord | None:
    row = conn.execute(select(*_POLICY_COLUMNS).where(Policy.version == version)).first()
    return None if row is None else _policy_record(row)


def active_version(conn: Connection) -> int | None:
    """The active policy version (the highest active one, should several be marked)."""
    stmt = select(Policy.version).where(Policy.active.is_(True)).order_by(Policy.version.desc())
    return conn.execute(stmt.limit(1)).scalar()


def active_policy(conn: Connection) -> ActivePolicy | None:
    """The active version with its artifact, or None."""
    version = active_version(conn)
    if version is None:
        return None
    row = conn.execute(
        select(Policy.version, Policy.artifact, Policy.feature_names).where(
            Policy.version == version
        )
    ).one()
    return ActivePolicy(row.version, row.artifact, tuple(row.feature_names))


def list_audit(conn: Connection, limit: int = MAX_AUDIT) -> list[AuditRecord]:
    """The newest audit entries, newest first."""
    t = AuditLog.__table__
    rows = conn.execute(select(t).order_by(t.c.at.desc(), t.c.id.desc()).limit(limit)).all()
    return [AuditRecord(r.id, r.at, r.actor, r.action, r.before, r.after) for r in rows]


def read_control_state(db: str | Engine, known_policy_version: int | None = None) -> ControlState:
    """Active pins and the active policy version, in one read transaction; the artifact only
    when the active version is not ``known_policy_version``."""
    engine = db if isinstance(db, Engine) else get_engine(db)
    with engine.connect() as conn:
        pins = active_pins(conn)
        version = active_version(conn)
        policy = None
        if version is not None and version != known_policy_version:
            policy = active_policy(conn)
    return ControlState(pins=tuple(pins), active_policy_version=version, policy=policy)


# ---- changes -------------------------------------------------------------------------------


def audit(
    conn: Connection,
    actor: str,
    action: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    """One ``audit_log`` entry, in the caller's transaction."""
    conn.execute(
        insert(AuditLog).values(
            at=time.time(), actor=actor, action=action, before=before, after=after
        )
    )


def create_pin(
    conn: Connection, candidates: CandidateSet, pin: Pin, reason: str, actor: str
) -> PinRecord:
    """Pin a candidate shape (422 for a shape outside ``candidates``) and audit it."""
    if pin.shape not in candidates.shapes:
        allowed = " ".join(str(s) for s in candidates.shapes)
        raise ControlError(
            422,
            f"shape {pin.shape} is not in the candidate set of {candidates.describe()}: "
            f"pin one of {allowed}",
        )
    pin_id = conn.execute(
        insert(PinRow)
        .values(
            steps=pin.shape.steps,
            topk=pin.shape.topk,
            num_draft_tokens=pin.shape.num_draft_tokens,
            min_batch_size=pin.min_batch_size,
            max_batch_size=pin.max_batch_size,
            reason=reason,
            created_at=time.time(),
            created_by=actor,
        )
        .returning(PinRow.id)
    ).scalar_one()
    record = get_pin(conn, pin_id)
    assert record is not None
    audit(conn, actor, "pin.create", None, record.to_json())
    return record


def clear_pin(conn: Connection, pin_id: int, actor: str) -> PinRecord:
    """Clear an active pin (404 unknown, 409 already cleared) and audit it."""
    before = get_pin(conn, pin_id)
    if before is None:
        raise ControlError(404, f"unknown pin {pin_id}")
    if not before.active:
        raise ControlError(409, f"pin {pin_id} was already cleared by {before.cleared_by}")
    conn.execute(
        update(PinRow)
        .where(PinRow.id == pin_id, PinRow.cleared_at.is_(None))
        .values(cleared_at=time.time(), cleared_by=actor)
    )
    after = get_pin(conn, pin_id)
    assert after is not None
    audit(conn, actor, "pin.clear", before.to_json(), after.to_json())
    return after


def _deactivate_all(conn: Connection) -> None:
    conn.execute(update(Policy).where(Policy.active.is_(True)).values(active=False))


def activate_policy(
    conn: Connection, version: int, actor: str, action: str = "policy.activate"
) -> PolicyRecord:
    """Make ``version`` the only active policy version (404 unknown, 409 already active)."""
    target = get_policy(conn, version)
    if target is None:
        raise ControlError(404, f"unknown policy version {version}")
    current = active_version(conn)
    if target.active and current == version:
        raise ControlError(409, f"policy version {version} is already active")
    _deactivate_all(conn)
    conn.execute(
        update(Policy)
        .where(Policy.version == version)
        .values(active=True, activated_at=time.time(), activated_by=actor)
    )
    audit(conn, actor, action, {"active_version": current}, {"active_version": version})
    after = get_policy(conn, version)
    assert after is not None
    return after


def rollback_policy(conn: Connection, actor: str) -> PolicyRecord:
    """Re-activate the version activated most recently before the current one (409 if none)."""
    current = active_version(conn)
    earlier = select(Policy.version).where(Policy.activated_at.is_not(None))
    if current is not None:
        earlier = earlier.where(Policy.version != current)
    previous = conn.execute(
        earlier.order_by(Policy.activated_at.desc(), Policy.version.desc()).limit(1)
    ).scalar()
    if previous is None:
        raise ControlError(409, "no earlier activated policy version to roll back to")
    return activate_policy(conn, previous, actor, action="policy.rollback")


def add_policy_version(
    conn: Connection,
    *,
    artifact: bytes,
    feature_names: Sequence[str],
    training_rows: int,
    validation_metrics: dict[str, Any],
    activate: bool,
    actor: str,
) -> int:
    """Store a new policy version under the next number, active if ``activate`` (the others
    then are not); returns the version. The caller audits it with the job that made it. Raises
    ``IntegrityError`` if another writer took the same number first."""
    version = (conn.execute(select(func.max(Policy.version))).scalar() or 0) + 1
    now = time.time()
    if activate:
        _deactivate_all(conn)
    conn.execute(
        insert(Policy).values(
            version=version,
            created_at=now,
            artifact=artifact,
            feature_names=list(feature_names),
            training_rows=training_rows,
            validation_metrics=validation_metrics,
            active=activate,
            activated_at=now if activate else None,
            activated_by=actor if activate else None,
        )
    )
    return version
