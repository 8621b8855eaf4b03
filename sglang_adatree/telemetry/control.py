"""What operators control, read from the store: active pins and the active policy version.

The serving worker polls ``read_control_state`` (at most every ``control_poll_s``, off the decode
loop) and applies the result at a step boundary. The policy artifact is read only when the
active version differs from the one the caller already has, so a poll is two small indexed
queries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, select

from sglang_adatree.shapes import ShapeError, TreeShape
from sglang_adatree.telemetry.models import Pin, Policy
from sglang_adatree.telemetry.store import get_engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivePin:
    """A pinned shape for batches of ``min_batch_size..max_batch_size`` (``None``: unbounded)."""

    id: int
    shape: TreeShape
    min_batch_size: int | None
    max_batch_size: int | None
    reason: str
    created_at: float
    created_by: str

    def covers(self, batch_size: int) -> bool:
        low_ok = self.min_batch_size is None or batch_size >= self.min_batch_size
        return low_ok and (self.max_batch_size is None or batch_size <= self.max_batch_size)


@dataclass(frozen=True)
class ActivePolicy:
    """The active policy version with its artifact (cost model + acceptance prior)."""

    version: int
    artifact: bytes
    feature_names: tuple[str, ...]
    validation_metrics: dict[str, Any]


@dataclass(frozen=True)
class ControlState:
    """Pins newest first; ``policy`` is ``None`` when unchanged since ``known_policy_version``
    (or when no version is active)."""

    pins: tuple[ActivePin, ...]
    active_policy_version: int | None
    policy: ActivePolicy | None

    def pin_for(self, batch_size: int) -> TreeShape | None:
        """The shape pinned for this batch size: the newest pin that covers it, if any."""
        for pin in self.pins:
            if pin.covers(batch_size):
                return pin.shape
        return None


def read_control_state(db: str | Engine, known_policy_version: int | None = None) -> ControlState:
    """Active (uncleared) pins and the active policy version, in one read transaction."""
    engine = db if isinstance(db, Engine) else get_engine(db)
    with engine.connect() as conn:
        newest_first = (Pin.created_at.desc(), Pin.id.desc())
        pin_rows = conn.execute(
            select(Pin).where(Pin.cleared_at.is_(None)).order_by(*newest_first)
        ).all()
        version = conn.execute(
            select(Policy.version).where(Policy.active.is_(True)).order_by(Policy.version.desc())
        ).scalar()
        policy = None
        if version is not None and version != known_policy_version:
            row = conn.execute(select(Policy).where(Policy.version == version)).one()
            policy = ActivePolicy(
                version=row.version,
                artifact=row.artifact,
                feature_names=tuple(row.feature_names),
                validation_metrics=dict(row.validation_metrics),
            )
    pins = []
    for row in pin_rows:
        try:
            shape = TreeShape(row.steps, row.topk, row.num_draft_tokens)
        except ShapeError as exc:
            # The dashboard validates pins; a row written some other way must not stop serving.
            log.error("telemetry: ignoring pin %s: %s", row.id, exc)
            continue
        pins.append(
            ActivePin(
                id=row.id,
                shape=shape,
                min_batch_size=row.min_batch_size,
                max_batch_size=row.max_batch_size,
                reason=row.reason,
                created_at=row.created_at,
                created_by=row.created_by,
            )
        )
    return ControlState(pins=tuple(pins), active_policy_version=version, policy=policy)
