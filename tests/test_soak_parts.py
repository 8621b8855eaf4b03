"""The soak's parts without a server: its schedule at 3 and 30 minutes, the SQLite faults on a
real file (the dashboard answers 503 and then 200 again, no committed row lost), the pin rule,
dashboard errors inside and outside planned outages, the RSS slope, bad-request refusals, the
greedy comparison, and the report's checks."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from admin_helpers import TOKEN, log_in, seed_run
from sglang_adatree.admin import create_app
from sqlalchemy import func, insert, select

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import PinRow, Step
from sglang_adatree.tools.soak import bad_requests, memory, report
from sglang_adatree.tools.soak.activities import FaultLog, after_faults, fault_events, times
from sglang_adatree.tools.soak.faults import SqliteFaults
from sglang_adatree.tools.soak.operator_client import PinAction
from sglang_adatree.tools.soak.schedule import Phase, Schedule
from sglang_adatree.tools.soak.tally import DashboardResponse, GreedyAnswers


def test_the_30_minute_schedule_is_the_issues():
    s = Schedule.for_minutes(30)
    assert [(p.phase, p.seconds) for p in s.phases] == [
        (Phase.IDLE, 30.0),
        (Phase.BURST, 90.0),
        (Phase.POISSON, 120.0),
    ]
    assert (s.pin_cycle_s, s.retrain_every_s) == (60.0, 600.0)
    assert len(s.faults) == 1
    w = s.faults[0]
    assert (w.deleted_s - w.start_s, w.end_s - w.deleted_s) == (60.0, 30.0)
    assert s.burst_concurrency == 8 and s.abort_fraction == 0.1


def test_a_3_minute_schedule_keeps_every_activity_at_its_floor():
    s = Schedule.for_minutes(3)
    assert [p.seconds for p in s.phases] == [10.0, 20.0, 20.0]
    assert s.pin_cycle_s == 20.0 and s.retrain_every_s == 60.0
    (w,) = s.faults
    assert w.start_s == pytest.approx(63.0) and w.end_s == pytest.approx(83.0)
    assert s.phase_at(0.0)[0].phase is Phase.IDLE
    assert s.phase_at(15.0) == (s.phases[1], pytest.approx(15.0))
    assert s.phase_at(55.0)[0].phase is Phase.IDLE  # the cycle repeats


def test_an_hour_repeats_the_faults_every_30_minutes():
    s = Schedule.for_minutes(60)
    assert [w.start_s for w in s.faults] == [630.0, 2430.0]
    with pytest.raises(ValueError):
        Schedule.for_minutes(0)


@pytest.fixture
def private_db():
    """A migrated database with rows, in a directory the faults may make read-only."""
    root = Path(tempfile.mkdtemp(prefix="adatree-soak-faults-"))
    url = f"sqlite:///{root / 'soak.sqlite'}?timeout=0.2"
    store.upgrade(url)
    seed_run(url, 300, seed=3)
    yield url
    store.get_engine(url).dispose()
    shutil.rmtree(root, ignore_errors=True)


def _rows(url: str) -> int:
    with store.get_engine(url).connect() as conn:
        return conn.execute(select(func.count()).select_from(Step)).scalar_one()


def test_sqlite_read_only_deleted_and_restored_loses_nothing(private_db):
    url = private_db
    rows = _rows(url)
    operator = log_in(
        create_app(
            {"ADATREE_ADMIN_TOKEN": TOKEN, "ADATREE_DB_URL": url, "ADATREE_CONFIG": AdaTreeConfig()}
        ).test_client()
    )
    pin = {"shape": "3,1,4", "reason": "soak"}
    faults = SqliteFaults(store.sqlite_path(url))
    try:
        faults.read_only()
        assert operator.post_json("/api/pins", pin).status_code == 503
        faults.delete()
        assert not store.sqlite_path(url).exists()
        assert operator.get("/api/runs").status_code == 503
        faults.restore()
        assert operator.get("/api/runs").status_code == 200
        assert operator.post_json("/api/pins", pin).status_code == 201
    finally:
        faults.heal()
    assert _rows(url) == rows
    assert not faults.backup_dir.exists()


def test_heal_undoes_a_fault_left_half_done(private_db):
    path = store.sqlite_path(private_db)
    faults = SqliteFaults(path)
    faults.read_only()
    faults.delete()
    faults.heal()  # the soak was interrupted while the database was gone
    assert path.exists() and _rows(private_db) == 300
    path.unlink()  # and nothing is still immutable


def _row(t: float, shape: str, source: str, runner_up: str | None = None) -> SimpleNamespace:
    steps, topk, ndt = (int(x) for x in shape.split(","))
    return SimpleNamespace(
        wall_time=t,
        steps=steps,
        topk=topk,
        num_draft_tokens=ndt,
        decision_source=source,
        runner_up=runner_up,
    )


def test_a_pin_is_obeyed_within_a_poll_and_two_steps():
    pin = PinAction("3,1,4", posted_s=10.0, status=201, pin_id=1, created_at=1000.0)
    rows = [
        _row(1000.5, "0,1,1", "model"),  # before the poll could have read it
        _row(1001.6, "2,2,4", "model"),  # running when the pin was handed over
        _row(1001.9, "0,1,1", "catch-up"),
        _row(1002.0, "3,1,4", "pin"),
        _row(1002.1, "3,1,4", "pin"),
    ]
    out = report._pin_outcome(pin, rows, poll_s=1.0)
    assert out["obeyed"] and out["late_steps"] == 1
    assert out["first_pinned_step_after_s"] == 2.0


def test_a_pin_whose_window_closes_after_its_catch_up_is_obeyed():
    # The operator's next change came between the catch-up the pin needed first and the pinned
    # step after it (a soak's server paused there for 6 s): the catch-up stood in for the pin.
    pin = PinAction("3,1,4", posted_s=10.0, status=201, pin_id=1, created_at=1000.0)
    rows = [
        _row(1000.2, "0,1,1", "model"),  # before the poll could have read it
        _row(1000.6, "0,1,1", "catch-up", runner_up="3,1,4"),
    ]
    out = report._pin_outcome(pin, rows, poll_s=1.0)
    assert out["obeyed"] and out["late_steps"] == 0 and out["steps_not_obeying"] == 0
    assert out["first_pinned_step_after_s"] == 0.6
    # A catch-up for another shape is not this pin's, nor one followed by steps of another.
    other = [*rows[:1], _row(1000.6, "0,1,1", "catch-up", runner_up="2,2,4")]
    assert not report._pin_outcome(pin, other, poll_s=1.0)["obeyed"]
    ignored = [*rows, _row(1002.0, "2,2,4", "model")]
    assert not report._pin_outcome(pin, ignored, poll_s=1.0)["obeyed"]


def test_a_pin_ignored_for_steps_or_broken_later_is_not_obeyed():
    pin = PinAction("3,1,4", posted_s=10.0, status=201, pin_id=1, created_at=1000.0)
    late = [_row(1002.0 + 0.1 * i, "2,2,4", "model") for i in range(3)]
    out = report._pin_outcome(pin, [*late, _row(1003.0, "3,1,4", "pin")], poll_s=1.0)
    assert not out["obeyed"] and out["late_steps"] == 3
    broken = [_row(1001.0, "3,1,4", "pin"), _row(1001.1, "2,2,4", "explore")]
    out = report._pin_outcome(pin, broken, poll_s=1.0)
    assert not out["obeyed"] and out["steps_not_obeying"] == 1
    assert not report._pin_outcome(pin, [], poll_s=1.0)["obeyed"]


def test_pin_windows_come_from_the_database_clock_not_the_soaks(private_db):
    # The system clock stepped 42 s forward in a soak: pins posted at soak times 20 s apart were
    # stamped 62 s apart. Each window must come from the stamps (a change ends a pin when its
    # successor is created, a clear when it is cleared), whatever the soak's own times say.
    run_id = seed_run(private_db, 1, seed=4, end_time=1000.0)
    t0 = 2_000.0
    made = [("3,1,4", t0, t0 + 62.0), ("2,2,4", t0 + 62.0, t0 + 82.0), ("3,2,6", t0 + 150.0, None)]
    steps = [(t0 + 1.0 + i, "3,1,4", "pin") for i in range(60)]  # the first pin's 62 s
    steps += [(t0 + 63.0 + i, "2,2,4", "pin") for i in range(18)]  # replaced at t0 + 62
    steps += [(t0 + 90.0 + i, "0,1,1", "model") for i in range(50)]  # cleared: no pin
    steps += [(t0 + 151.0 + i, "3,2,6", "pin") for i in range(10)]
    pins = []
    with store.get_engine(private_db).begin() as conn:
        for i, (shape, created, cleared) in enumerate(made):
            steps_, topk, ndt = (int(x) for x in shape.split(","))
            pin_id = conn.execute(
                insert(PinRow)
                .values(steps=steps_, topk=topk, num_draft_tokens=ndt, reason="test")
                .values(created_at=created, created_by="pytest", cleared_at=cleared)
                .returning(PinRow.id)
            ).scalar_one()
            # Soak times as the monotonic clock saw them: 20 s apart.
            pins.append(PinAction(shape, 20.0 * i, 201, pin_id, created, 0.5))
        template = conn.execute(select(Step).where(Step.run_id == run_id)).mappings().one()
        for index, (t, shape, source) in enumerate(steps, start=1):
            steps_, topk, ndt = (int(x) for x in shape.split(","))
            row = {k: v for k, v in template.items() if k != "id"}
            row.update(step_index=index, wall_time=t, steps=steps_, topk=topk)
            row.update(num_draft_tokens=ndt, decision_source=source)
            conn.execute(insert(Step).values(**row))
    out = report.pin_outcomes(private_db, run_id, pins, poll_s=1.0)
    assert out["pins_obeyed"] == 3, out["pins"]
    assert [p["steps_under_pin"] for p in out["pins"]] == [60, 18, 10]


def test_only_503s_inside_planned_outages_are_expected():
    responses = [
        DashboardResponse(10.0, "browser", "GET", "/api/overview", 200),
        DashboardResponse(65.0, "operator", "POST", "/api/pins", 503),
        DashboardResponse(86.0, "browser", "GET", "/api/overview", 503),  # within the grace
        DashboardResponse(95.0, "browser", "GET", "/api/overview", 503),
        DashboardResponse(70.0, "browser", "GET", "/shapes", 500),
    ]
    out = report.dashboard_summary(responses, [(63.0, 83.0)])
    assert out["dashboard_requests"] == 5
    assert out["dashboard_503_planned"] == 2
    assert out["dashboard_5xx"] == 2
    assert out["dashboard_requests_by_client"] == {"browser": 4, "operator": 1}


def test_rss_slope():
    flat = [(float(t), 1000.0 + (t % 2) * 0.5) for t in range(0, 600, 5)]
    assert abs(memory.slope_mb_per_min(flat)) < 0.1
    leak = [(float(t), 1000.0 + t / 60.0 * 3.0) for t in range(0, 600, 5)]
    assert memory.slope_mb_per_min(leak) == pytest.approx(3.0)
    assert memory.slope_mb_per_min(leak[:2]) is None


def test_rss_late_slope_tells_settling_growth_from_a_leak():
    t = range(0, 1800, 5)
    settling = [(float(x), 5000.0 + 300.0 * (1 - math.exp(-x / 300.0))) for x in t]
    leak = [(float(x), 5000.0 + x / 60.0 * 2.0) for x in t]
    s = memory._series_json(settling, warmup_s=540.0, window_s=180.0)
    assert s["slope_mb_per_min"] > 1.0
    assert s["late_slope_mb_per_min"] < s["slope_mb_per_min"] / 3
    s = memory._series_json(leak, warmup_s=540.0, window_s=180.0)
    assert s["slope_mb_per_min"] == pytest.approx(2.0)
    assert s["late_slope_mb_per_min"] == pytest.approx(2.0)


def _sawtooth(t: float, leak_mb_per_min: float) -> float:
    """A working set of 5,000 MB whose freed heap is handed back every 180 s: RSS drops by
    200 MB at each release and the load takes the pages again within a minute."""
    since_release = t % 180.0
    refill = min(1.0, since_release / 60.0)
    return 4800.0 + 200.0 * refill + t / 60.0 * leak_mb_per_min


@pytest.mark.parametrize("end_s", [1800.0, 1830.0, 1860.0, 1890.0, 1920.0])
def test_rss_peak_slope_is_flat_on_a_sawtooth_whatever_its_phase_at_the_end(end_s):
    """The slope of every sample swings with where the last tooth was cut; the peaks' does
    not, and a leak under the same sawtooth still shows at its rate."""
    t = [float(x) for x in range(0, int(end_s), 5)]
    flat = memory._series_json([(x, _sawtooth(x, 0.0)) for x in t], 540.0, window_s=180.0)
    assert abs(flat["peak_slope_mb_per_min"]) < 0.2
    leak = memory._series_json([(x, _sawtooth(x, 2.0)) for x in t], 540.0, window_s=180.0)
    assert leak["peak_slope_mb_per_min"] == pytest.approx(2.0, abs=0.2)


def test_the_sample_slope_of_a_flat_sawtooth_can_fail_the_bar():
    """Why the peaks judge: cut at some phases, the same flat sawtooth reads a slope of every
    sample over 1 MB/min, while its peaks' stays flat at every phase."""
    sample_slopes = []
    for end_s in range(1800, 1980, 15):
        t = [float(x) for x in range(0, end_s, 5)]
        s = memory._series_json([(x, _sawtooth(x, 0.0)) for x in t], 540.0, window_s=180.0)
        sample_slopes.append(s["slope_mb_per_min"])
        assert abs(s["peak_slope_mb_per_min"]) < 0.2
    assert max(sample_slopes) > 1.0


