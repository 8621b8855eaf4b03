"""Benchmark the telemetry writer as a decode loop drives it (see sglang_adatree.telemetry.bench).

    python scripts/bench_telemetry.py                 # the full run: 60 s at 1,000 steps/s
    python scripts/bench_telemetry.py --seconds 2 --flood-seconds 2   # a quick check

The last line is exactly: telemetry: rows_per_s=<n> enqueue_p99_us=<us> dropped=<n>
"""

from __future__ import annotations

import argparse
import logging

from sglang_adatree.telemetry.bench import run_bench


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
        f"max {r.enqueue_max_us:.1f} us"
    )
    print(
        f"flood: {r.flood_rows} rows in {r.flood_s:.2f} s using {r.flood_cpu_s:.2f} s of CPU "
        f"({r.flood_rows / r.flood_cpu_s:.0f} rows per CPU second)"
    )
    print(r.last_line())


if __name__ == "__main__":
    main()
