"""adatree's Prometheus series without SGLang: what the step sink counts, and the telemetry
writer's health sampled into them (backlog, rows written, failed writes, drops, losses) through
an outage and back; every finished step is a row or counted."""

from __future__ import annotations

import os
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from telemetry_helpers import RUN
from test_controller import ListSink, config, outcome

from sglang_adatree.core.controller import BatchView, StepController
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.metrics import AdaTreeMetrics, TelemetryHealthSampler
from sglang_adatree.telemetry.sink import TelemetrySink
from sglang_adatree.telemetry.writer import WriterStats

pytest_plugins = ["telemetry_fixtures"]

LABELS = {"model_name": "m"}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, {**LABELS, **labels})
    return 0.0 if got is None else got


def run_steps(controller: StepController, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        ticket = controller.begin(BatchView(("a", "b"), (100 + i, 40 + i)))
        controller.finish(ticket, outcome(ticket, 10.0, wall_time=1000.0 + i))


def wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def accounted(registry: CollectorRegistry) -> float:
    """Finished steps the writer's series account for: written, held or counted as not."""
    return sum(
        value(registry, f"adatree_telemetry_{name}")
        for name in (
            "rows_written_total",
            "queued_records",
            "dropped_records_total",
            "rejected_records_total",
            "lost_records_total",
        )
    )


def test_step_series_count_decode_and_verify_steps_apart():
    registry = CollectorRegistry()
    metrics = AdaTreeMetrics(LABELS, registry)
    # The warm-up cycles no speculation, then the speculative shapes.
    controller = StepController(config(warmup_steps=1000), sinks=[metrics])
    run_steps(controller, 6)
    decode = value(registry, "adatree_decode_steps_total")
    verify = value(registry, "adatree_verify_steps_total")
    assert decode == 6
    assert 0 < verify < decode
    per_shape = sum(
        s.value
        for m in registry.collect()
        if m.name == "adatree_steps"
        for s in m.samples
        if s.name == "adatree_steps_total"
    )
    assert per_shape == decode


def test_every_series_of_a_step_adds_up_to_the_steps_reports():
    registry = CollectorRegistry()
    reports = ListSink()
    controller = StepController(
        config(warmup_steps=1000), sinks=[reports, AdaTreeMetrics(LABELS, registry)]
    )
    for i in range(30):  # the warm-up's round: every shape, each depth's series as it comes
        ticket = controller.begin(BatchView(("a", "b"), (100 + i, 40 + i)))
        controller.finish(ticket, outcome(ticket, 10.0 + i, accepted=i % 3, wall_time=i))
    steps = reports.reports
    for depth in range(1, 8):
        offered = sum(
            r.offered_by_depth[depth - 1] for r in steps if len(r.offered_by_depth) >= depth
        )
        accepted = sum(
            r.accepted_by_depth[depth - 1] for r in steps if len(r.accepted_by_depth) >= depth
        )
        assert value(registry, "adatree_offered_tokens_total", depth=str(depth)) == offered
        assert value(registry, "adatree_accepted_tokens_total", depth=str(depth)) == accepted
    # Tokens were offered and accepted below the first depth, so the depths are told apart.
    assert value(registry, "adatree_offered_tokens_total", depth="2") > 0
    assert value(registry, "adatree_accepted_tokens_total", depth="2") > 0
    for shape, source in {(r.ticket.decision.shape, r.ticket.decision.source) for r in steps}:
        count = sum(
            1
            for r in steps
            if (r.ticket.decision.shape, r.ticket.decision.source) == (shape, source)
        )
        assert value(registry, "adatree_steps_total", shape=str(shape), source=str(source)) == count
    last = steps[-1]
    assert value(registry, "adatree_current_shape", field="topk") == last.ticket.decision.shape.topk
    assert value(registry, "adatree_step_time_ms", kind="measured") == 39.0
    assert value(registry, "adatree_emitted_tokens_total") == sum(r.emitted_tokens for r in steps)


def test_telemetry_series_follow_the_writer_through_an_outage(sqlite_url, open_writer):
    registry = CollectorRegistry()
    metrics = AdaTreeMetrics(LABELS, registry)
    writer = open_writer(sqlite_url, queue_size=40, batch_size=10)
    run_id = writer.start_run(RUN)
    controller = StepController(
        config(warmup_steps=1000), sinks=[TelemetrySink(writer, run_id), metrics]
    )
    sampler = TelemetryHealthSampler(metrics, writer.stats, every_s=0.05)
    try:
        run_steps(controller, 20)
        assert writer.flush(10.0)
        wait(lambda: value(registry, "adatree_telemetry_rows_written_total") == 20)
        assert value(registry, "adatree_telemetry_database_down") == 0

        path = store.sqlite_path(sqlite_url)
        os.replace(path, f"{path}.away")  # the database is gone: writes fail, rows are kept
        run_steps(controller, 80, start=20)
        wait(lambda: value(registry, "adatree_telemetry_write_failures_total") > 0)
        wait(lambda: value(registry, "adatree_telemetry_database_down") == 1)
        wait(lambda: value(registry, "adatree_telemetry_dropped_records_total") > 0)
        assert value(registry, "adatree_decode_steps_total") == 100
        wait(lambda: accounted(registry) == 100)  # as of the sampler's next sample
        assert value(registry, "adatree_telemetry_queued_records") > 0

        os.replace(f"{path}.away", path)  # restored; no step runs from here on
        assert writer.flush(10.0)
        wait(lambda: value(registry, "adatree_telemetry_queued_records") == 0)
        assert value(registry, "adatree_telemetry_database_down") == 0
        stats = writer.stats()
        assert value(registry, "adatree_telemetry_rows_written_total") == stats.written
        assert value(registry, "adatree_telemetry_dropped_records_total") == stats.dropped > 0
        wait(lambda: accounted(registry) == 100)
    finally:
        sampler.close()


def test_losses_at_close_are_sampled_by_the_last_sample(sqlite_url, open_writer):
    registry = CollectorRegistry()
    metrics = AdaTreeMetrics(LABELS, registry)
    writer = open_writer(sqlite_url)
    run_id = writer.start_run(RUN)
    controller = StepController(
        config(warmup_steps=1000), sinks=[TelemetrySink(writer, run_id), metrics]
    )
    sampler = TelemetryHealthSampler(metrics, writer.stats, every_s=60.0)
    path = store.sqlite_path(sqlite_url)
    os.replace(path, f"{path}.away")
    run_steps(controller, 7)
    writer.close(timeout=0.5)
    sampler.close()
    os.replace(f"{path}.away", path)
    assert value(registry, "adatree_telemetry_lost_records_total") == 7
    assert value(registry, "adatree_telemetry_queued_records") == 0
    assert accounted(registry) == 7


def test_counters_advance_by_the_change_between_samples():
    registry = CollectorRegistry()
    metrics = AdaTreeMetrics(LABELS, registry)
    metrics.telemetry_sampled(WriterStats(5, 10, 1, 0, 0, 2, "OperationalError: x", True))
    metrics.telemetry_sampled(WriterStats(0, 16, 1, 1, 0, 2, None, False))
    assert value(registry, "adatree_telemetry_rows_written_total") == 16
    assert value(registry, "adatree_telemetry_dropped_records_total") == 1
    assert value(registry, "adatree_telemetry_rejected_records_total") == 1
    assert value(registry, "adatree_telemetry_write_failures_total") == 2
    assert value(registry, "adatree_telemetry_queued_records") == 0
    assert value(registry, "adatree_telemetry_database_down") == 0


def test_every_series_says_what_it_counts():
    registry = CollectorRegistry()
    AdaTreeMetrics(LABELS, registry)
    text = generate_latest(registry).decode()
    helps = {
        line.split()[2]: line.split(None, 3)[3]
        for line in text.splitlines()
        if line.startswith("# HELP ")
    }
    for name in (
        "adatree_telemetry_queued_records",
        "adatree_telemetry_rows_written_total",
        "adatree_telemetry_write_failures_total",
        "adatree_telemetry_dropped_records_total",
        "adatree_telemetry_rejected_records_total",
        "adatree_telemetry_lost_records_total",
        "adatree_telemetry_database_down",
        "adatree_unfinished_steps_total",
    ):
        assert name in helps, f"{name} not exported"
        assert len(helps[name]) > 30
    assert "speculative" in helps["adatree_verify_steps_total"]


def test_server_info_carries_the_writers_counters(sqlite_url, open_writer):
    serving = pytest.importorskip("sglang_adatree.sglang.serving")
    writer = open_writer(sqlite_url)
    run_id = writer.start_run(RUN)
    controller = StepController(config(warmup_steps=1000), sinks=[TelemetrySink(writer, run_id)])
    loop = serving.ServingLoop(controller, run_id, writer, None)
    run_steps(controller, 3)
    assert writer.flush(10.0)
    state = loop.server_state()
    assert state["adatree_run_id"] == run_id
    assert state["adatree_steps"] == 3
    assert state["adatree_telemetry_rows_written"] == 3
    assert state["adatree_telemetry_queued"] == 0
    assert state["adatree_telemetry_dropped"] == 0
    assert state["adatree_telemetry_database_down"] is False
    for key in ("write_failures", "rejected", "lost", "last_error"):
        assert f"adatree_telemetry_{key}" in state
    assert "adatree_unfinished_steps" in state
