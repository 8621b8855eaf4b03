"""Benchmark the dashboard's overview over a million step rows (see admin.bench).

    python scripts/bench_admin.py                        # the full run: 1,000,000 rows
    python scripts/bench_admin.py --rows 20000 --requests 5   # a quick check

The last line is exactly:
admin: rows=<n> page_p95_ms=<ms> api_p95_ms=<ms> cold_ms=<ms> target_ms=300 <PASS|FAIL>
"""

from __future__ import annotations

import argparse

from admin.bench import run_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=None, help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="step rows to load")
    parser.add_argument("--requests", type=int, default=40, help="requests per range and endpoint")
    parser.add_argument("--steps-per-s", type=float, default=46.0, help="step rate of the run")
    args = parser.parse_args()
    r = run_bench(
        args.db, rows=args.rows, requests_per_case=args.requests, steps_per_s=args.steps_per_s
    )
    print(
        f"loaded {r.rows} step rows in {r.load_s:.1f} s; first page load (cold) {r.cold_ms:.0f} ms"
    )
    print(f"{'endpoint':<8} {'range':<5} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'n':>4}")
    for t in r.timings:
        print(
            f"{t.endpoint:<8} {t.range_name:<5} {t.p50_ms:8.1f} {t.p95_ms:8.1f} "
            f"{t.max_ms:8.1f} {t.requests:4d}"
        )
    print(r.last_line())


if __name__ == "__main__":
    main()
