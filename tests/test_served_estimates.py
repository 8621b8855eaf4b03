"""``adatree compare``'s estimate lines: read from a real SQLite store over a span, printed per
shape with its first runner-ups."""

from __future__ import annotations

from admin_helpers import END_TIME, seed_run

from sglang_adatree.telemetry.estimates import Estimates, RunnerUp, ShapeEstimate
from sglang_adatree.tools.bench.served_estimates import (
    RUNNER_UPS_SHOWN,
    estimate_lines,
    estimates_json,
    read_estimates,
)

pytest_plugins = ["admin_fixtures", "telemetry_fixtures"]


def test_the_span_selects_the_steps(db_url):
    seed_run(db_url, 1000)  # 50 steps a second, ending at END_TIME
    whole = read_estimates(db_url, (0.0, END_TIME + 1.0))
    half = read_estimates(db_url, (END_TIME - 10.0, END_TIME + 1.0))
    assert sum(e.num_steps for e in whole.shapes) == 1000
    assert 450 <= sum(e.num_steps for e in half.shapes) <= 550
    assert read_estimates(db_url, (END_TIME + 5.0, END_TIME + 9.0)).shapes == ()
    data = estimates_json(whole)
    assert [s["shape"] for s in data["shapes"]] == [e.shape for e in whole.shapes]
    assert len(data["runner_ups"]) == len(whole.runner_ups)


def rival(runner_up: str, share: float, measured: float | None) -> RunnerUp:
    measured_ms = None if measured is None else 109.0
    return RunnerUp("3,1,4", runner_up, 10, share, 0.012, 1.91, 110.0, measured, measured_ms)


def test_lines_show_the_first_runner_ups_and_mark_what_was_not_measured():
    est = Estimates(
        (ShapeEstimate("3,1,4", 40, 1.84, 1.80, 105.1, 104.2),),
        (
            rival("2,2,4", 0.5, 1.95),
            rival("3,4,8", 0.3, None),
            rival("0,1,1", 0.2, 1.0),
        ),
    )
    head, line = estimate_lines("adatree", est)
    assert head.startswith("adatree's estimates over the prompts")
    assert "3,1,4    40 steps  acceptance 1.84 / 1.80  step 105.1 / 104.2 ms" in line
    assert "2,2,4 50% (lead +1.2%; acceptance 1.91 / 1.95, step 110.0 / 109.0 ms)" in line
    assert "3,4,8 30% (lead +1.2%; acceptance 1.91 / -, step 110.0 / - ms)" in line
    assert "0,1,1" not in line and f"(+{3 - RUNNER_UPS_SHOWN} more)" in line
    assert estimate_lines("x", Estimates((), ())) == ["x: no steps recorded over the prompts"]
