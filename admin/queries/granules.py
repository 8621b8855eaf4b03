"""Ten-second sums of each run's steps, kept in the dashboard process and extended by row id.

Summing a million step rows takes SQLite one to three seconds on this machine, far past the
overview's 300 ms budget, so long ranges are not summed per request. Instead this cache holds,
per run, the ``sums.BucketSums`` of its steps in ``GRANULE_S`` buckets, and each request adds
only the rows inserted since the last one: rows with an id above the run's watermark (the
largest id already summed). Steps are never updated, so sums only grow.

Why the id watermark is safe: one writer thread writes each run's rows, one transaction after
another, so a run's rows become visible in id order on SQLite and PostgreSQL alike. The first
request for a run pays one full pass over it (about 2 s for a million rows here); later ones a
few milliseconds. Granules older than the run's oldest remaining step are pruned: retention has
rolled those steps into ``step_rollups``, which the overview reads instead.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from sglang_adatree.admin.queries.sums import BucketSums, bucket_index, combine, concat
from sqlalchemy import Connection, func, select

from sglang_adatree.telemetry.models import Step

GRANULE_S = 10.0
MAX_RUNS = 8  # runs kept; the least recently viewed is dropped first


@dataclass
class _RunGranules:
    watermark: int  # largest steps.id summed; 0 before the first pass
    sums: BucketSums  # sorted by start


class GranuleCache:
    """Per-run granule sums for one database; thread-safe (waitress serves from threads)."""

    def __init__(self, max_runs: int = MAX_RUNS) -> None:
        self.max_runs = max_runs
        self._lock = threading.Lock()
        self._runs: OrderedDict[int, _RunGranules] = OrderedDict()

    def sums(self, conn: Connection, run_id: int, start: float, end: float) -> BucketSums:
        """Granule sums of ``run_id`` with a start in ``[start - GRANULE_S, end]``, current as
        of this call."""
        with self._lock:
            entry = self._runs.pop(run_id, None) or _RunGranules(0, BucketSums.empty())
            self._runs[run_id] = entry
            while len(self._runs) > self.max_runs:
                self._runs.popitem(last=False)
            self._refresh(conn, run_id, entry)
            s = entry.sums
        keep = (s.start > start - GRANULE_S) & (s.start <= end)
        return s.select(keep)

    def _refresh(self, conn: Connection, run_id: int, entry: _RunGranules) -> None:
        granule = bucket_index(Step.wall_time, GRANULE_S, conn.dialect.name)
        shape = (Step.steps, Step.topk, Step.num_draft_tokens)
        if entry.watermark == 0:
            # First pass: the (run_id, ...) index finds this run's rows among all runs'.
            where = [Step.run_id == run_id]
        else:
            # Later passes: a primary-key range over the new rows only. ``run_id + 0`` keeps
            # SQLite from walking the run's whole index instead.
            where = [Step.id > entry.watermark, Step.run_id + 0 == run_id]
        stmt = (
            select(
                granule,
                *shape,
                func.count(),
                func.sum(Step.batch_size),
                func.max(Step.batch_size),
                func.sum(Step.measured_step_ms),
                func.sum(Step.measured_accept_len),
                func.sum(Step.emitted_tokens),
                func.max(Step.id),
            )
            .where(*where)
            .group_by(granule, *shape)
        )
        rows = conn.execute(stmt).all()
        if rows:
            entry.watermark = max(entry.watermark, max(int(r[-1]) for r in rows))
            new = BucketSums.from_rows([r[:-1] for r in rows], width=GRANULE_S)
            # New rows almost always land in the newest granules: re-merge only from there.
            old = entry.sums
            tail = old.start >= new.start.min()
            entry.sums = concat([old.select(~tail), combine(concat([old.select(tail), new]))])
        oldest = conn.execute(select(func.min(Step.wall_time)).where(Step.run_id == run_id))
        oldest_time = oldest.scalar()
        if oldest_time is not None and len(entry.sums):
            entry.sums = entry.sums.select(entry.sums.start > oldest_time - GRANULE_S)
