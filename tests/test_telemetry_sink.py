"""The step controller's reports in a real SQLite store: one row per finished step, each with its
own decision and timing, and the steps that never finished counted in the run's row."""

from __future__ import annotations

from sqlalchemy import select
from test_controller import config, outcome

from sglang_adatree.core.controller import BatchView, StepController
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.records import RunRecord
from sglang_adatree.telemetry.sink import TelemetrySink
from sglang_adatree.telemetry.store import get_engine, upgrade
from sglang_adatree.telemetry.writer import TelemetryWriter

RUN = RunRecord("t", "d", "cpu", "x", "y")


def recording(tmp_path) -> tuple[str, TelemetryWriter, int, StepController]:
    """A migrated SQLite store, its writer and run, and a controller in warm-up recording to it."""
    url = f"sqlite:///{tmp_path / 'adatree.sqlite'}"
    upgrade(url)
    writer = TelemetryWriter(url, flush_s=0.05)
    run_id = writer.start_run(RUN)
    controller = StepController(config(warmup_steps=1000), sinks=[TelemetrySink(writer, run_id)])
    return url, writer, run_id, controller


def test_a_dropped_completion_leaves_every_later_row_its_own(tmp_path):
    url, writer, run_id, controller = recording(tmp_path)
    # Overlap scheduling: step i + 1 is launched before step i finishes. Step 4's result never
    # comes back (an aborted batch).
    previous = None
    for i in range(10):
        ticket = controller.begin(BatchView(("a", "b"), (100 + i, 40 + i)))
        if previous is not None and previous.id != 4:
            done = outcome(previous, 10.0 + previous.id, wall_time=1000.0 + previous.id)
            controller.finish(previous, done)
        previous = ticket
    controller.finish(previous, outcome(previous, 19.0, wall_time=1009.0))
    assert writer.flush()
    with get_engine(url).connect() as conn:
        rows = conn.execute(select(Step).order_by(Step.step_index)).all()
        unfinished = conn.execute(select(Run.unfinished_steps).where(Run.id == run_id)).scalar()
    writer.close()
    assert [r.step_index for r in rows] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert unfinished == 1
    for r in rows:
        # Each row is its own step's: timing, clock, batch and decision.
        assert r.measured_step_ms == 10.0 + r.step_index
        assert r.wall_time == 1000.0 + r.step_index
        assert r.sum_context_len == 140 + 2 * r.step_index
        assert r.batch_size == 2 and r.padded_batch_size == 2
    sources = [r.decision_source for r in rows]
    assert sources[:2] == ["warmup", "catch-up"]
    shapes = [(r.steps, r.topk, r.num_draft_tokens) for r in rows]
    assert shapes[2:4] == [(2, 2, 4), (3, 1, 4)]  # the warm-up's order, step 4 missing only


def test_each_row_records_its_runner_up(tmp_path):
    url, writer, _, controller = recording(tmp_path)
    decisions = []
    for i in range(5):
        ticket = controller.begin(BatchView(("a",), (100 + i,)))
        decisions.append(ticket.decision)
        controller.finish(ticket, outcome(ticket, 10.0, wall_time=1000.0 + i))
    assert writer.flush()
    with get_engine(url).connect() as conn:
        rows = conn.execute(select(Step).order_by(Step.step_index)).all()
    writer.close()
    assert len(rows) == len(decisions) == 5
    for r, d in zip(rows, decisions, strict=True):
        assert d.runner_up is not None and d.runner_up != d.shape
        assert r.runner_up == str(d.runner_up)
        assert r.runner_up_step_ms == d.runner_up_ms
        assert r.runner_up_accept_len == d.runner_up_emitted
    # The catch-up's runner-up is the tree it held back (the warm-up's next shape).
    assert [r.decision_source for r in rows[:3]] == ["warmup", "catch-up", "warmup"]
    held = rows[2]
    assert rows[1].runner_up == "2,2,4" == f"{held.steps},{held.topk},{held.num_draft_tokens}"


def test_each_row_records_the_price_split_its_decision_saw(tmp_path):
    url, writer, _, controller = recording(tmp_path)
    splits = []
    for i in range(6):
        ticket = controller.begin(BatchView(("a",), (100 + i,)))
        splits.append(ticket.decision.split)
        # The machine takes twice what the model says: the drift moves step by step.
        ms = 2.0 * ticket.decision.predicted_ms
        controller.finish(ticket, outcome(ticket, ms, wall_time=1000.0 + i))
    assert writer.flush()
    with get_engine(url).connect() as conn:
        rows = conn.execute(select(Step).order_by(Step.step_index)).all()
    writer.close()
    assert all(s is not None for s in splits)
    assert [(r.price_drift, r.price_tilt, r.price_offset) for r in rows] == [
        (s.drift, s.tilt, s.offset) for s in splits
    ]
    assert rows[0].price_drift == 0.0 and rows[-1].price_drift > 0.3
