"""Telemetry writer benchmark: drives a ``TelemetryWriter`` as a decode loop would.

Two phases on one database (a fresh SQLite file unless a URL is given):

1. paced: ``rate`` steps per second for ``seconds``, one ``StepRecord`` per step, each
   ``record()`` call timed; reports the enqueue latency percentiles and the records dropped.
   Every recorded step must then be in the database.
2. flood: a producer records as fast as it can for ``flood_seconds`` (yielding while the queue
   is more than half full, so that no record is dropped and the writer is the bottleneck); the
   sustained rate is rows committed / time from the first record to the last commit. The
   producer cycles through records built beforehand, so the figure is the writer's rate, not
   the cost of building records.

``scripts/bench_telemetry.py`` is the command-line wrapper; its last line is
``telemetry: rows_per_s=<n> enqueue_p99_us=<us> dropped=<n>``.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from sglang_adatree import __version__
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.records import RunRecord, StepRecord
from sglang_adatree.telemetry.writer import TelemetryWriter

# (steps, topk, num_draft_tokens) cycled through, as an adaptive policy would switch shapes.
SHAPES = ((0, 1, 1), (3, 1, 4), (3, 2, 6), (4, 2, 8), (5, 4, 16))
SOURCES = ("model", "model", "model", "explore", "pin")
FLOOD_POOL = 10_000


@dataclass(frozen=True)
class BenchResult:
    rows_per_s: float  # flood phase: rows committed per second
    enqueue_p50_us: float  # paced phase: record() latency
    enqueue_p99_us: float
    enqueue_max_us: float
    dropped: int  # paced phase
    paced_steps: int
    paced_rows_in_db: int
    flood_rows: int
    flood_s: float
    flood_cpu_s: float  # CPU time of the whole process (producer + writer) during the flood

    def last_line(self) -> str:
        return (
            f"telemetry: rows_per_s={self.rows_per_s:.0f} "
            f"enqueue_p99_us={self.enqueue_p99_us:.2f} dropped={self.dropped}"
        )


def make_step(run_id: int, i: int) -> StepRecord:
    """A plausible step record; values vary with ``i`` like a real run's."""
    steps, topk, num_draft_tokens = SHAPES[i % len(SHAPES)]
    batch_size = 1 + (i * 7) % 32
    accepted = min(steps, 1 + i % 3) * batch_size if steps else 0
    emitted = accepted + batch_size
    step_ms = 8.0 + 0.25 * batch_size + 0.5 * num_draft_tokens
    depth = tuple(accepted // steps for _ in range(steps)) if steps else ()
    return StepRecord(
        run_id=run_id,
        step_index=i,
        wall_time=time.time(),
        batch_size=batch_size,
        sum_context_len=batch_size * (300 + i % 700),
        max_context_len=300 + i % 1500,
        prefill_tokens=0 if i % 10 else 512,
        steps=steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        decision_source=SOURCES[i % len(SOURCES)],
        policy_version=3,
        predicted_step_ms=step_ms * 0.97,
        measured_step_ms=step_ms,
        predicted_accept_len=emitted / batch_size * 1.02,
        measured_accept_len=emitted / batch_size,
        emitted_tokens=emitted,
        drafted_tokens=(num_draft_tokens - 1) * batch_size,
        accepted_tokens=accepted,
        goodput=emitted / step_ms * 1000.0,
        accepted_by_depth=depth,
        accepted_by_rank=(accepted,) if steps else (),
    )


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_bench(
    url: str | None = None,
    seconds: float = 60.0,
    rate: float = 1000.0,
    flood_seconds: float = 10.0,
    queue_size: int = 65536,
    batch_size: int = 2048,
    flush_s: float = 0.5,
) -> BenchResult:
    """Run both phases (see the module docstring) and return their figures."""
    tmp = None
    if url is None:
        tmp = Path(tempfile.mkdtemp(prefix="adatree-bench-"))
        url = f"sqlite:///{tmp / 'bench.sqlite'}"
    try:
        store.upgrade(url)
        with TelemetryWriter(
            url, queue_size=queue_size, batch_size=batch_size, flush_s=flush_s
        ) as writer:
            run = RunRecord("bench-target", "bench-draft", "cpu", None, __version__)
            paced = _paced(writer, writer.start_run(run), seconds, rate)
            flood_rows, flood_s, flood_cpu_s = _flood(writer, writer.start_run(run), flood_seconds)
        return BenchResult(
            rows_per_s=flood_rows / flood_s,
            flood_rows=flood_rows,
            flood_s=flood_s,
            flood_cpu_s=flood_cpu_s,
            **paced,
        )
    finally:
        store.get_engine(url).dispose()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _paced(writer: TelemetryWriter, run_id: int, seconds: float, rate: float) -> dict[str, Any]:
    n = int(seconds * rate)
    latencies = [0.0] * n
    dropped_before = writer.stats().dropped
    start = time.perf_counter()
    for i in range(n):
        rec = make_step(run_id, i)
        t0 = time.perf_counter_ns()
        writer.record(rec)
        latencies[i] = (time.perf_counter_ns() - t0) / 1000.0
        wait = start + (i + 1) / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
    if not writer.flush(60.0):
        raise RuntimeError("the writer did not catch up within 60 s")
    with store.session_scope(writer.engine) as session:
        in_db = session.scalar(select(func.count()).where(Step.run_id == run_id))
    latencies.sort()
    return {
        "enqueue_p50_us": statistics.median(latencies),
        "enqueue_p99_us": _percentile(latencies, 0.99),
        "enqueue_max_us": latencies[-1],
        "dropped": writer.stats().dropped - dropped_before,
        "paced_steps": n,
        "paced_rows_in_db": int(in_db or 0),
    }


def _flood(writer: TelemetryWriter, run_id: int, seconds: float) -> tuple[int, float, float]:
    pool = [make_step(run_id, i) for i in range(FLOOD_POOL)]
    half = writer.queue_size // 2
    cpu_start = time.process_time()
    start = time.perf_counter()
    i = 0
    while time.perf_counter() - start < seconds:
        if writer.queued > half:
            time.sleep(0.001)
            continue
        writer.record(pool[i % FLOOD_POOL])
        i += 1
    if not writer.flush(120.0):
        raise RuntimeError("the writer did not catch up within 120 s")
    return i, time.perf_counter() - start, time.process_time() - cpu_start
