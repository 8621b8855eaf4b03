"""Benchmark the dashboard's overview over a million step rows.

    python scripts/bench_admin.py                        # the full run: 1,000,000 rows
    python scripts/bench_admin.py --rows 20000 --requests 5   # a quick check

The last line is exactly:
admin: rows=<n> page_p95_ms=<ms> api_p95_ms=<ms> cold_ms=<ms> target_ms=300 <PASS|FAIL>

1. Load ``rows`` synthetic steps (``tests/synthetic_runs.py``) into one run of a fresh SQLite
   file (or the given URL), at ``steps_per_s``; the default 46 steps/s makes a million rows six
   hours.
2. Serve the dashboard with waitress on a loopback port, as ``adatree admin`` does, and log in
   over HTTP like a browser.
3. Time the first page load (cold: Plotly's validators and the run's granule cache are built
   then), then ``requests`` alternating loads of the overview page and of
   ``/api/overview?figure=1`` (what the page's live refresh fetches) for every time range.
   A time is the whole request: connect, query, render, transfer.
The p95s of the last line are the worst over the time ranges.
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import waitress
from sglang_adatree.admin import create_app
from sglang_adatree.admin.queries.runs import RANGES

from sglang_adatree.telemetry import store

# The suite's synthetic runs are this benchmark's data too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic_runs import synthetic_run

TARGET_P95_MS = 300.0
TOKEN = "bench-operator-token"


@dataclass(frozen=True)
class Timing:
    """Latencies of one endpoint and range, in ms."""

    endpoint: str  # "page" or "api"
    range_name: str
    p50_ms: float
    p95_ms: float
    max_ms: float
    requests: int


@dataclass(frozen=True)
class BenchResult:
    rows: int
    load_s: float  # generating and inserting the rows
    cold_ms: float  # the first page load
    timings: tuple[Timing, ...]

    def worst_p95(self, endpoint: str) -> float:
        return max(t.p95_ms for t in self.timings if t.endpoint == endpoint)

    def last_line(self) -> str:
        page, api = self.worst_p95("page"), self.worst_p95("api")
        verdict = "PASS" if max(page, api) <= TARGET_P95_MS else "FAIL"
        return (
            f"admin: rows={self.rows} page_p95_ms={page:.0f} api_p95_ms={api:.0f} "
            f"cold_ms={self.cold_ms:.0f} target_ms={TARGET_P95_MS:.0f} {verdict}"
        )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_in(base: str) -> requests.Session:
    session = requests.Session()
    page = session.get(f"{base}/login", timeout=30).text
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
    form = {"token": TOKEN, "name": "bench", "csrf_token": csrf}
    response = session.post(f"{base}/login", data=form, timeout=30, allow_redirects=False)
    response.raise_for_status()
    return session


def _timed_get(session: requests.Session, url: str) -> float:
    start = time.perf_counter()
    response = session.get(url, timeout=120)
    response.raise_for_status()
    return (time.perf_counter() - start) * 1000.0


def run_bench(
    url: str | None = None,
    rows: int = 1_000_000,
    requests_per_case: int = 40,
    steps_per_s: float = 46.0,
    threads: int = 4,
) -> BenchResult:
    """Load the rows, serve, measure (see the module docstring)."""
    tmp = None
    if url is None:
        tmp = Path(tempfile.mkdtemp(prefix="adatree-admin-bench-"))
        url = f"sqlite:///{tmp / 'bench.sqlite'}"
    server = None
    try:
        store.upgrade(url)
        start = time.perf_counter()
        synthetic_run(store.get_engine(url), rows, steps_per_s=steps_per_s, seed=1)
        load_s = time.perf_counter() - start
        app = create_app({"ADATREE_ADMIN_TOKEN": TOKEN, "ADATREE_DB_URL": url})
        port = _free_port()
        server = waitress.create_server(app, host="127.0.0.1", port=port, threads=threads)
        threading.Thread(target=server.run, name="bench-waitress", daemon=True).start()
        base = f"http://127.0.0.1:{port}"
        session = _log_in(base)
        cold_ms = _timed_get(session, f"{base}/")
        timings = []
        for name in RANGES:
            page, api = [], []
            for _ in range(requests_per_case):
                page.append(_timed_get(session, f"{base}/?range={name}"))
                api.append(_timed_get(session, f"{base}/api/overview?range={name}&figure=1"))
            for endpoint, values in (("page", page), ("api", api)):
                timings.append(
                    Timing(
                        endpoint=endpoint,
                        range_name=name,
                        p50_ms=statistics.median(values),
                        p95_ms=_percentile(values, 0.95),
                        max_ms=max(values),
                        requests=len(values),
                    )
                )
        session.close()
        return BenchResult(rows=rows, load_s=load_s, cold_ms=cold_ms, timings=tuple(timings))
    finally:
        if server is not None:
            # Let the worker threads finish before the sockets close under them.
            server.task_dispatcher.shutdown()
            server.close()
        store.get_engine(url).dispose()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


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
