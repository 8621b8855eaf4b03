"""When a CPU decode step's time counts from (``sglang.launched.step_period_start``)."""

import pytest

from sglang_adatree.sglang.launched import LaunchedStep, step_period_start


def test_a_step_right_after_another_counts_the_host_work_between_them():
    # The step before ended at 10.000 s; this one ran 10.002-10.060 s.
    assert step_period_start(10.002, 10.060, 10.000) == 10.000


def test_a_step_after_a_prefill_or_a_wait_counts_from_its_own_start():
    assert step_period_start(10.002, 10.060, None) == 10.002  # a prefill broke the chain
    # A gap longer than the step itself: the scheduler waited, not worked.
    assert step_period_start(10.100, 10.160, 10.000) == 10.100
    assert step_period_start(10.002, 10.060, 10.010) == 10.002  # a clock that went back


def test_a_launched_step_measures_its_period():
    start = step_period_start(10.002, 10.060, 10.000)
    step = LaunchedStep(None, start, 10.060, None, None, None)  # type: ignore[arg-type]
    assert step.measured_ms() == pytest.approx(60.0)
