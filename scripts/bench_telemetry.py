"""Benchmark the telemetry writer as a decode loop drives it.

    python scripts/bench_telemetry.py                 # the full run: 60 s at 1,000 steps/s
    python scripts/bench_telemetry.py --seconds 2 --flood-seconds 2   # a quick check
    python scripts/bench_telemetry.py --seconds 30 --rate 25 --flood-seconds 1   # a served c1

The last line is exactly: telemetry: rows_per_s=<n> enqueue_p99_us=<us> dropped=<n>

Two phases on one database (a fresh SQLite file unless a URL is given):

1. paced: ``rate`` steps per second for ``seconds``, one ``StepRecord`` per step, each
   ``record()`` call timed; reports the enqueue latency percentiles, the records dropped and
   the process's CPU time per second (the writer thread's, in a server taken from the decode
   loop's cores). Every recorded step must then be in the database.
2. flood: a producer records as fast as it can for ``flood_seconds`` (yielding while the queue
   is more than half full, so that no record is dropped and the writer is the bottleneck); the
   sustained rate is rows committed / time from the first record to the last commit. The
   producer cycles through records built beforehand, so the figure is the writer's rate, not
   the cost of building records.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from sglang_adatree import __version__
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.records import RunRecord
from sglang_adatree.telemetry.writer import TelemetryWriter

# The suite's plausible step records are this benchmark's load too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from step_records import make_step

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
    paced_cpu_ms_per_s: float  # CPU time of the whole process (producer + writer), paced phase
    flood_rows: int
    flood_s: float
    flood_cpu_s: float  # CPU time of the whole process (producer + writer) during the flood

    def last_line(self) -> str:
        return (
            f"telemetry: rows_per_s={self.rows_per_s:.0f} "
            f"enqueue_p99_us={self.enqueue_p99_us:.2f} dropped={self.dropped}"
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
    cpu_start = time.process_time()
    start = time.perf_counter()
    for i in range(n):
        rec = make_step(run_id, i)
        t0 = time.perf_counter_ns()
        writer.record(rec)
        latencies[i] = (time.perf_counter_ns() - t0) / 1000.0
        wait = start + (i + 1) / rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
    cpu_ms_per_s = (time.process_time() - cpu_start) * 1000.0 / (time.perf_counter() - start)
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
        "paced_cpu_ms_per_s": cpu_ms_per_s,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=None, help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--seconds", type=float, default=60.0, help="paced phase length")
    parser.add_argument("--rate", type=float, default=1000.0, help="paced steps per second")
    parser.add_argument("--flood-seconds", type=float, default=10.0, help="flood phase length")
    parser.add_argument("--queue-size", type=int, default=65536)
    parser.add_argument("--batch-size", type=int, default=2048)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    r = run_bench(
        args.db,
        seconds=args.seconds,
        rate=args.rate,
        flood_seconds=args.flood_seconds,
        queue_size=args.queue_size,
        batch_size=args.batch_size,
    )
    print(
        f"paced: {r.paced_steps} steps at {args.rate:g}/s, {r.paced_rows_in_db} rows in the "
        f"database; record() p50 {r.enqueue_p50_us:.2f} us, p99 {r.enqueue_p99_us:.2f} us, "
        f"max {r.enqueue_max_us:.1f} us; {r.paced_cpu_ms_per_s:.2f} ms of CPU a second"
    )
    print(
        f"flood: {r.flood_rows} rows in {r.flood_s:.2f} s using {r.flood_cpu_s:.2f} s of CPU "
        f"({r.flood_rows / r.flood_cpu_s:.0f} rows per CPU second)"
    )
    print(r.last_line())


if __name__ == "__main__":
    main()
