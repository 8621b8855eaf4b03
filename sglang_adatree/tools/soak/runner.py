"""One soak, start to end: the servers, the reference answers, the activities on their
schedules, the wrap-up and the report (``report``).

Order: the reference ``ar`` server, the adatree server and the dashboard start side by side;
the reference answers the fixed greedy prompts (once: greedy answers do not change), its memory
is measured per process, and it is stopped, so only the adatree server serves during the soak.
Then, for ``minutes``: the load generator, the operator's pin cycles, retrain jobs, bad
requests, the database faults and the browser, each on a thread of its own, while the main
thread watches the server's process (a crash ends the soak early and is reported). At the end
the load stops, pins are cleared, the writer drains, and the records are read.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from sglang_adatree.tools.soak import memory, report
from sglang_adatree.tools.soak.activities import (
    Activities,
    FaultLog,
    after_faults,
    fault_events,
    times,
)
from sglang_adatree.tools.soak.bad_requests import BadRequestTally
from sglang_adatree.tools.soak.browser import DashboardBrowser
from sglang_adatree.tools.soak.faults import DatabaseFaults, PostgresFaults, SqliteFaults
from sglang_adatree.tools.soak.load import LoadGenerator, chat_texts, greedy_ids
from sglang_adatree.tools.soak.operator_client import DashboardClient, Operator
from sglang_adatree.tools.soak.schedule import Schedule
from sglang_adatree.tools.soak.servers import Process, ServerPlan, start_dashboard
from sglang_adatree.tools.soak.tally import DashboardLog, GreedyAnswers, SoakClock

DRAIN_TIMEOUT_S = 120.0
NUM_LOAD_PROMPTS = 40
REFERENCE_NOTE = (
    "SGLang without speculation, launched as adatree bench's ar: the same CPU path (attention "
    "backend, packed weight copies), so the difference is the draft, the per-shape runtime "
    "state and adatree's controller, telemetry and threads"
)


@dataclass(frozen=True)
class SoakOptions:
    minutes: float
    db: str | None = None  # None: a fresh SQLite file; "postgresql": a cluster of its own; URL
    work_dir: Path | None = None
    draft: str = "eagle"  # the bundled draft: eagle | standalone
    threads: int = 1  # OMP threads per server: spinning threads on a shared CPU cost more
    greedy_prompts: int = 8
    min_retrain_rows: int = 50
    rss_slope_limit: float = 1.0  # MB per minute after warm-up
    browser: bool = True
    control_poll_s: float = 1.0


@dataclass
class Database:
    url: str
    kind: str  # sqlite | postgresql
    faults: DatabaseFaults | None
    skipped_faults: str | None = None
    cluster: Any = None  # tools.postgres.PostgresServer the soak started


def _database(options: SoakOptions, work: Path) -> Database:
    from sglang_adatree.telemetry.store import sqlite_path, upgrade

    if options.db is None:
        url = f"sqlite:///{work / 'soak.sqlite'}"
    elif options.db == "postgresql":
        from sglang_adatree.tools.postgres import PostgresServer

        cluster = PostgresServer.find()
        if cluster is None:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql (apt postgresql)")
        cluster.start()
        url = cluster.create_database()
        upgrade(url)
        return Database(url, "postgresql", PostgresFaults(cluster), cluster=cluster)
    else:
        url = options.db
    upgrade(url)
    path = sqlite_path(url)
    if path is not None:
        return Database(url, "sqlite", SqliteFaults(path))
    return Database(
        url,
        "postgresql",
        None,
        skipped_faults="a PostgreSQL the soak did not start is not stopped: pass --db "
        "postgresql to soak against a cluster of its own",
    )


def _state(url: str) -> dict[str, Any]:
    response = requests.get(f"{url}/server_info", timeout=60)
    response.raise_for_status()
    return (response.json().get("internal_states") or [{}])[0]


def _drain(url: str) -> dict[str, Any]:
    """``/server_info`` once the writer has nothing queued and the step count stood still."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    last = None
    while True:
        state = _state(url)
        steady = last is not None and last["adatree_steps"] == state["adatree_steps"]
        if steady and not state.get("adatree_telemetry_queued"):
            return state
        if time.monotonic() > deadline:
            return state
        last = state
        time.sleep(1.0)


