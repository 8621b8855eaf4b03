"""Dashboard benchmark: the overview page and its API over a million step rows.

1. Load ``rows`` synthetic steps (``admin.synthetic``) into one run of a fresh SQLite file (or
   the given URL), at ``steps_per_s``; the default 46 steps/s makes a million rows six hours.
2. Serve the dashboard with waitress on a loopback port, as ``adatree admin`` does, and log in
   over HTTP like a browser.
3. Time the first page load (cold: Plotly's validators and the run's granule cache are built
   then), then ``requests`` alternating loads of the overview page and of
   ``/api/overview?figure=1`` (what the page's live refresh fetches) for every time range.
   A time is the whole request: connect, query, render, transfer.

``scripts/bench_admin.py`` is the command-line wrapper; its last line is
``admin: rows=<n> page_p95_ms=<ms> api_p95_ms=<ms> cold_ms=<ms> target_ms=300 <PASS|FAIL>``,
with the p95s the worst over the time ranges.
"""

from __future__ import annotations

import re
import shutil
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import waitress

from admin import create_app
from admin.queries.runs import RANGES
from admin.synthetic import synthetic_run
from sglang_adatree.telemetry import store

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
