"""Operator changes: pin / clear a shape, activate / roll back a policy version, request a
retrain. Each writes its change and one ``audit_log`` entry (actor, time, action, before and
after) in the caller's transaction, so both land or neither does.

The serving worker polls pins and the active version at most every second (``control_poll_s``):
a pin row with ``cleared_at`` NULL is active, the newest covering pin wins, and the highest
active policy version is loaded. Refusals raise ``AdminError`` with a 4xx status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, insert, select, update

from admin.errors import AdminError
from admin.queries import control
from admin.queries.runs import CandidateSet
from sglang_adatree import policy, retrain
from sglang_adatree.shapes import TreeShape
from sglang_adatree.telemetry.models import AuditLog, Pin, Policy


@dataclass(frozen=True)
class PinRequest:
    """A shape to pin for batches of ``min_batch_size..max_batch_size`` (None: unbounded)."""

    shape: TreeShape
    min_batch_size: int | None
    max_batch_size: int | None
    reason: str


def audit(
    conn: Connection,
    actor: str,
    action: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    conn.execute(
        insert(AuditLog).values(
            at=time.time(), actor=actor, action=action, before=before, after=after
        )
    )


def create_pin(
    conn: Connection, candidates: CandidateSet, req: PinRequest, actor: str
) -> control.PinView:
    """Pin a candidate shape; refuses shapes outside the candidate set (422)."""
    if req.shape not in candidates.shapes:
        allowed = " ".join(str(s) for s in candidates.shapes)
        raise AdminError(
            422,
            f"shape {req.shape} is not in the candidate set of {candidates.describe()}: "
            f"pin one of {allowed}",
        )
    try:
        # The serving policy's own rules for a pin (bounds >= 1, min <= max).
        policy.Pin(req.shape, req.min_batch_size, req.max_batch_size)
    except ValueError as exc:
        raise AdminError(400, str(exc)) from None
    pin_id = conn.execute(
        insert(Pin)
        .values(
            steps=req.shape.steps,
            topk=req.shape.topk,
            num_draft_tokens=req.shape.num_draft_tokens,
            min_batch_size=req.min_batch_size,
            max_batch_size=req.max_batch_size,
            reason=req.reason,
            created_at=time.time(),
            created_by=actor,
        )
        .returning(Pin.id)
    ).scalar_one()
    pin = control.get_pin(conn, pin_id)
    assert pin is not None
    audit(conn, actor, "pin.create", None, pin.to_json())
    return pin


def clear_pin(conn: Connection, pin_id: int, actor: str) -> control.PinView:
    """Clear an active pin (404 unknown, 409 already cleared)."""
    before = control.get_pin(conn, pin_id)
    if before is None:
        raise AdminError(404, f"unknown pin {pin_id}")
    if not before.active:
        raise AdminError(409, f"pin {pin_id} was already cleared by {before.cleared_by}")
    conn.execute(
        update(Pin)
        .where(Pin.id == pin_id, Pin.cleared_at.is_(None))
        .values(cleared_at=time.time(), cleared_by=actor)
    )
    after = control.get_pin(conn, pin_id)
    assert after is not None
    audit(conn, actor, "pin.clear", before.to_json(), after.to_json())
    return after


def activate_policy(
    conn: Connection, version: int, actor: str, action: str = "policy.activate"
) -> control.PolicyView:
    """Make ``version`` the only active policy version (404 unknown, 409 already active)."""
    target = control.get_policy(conn, version)
    if target is None:
        raise AdminError(404, f"unknown policy version {version}")
    current = control.active_version(conn)
    if target.active and current == version:
        raise AdminError(409, f"policy version {version} is already active")
    conn.execute(update(Policy).where(Policy.active.is_(True)).values(active=False))
    conn.execute(
        update(Policy)
        .where(Policy.version == version)
        .values(active=True, activated_at=time.time(), activated_by=actor)
    )
    audit(conn, actor, action, {"active_version": current}, {"active_version": version})
    after = control.get_policy(conn, version)
    assert after is not None
    return after


def rollback_policy(conn: Connection, actor: str) -> control.PolicyView:
    """Re-activate the version activated most recently before the current one (409 if none)."""
    current = control.active_version(conn)
    earlier = select(Policy.version).where(Policy.activated_at.is_not(None))
    if current is not None:
        earlier = earlier.where(Policy.version != current)
    previous = conn.execute(
        earlier.order_by(Policy.activated_at.desc(), Policy.version.desc()).limit(1)
    ).scalar()
    if previous is None:
        raise AdminError(409, "no earlier activated policy version to roll back to")
    return activate_policy(conn, previous, actor, action="policy.rollback")


def request_retrain(engine: Engine, options: retrain.RetrainOptions, actor: str) -> int:
    """Queue a retrain job (audited by ``retrain.create_job``); 409 while another is pending."""
    try:
        return retrain.create_job(engine, actor, options)
    except retrain.JobConflict as exc:
        raise AdminError(409, str(exc)) from None