def run_soak(options: SoakOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run one soak and return its report (see ``report`` and ``docs/usage.md``)."""
    from sglang_adatree.config import load_config
    from sglang_adatree.models.paths import ModelPaths
    from sglang_adatree.models.prepare import prepare_all
    from sglang_adatree.telemetry.store import display_url
    from sglang_adatree.tools.bench.workloads import load_workload

    started = time.monotonic()
    schedule = Schedule.for_minutes(options.minutes)
    config = load_config()
    paths = ModelPaths(config.home_dir)
    for line in prepare_all(paths):
        log(f"models: {line}")
    draft = paths.eagle_dir if options.draft == "eagle" else paths.standalone_dir
    work = options.work_dir or Path(tempfile.mkdtemp(prefix="adatree-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    db = _database(options, work)
    log(f"soak: {options.minutes:g} min, telemetry {display_url(db.url)}, work dir {work}")
    token = secrets.token_urlsafe(18)
    load_texts = chat_texts(
        str(paths.target_dir), load_workload("mtbench", NUM_LOAD_PROMPTS, seed=0).prompts
    )
    greedy_texts = chat_texts(
        str(paths.target_dir), load_workload("gsm8k", options.greedy_prompts, seed=0).prompts
    )
    plan = ServerPlan.for_models(
        paths.target_dir, draft, options.threads, ";".join(map(str, config.candidate_shapes))
    )
    result: dict[str, Any] = {}
    with ExitStack() as stack:
        # Callbacks run last-in first-out: faults are healed before the cluster is removed.
        if db.cluster is not None:
            stack.callback(db.cluster.close)
        if db.faults is not None:
            stack.callback(db.faults.heal)
        env = {"ADATREE_CONTROL_POLL_S": str(options.control_poll_s)}
        reference = plan.start("ar", work, None, {})
        stack.callback(reference.stop)
        server = plan.start("adatree", work, db.url, env)
        stack.callback(server.stop)
        dashboard = start_dashboard(db.url, token, work)
        stack.callback(dashboard.stop)
        t0 = time.monotonic()
        reference.wait_ready()
        answers = greedy_ids(reference.url, greedy_texts)
        reference_memory = memory.per_process(reference.process.pid)
        reference.stop()
        log(f"soak: reference answers for {len(answers)} greedy prompts")
        server.wait_ready()
        dashboard.wait_ready(120.0)
        servers_s = time.monotonic() - t0
        log(f"soak: servers ready after {servers_s:.0f} s; soaking")
        greedy = GreedyAnswers(greedy_texts, tuple(answers))
        result = _soak(options, schedule, db, server, dashboard.url, token, load_texts, greedy)
        result["memory"] = memory.comparison(result.pop("adatree_memory"), reference_memory)
        result["memory"]["reference"] = REFERENCE_NOTE
        result["soak"] |= {
            "db": display_url(db.url),
            "db_kind": db.kind,
            "work_dir": str(work),
            "target": str(paths.target_dir),
            "draft": str(draft),
            "servers_start_s": round(servers_s, 1),
        }
    result["soak"]["wall_s"] = round(time.monotonic() - started, 1)
    result["checks"] = report.checks(result, options.rss_slope_limit)
    result["passed"] = all(result["checks"].values())
    return result


def _soak(
    options: SoakOptions,
    schedule: Schedule,
    db: Database,
    server: Process,
    admin_url: str,
    token: str,
    load_texts: tuple[str, ...],
    greedy: GreedyAnswers,
) -> dict[str, Any]:
    clock = SoakClock()
    stop = threading.Event()
    dashboard_log = DashboardLog()
    run_id = _state(server.url)["adatree_run_id"]
    client = DashboardClient(admin_url, token, dashboard_log, clock)
    candidates = client.get("/api/pins").json()["candidates"]["shapes"]
    operator = Operator(client, server.url, candidates, load_texts[0])
    load = LoadGenerator(server.url, schedule, load_texts, greedy, clock)
    bad = BadRequestTally()
    rss = memory.RssSampler(server.process.pid, clock, schedule.rss_every_s)
    rss.start()
    browser = None
    browser_skipped = DashboardBrowser.available() if options.browser else "--no-browser"
    if browser_skipped is None:
        reload_s = schedule.browser_reload_s
        browser = DashboardBrowser(admin_url, token, dashboard_log, clock, reload_s)
        browser.start()

    end = schedule.seconds
    activities = Activities(clock, stop)
    faults = FaultLog()
    if db.faults is not None:
        activities.at("faults", fault_events(db.faults, schedule, clock, faults))
    # A pin cycle: pin a shape, change it a third of a cycle later, clear it after another.
    cycle = schedule.pin_cycle_s
    pin_times = times(cycle / 3, cycle / 3, end - 5.0)
    activities.at(
        "pins",
        [(t, operator.clear if i % 3 == 2 else operator.pin_next) for i, t in enumerate(pin_times)],
    )
    # Every other retrain is forced: its version goes live whatever its validation says, so
    # every soak swaps the server's cost model under load (the server's own judgement may keep
    # the analytic one for a whole soak).
    every = schedule.retrain_every_s
    retrains = [after_faults(t, schedule) for t in times(every / 2, every, end - 30.0)]
    activities.at(
        "retrain",
        [
            (t, lambda force=i % 2 == 0: operator.retrain(options.min_retrain_rows, force))
            for i, t in enumerate(retrains)
        ],
    )
    every = schedule.bad_requests_every_s
    activities.every("bad-requests", times(every / 4, every, end), lambda: bad.round(server.url))
    load_thread = threading.Thread(target=load.run, args=(stop,), name="soak-load", daemon=True)
    load_thread.start()

    crashed = False
    while clock.now() < end and not crashed:
        crashed = not server.alive()
        time.sleep(1.0)
    stop.set()
    load_thread.join(timeout=660)
    activities.join(timeout=120)
    if db.faults is not None:
        db.faults.heal()  # a soak cut short inside a fault window
    if browser is not None:
        browser.stop()
    rss.stop()

    observed = report.Observations(
        clock=clock,
        schedule=schedule,
        server_crashes=int(crashed),
        requests=load.tally,
        greedy=greedy,
        bad_requests=bad,
        dashboard=dashboard_log.snapshot(),
        browser=browser,
        browser_skipped=browser_skipped,
        rss=rss,
        operator=operator.log,
        faults=faults,
        faults_skipped=db.skipped_faults,
        errors=activities.errors,
    )
    if crashed:
        return report.assemble(observed)
    operator.clear_all()
    state = _drain(server.url)
    return report.assemble(
        observed,
        state=state,
        accounting=report.telemetry_accounting(db.url, run_id, state),
        pins=report.pin_outcomes(db.url, run_id, operator.log.pins, options.control_poll_s),
        adatree_memory=memory.per_process(server.process.pid),
    )