def test_envelopes_leave_out_a_short_last_window():
    # Windows 0-60, 60-120, 120-180 and 180-195 s: the last spans less than half a window.
    samples = [(float(t), float(t)) for t in range(0, 200, 5)]
    peaks, floors = memory.envelopes(samples, 60.0)
    assert [m for _, m in peaks] == [55.0, 115.0, 175.0]
    assert [m for _, m in floors] == [0.0, 60.0, 120.0]
    assert memory.envelopes([], 60.0) == ([], [])


def test_rss_sampler_follows_each_process_of_the_tree():
    """A real process tree: this process and a child that allocates 64 MB between the two
    samples (it waits for a line before allocating, and answers once the memory is written)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); b = bytearray(64 << 20); "
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        clock = SimpleNamespace(t=0.0)
        clock.now = lambda: clock.t
        sampler = memory.RssSampler(os.getpid(), clock, every_s=5.0)
        sampler._sample()
        child.stdin.write("allocate\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "held"
        clock.t = 5.0
        sampler._sample()
        child_role = memory._role(psutil.Process(child.pid))
    finally:
        child.communicate("", timeout=30)
    out = sampler.to_json(warmup_s=0.0, window_s=60.0)
    assert [t for t, _ in out["samples"]] == [0.0, 5.0]
    roles = {p["role"]: p for p in out["per_process"]}
    assert child_role in roles
    total_end = sum(p["end_mb"] for p in out["per_process"])
    assert total_end == pytest.approx(out["end_mb"], abs=0.2)
    grown = max(roles.values(), key=lambda p: p["end_mb"] - p["start_mb"])
    assert grown["end_mb"] - grown["start_mb"] > 50.0
    # The child's bytearray is anonymous memory; the split adds up to the total.
    anonymous, mapped = out["by_kind"]["anonymous"], out["by_kind"]["file_or_shared"]
    assert anonymous["end_mb"] - anonymous["start_mb"] > 50.0
    assert abs(mapped["end_mb"] - mapped["start_mb"]) < 16.0
    assert anonymous["end_mb"] + mapped["end_mb"] == pytest.approx(out["end_mb"], abs=0.2)


def test_memory_comparison_names_what_is_adatrees():
    ours = [memory.ProcessMemory("sglang::scheduler", 1, 3100.0, 2700.0, "tcmalloc")]
    theirs = [memory.ProcessMemory("sglang::scheduler", 2, 2900.0, 2500.0, "tcmalloc")]
    out = memory.comparison(ours, theirs)
    assert out["adatree_part_uss_mb"] == 200.0
    assert out["per_process"][0]["role"] == "sglang::scheduler"
    assert out["per_process"][0]["adatree_allocator"] == "tcmalloc"


def test_each_process_says_which_allocator_it_runs_on():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine = {m.pid: m for m in memory.per_process(os.getpid())}
        assert mine[os.getpid()].allocator == "system"
        assert mine[child.pid].allocator in ("system", "unknown")
    finally:
        child.kill()
        child.wait()


def test_bad_request_refusals_are_judged_by_status_and_message(monkeypatch):
    class Response:
        def __init__(self, status: int, body: dict | None = None, text: str = "") -> None:
            self.status_code, self._body, self.text = status, body, text

        def json(self):
            if self._body is None:
                raise ValueError("not JSON")
            return self._body

    answers = iter(
        [
            Response(400, {"error": {"message": "the prompt is empty"}}),
            Response(500, {"error": "boom"}),
            Response(400, None, ""),
            Response(200, None, 'data: {"error": {"message": "empty", "code": 400}}\n'),
        ]
    )
    monkeypatch.setattr(bad_requests.requests, "post", lambda *a, **kw: next(answers))
    plain = bad_requests.BadRequest("x", "/generate", {"text": ""})
    streamed = bad_requests.BadRequest("s", "/generate", {"text": ""}, streamed=True)
    assert bad_requests.send("http://h", plain).clear
    assert not bad_requests.send("http://h", plain).clear  # a 5xx
    assert not bad_requests.send("http://h", plain).clear  # no message
    assert bad_requests.send("http://h", streamed).clear  # the stream's error event
    names = [b.name for b in bad_requests.bad_requests()]
    assert len(names) == len(set(names)) >= 12


def test_greedy_answers_compared_token_for_token():
    greedy = GreedyAnswers(("a", "b"), ((1, 2, 3), (4, 5)))
    assert greedy.check(0, [1, 2, 3], 1.0)
    assert not greedy.check(1, [4, 6], 2.0)
    out = greedy.to_json()
    assert (out["answers_compared"], out["answers_differing"]) == (2, 1)
    assert out["differing"][0]["first_differing_token"] == 1


def test_checks_fail_on_any_must_show_property():
    good = {
        "server_crashes": 0,
        "answers_compared": 8,
        "answers_differing": 0,
        "dashboard_5xx": 0,
        "rows_unaccounted": 0,
        "rss_slope_mb_per_min": 0.2,
        "pins_applied": 5,
        "pins_obeyed": 5,
        "bad_requests": {"sent": 15, "refused_clearly": 15},
        "requests": {"served": 40},
    }
    assert all(report.checks(good, rss_slope_limit=1.0).values())
    for key, value in (
        ("server_crashes", 1),
        ("answers_differing", 1),
        ("dashboard_5xx", 1),
        ("rows_unaccounted", 3),
        ("rss_slope_mb_per_min", 1.5),
        ("pins_obeyed", 4),
    ):
        assert not all(report.checks({**good, key: value}, rss_slope_limit=1.0).values()), key


def test_fault_events_open_and_close_the_planned_outage(private_db):
    class Clock:
        t = 0.0

        def now(self) -> float:
            return self.t

    clock, log = Clock(), FaultLog()
    schedule = Schedule.for_minutes(3)
    faults = SqliteFaults(store.sqlite_path(private_db))
    events = fault_events(faults, schedule, clock, log)
    assert [t for t, _ in events] == [pytest.approx(63.0), 73.0, 83.0]
    try:
        for t, action in events:
            clock.t = t
            action()
    finally:
        faults.heal()
    assert [s["what"] for s in log.steps] == ["read-only", "deleted", "restored"]
    assert log.outages == [(pytest.approx(63.0), 83.0)]
    assert log.planned(70.0, 5.0) and log.planned(87.0, 5.0) and not log.planned(90.0, 5.0)
    assert after_faults(70.0, schedule) == 88.0 and after_faults(30.0, schedule) == 30.0
    assert times(10.0, 20.0, 60.0) == [10.0, 30.0, 50.0]
