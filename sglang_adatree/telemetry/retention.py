"""Retention: per-step rows older than a configurable age become per-minute roll-ups.

``rollup(db, older_than_s)`` moves every ``steps`` row with ``wall_time`` before the cutoff
(rounded down to a whole minute, so no minute is split) into ``step_rollups``: one row per run,
minute and shape holding sums, so means over any longer range are exact (sum / ``num_steps``,
goodput as emitted tokens / summed step time). The dashboard's long-range views read these.

Each window of at most ``window_s`` seconds of one run is one transaction that deletes its step
rows with ``DELETE ... RETURNING`` and aggregates exactly the rows it deleted, so a row the writer
inserts late (after an outage) is either rolled up now or left for the next run, never lost;
a late row for a minute already rolled up is added to that minute's sums.
``adatree db rollup`` runs it once; a ``TelemetryWriter`` with ``retention_hours`` runs it
periodically on its own thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, Row, and_, delete, func, insert, select, update

from sglang_adatree.telemetry.models import Run, Step, StepRollup
from sglang_adatree.telemetry.records import decode_counts, encode_counts
from sglang_adatree.telemetry.store import get_engine

DEFAULT_WINDOW_S = 300.0

_ROLLED_COLUMNS = (
    Step.wall_time,
    Step.steps,
    Step.topk,
    Step.num_draft_tokens,
    Step.batch_size,
    Step.sum_context_len,
    Step.measured_step_ms,
    Step.predicted_step_ms,
    Step.measured_accept_len,
    Step.predicted_accept_len,
    Step.emitted_tokens,
    Step.drafted_tokens,
    Step.accepted_tokens,
    Step.accepted_by_depth,
    Step.accepted_by_rank,
    Step.decision_source,
)


@dataclass(frozen=True)
class RollupResult:
    cutoff: float  # unix seconds; steps before it were rolled up
    steps_rolled: int  # step rows deleted and aggregated
    rollups_written: int  # step_rollups rows inserted or updated


@dataclass
class _Sums:
    """Running sums for one (minute, shape); the column names of ``step_rollups``."""

    num_steps: int = 0
    sum_batch_size: int = 0
    max_batch_size: int = 0
    sum_context_len: int = 0
    sum_measured_step_ms: float = 0.0
    sum_predicted_step_ms: float = 0.0
    num_predicted: int = 0
    sum_measured_accept_len: float = 0.0
    sum_predicted_accept_len: float = 0.0
    emitted_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_by_depth: list[int] = field(default_factory=list)
    accepted_by_rank: list[int] = field(default_factory=list)
    decision_sources: dict[str, int] = field(default_factory=dict)

    def add_step(self, row: Row[Any]) -> None:
        self.num_steps += 1
        self.sum_batch_size += row.batch_size
        self.max_batch_size = max(self.max_batch_size, row.batch_size)
        self.sum_context_len += row.sum_context_len
        self.sum_measured_step_ms += row.measured_step_ms
        self.sum_measured_accept_len += row.measured_accept_len
        # Predictions come together (a model decision) or not at all (a pin may skip them).
        if row.predicted_step_ms is not None:
            self.num_predicted += 1
            self.sum_predicted_step_ms += row.predicted_step_ms
            self.sum_predicted_accept_len += row.predicted_accept_len or 0.0
        self.emitted_tokens += row.emitted_tokens
        self.drafted_tokens += row.drafted_tokens
        self.accepted_tokens += row.accepted_tokens
        _add_counts(self.accepted_by_depth, decode_counts(row.accepted_by_depth))
        _add_counts(self.accepted_by_rank, decode_counts(row.accepted_by_rank))
        source = row.decision_source
        self.decision_sources[source] = self.decision_sources.get(source, 0) + 1

    def add_rollup(self, row: Row[Any]) -> None:
        """Fold an existing roll-up of the same minute and shape into these sums."""
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(row, name))
        self.max_batch_size = max(self.max_batch_size, row.max_batch_size)
        _add_counts(self.accepted_by_depth, decode_counts(row.accepted_by_depth))
        _add_counts(self.accepted_by_rank, decode_counts(row.accepted_by_rank))
        for source, n in row.decision_sources.items():
            self.decision_sources[source] = self.decision_sources.get(source, 0) + n

    def values(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: getattr(self, name) for name in (*_SUMMED, "max_batch_size")}
        out["accepted_by_depth"] = encode_counts(self.accepted_by_depth)
        out["accepted_by_rank"] = encode_counts(self.accepted_by_rank)
        out["decision_sources"] = dict(sorted(self.decision_sources.items()))
        return out


_SUMMED = (
    "num_steps",
    "sum_batch_size",
    "sum_context_len",
    "sum_measured_step_ms",
    "sum_predicted_step_ms",
    "num_predicted",
    "sum_measured_accept_len",
    "sum_predicted_accept_len",
    "emitted_tokens",
    "drafted_tokens",
    "accepted_tokens",
)


def _add_counts(into: list[int], counts: Iterable[int]) -> None:
    for i, n in enumerate(counts):
        if i < len(into):
            into[i] += n
        else:
            into.append(n)


def rollup(
    db: str | Engine,
    older_than_s: float,
    now: float | None = None,
    window_s: float = DEFAULT_WINDOW_S,
) -> RollupResult:
    """Roll up every step row older than ``older_than_s`` seconds; see the module docstring."""
    assert older_than_s >= 0 and window_s >= 60 and window_s % 60 == 0
    engine = db if isinstance(db, Engine) else get_engine(db)
    now = time.time() if now is None else now
    cutoff = math.floor((now - older_than_s) / 60.0) * 60.0
    rolled = written = 0
    with engine.connect() as conn:
        run_ids = conn.execute(select(Run.id).order_by(Run.id)).scalars().all()
        for run_id in run_ids:
            start = _oldest_step(conn, run_id, cutoff)
            while start is not None:
                start = math.floor(start / 60.0) * 60.0
                end = min(start + window_s, cutoff)
                with conn.begin():
                    n_steps, n_rollups = _roll_window(conn, run_id, start, end)
                rolled += n_steps
                written += n_rollups
                start = _oldest_step(conn, run_id, cutoff)
    return RollupResult(cutoff=cutoff, steps_rolled=rolled, rollups_written=written)


def _oldest_step(conn: Connection, run_id: int, cutoff: float) -> float | None:
    stmt = select(func.min(Step.wall_time)).where(Step.run_id == run_id, Step.wall_time < cutoff)
    oldest = conn.execute(stmt).scalar()
    conn.commit()  # end the read's implicit transaction before the window's own
    return oldest


def _roll_window(conn: Connection, run_id: int, start: float, end: float) -> tuple[int, int]:
    """Delete one run's steps in ``[start, end)`` and fold them into that window's roll-ups."""
    deleted = conn.execute(
        delete(Step)
        .where(Step.run_id == run_id, Step.wall_time >= start, Step.wall_time < end)
        .returning(*_ROLLED_COLUMNS)
    ).all()
    sums: dict[tuple[float, int, int, int], _Sums] = {}
    for row in deleted:
        key = (math.floor(row.wall_time / 60.0) * 60.0, row.steps, row.topk, row.num_draft_tokens)
        sums.setdefault(key, _Sums()).add_step(row)
    in_window = and_(
        StepRollup.run_id == run_id, StepRollup.minute >= start, StepRollup.minute < end
    )
    existing = {
        (r.minute, r.steps, r.topk, r.num_draft_tokens): r
        for r in conn.execute(select(StepRollup).where(in_window)).all()
    }
    for key, s in sums.items():
        old = existing.get(key)
        if old is None:
            minute, steps, topk, num_draft_tokens = key
            shape = {"steps": steps, "topk": topk, "num_draft_tokens": num_draft_tokens}
            conn.execute(
                insert(StepRollup).values(run_id=run_id, minute=minute, **shape, **s.values())
            )
        else:
            s.add_rollup(old)
            conn.execute(update(StepRollup).where(StepRollup.id == old.id).values(s.values()))
    return len(deleted), len(sums)
