"""adatree's Prometheus series, exported beside SGLang's on the same ``/metrics`` endpoint.

SGLang runs ``prometheus_client`` in multiprocess mode when started with ``--enable-metrics``:
series created in the scheduler process land in the shared directory the HTTP server collects
from, so creating them here (in the process that decides shapes) is all it takes. Counters
follow vLLM's speculative-decoding names (drafted and accepted tokens, per position); gauges
show the current shape and the cost model's predicted against measured step time.

``AdaTreeMetrics`` is a step sink (``core.controller.StepSink``): the SGLang adapter wires it
into the step controller, which hands it every finished step. The telemetry writer's health
(its backlog, rows written, failed writes, drops, refusals and losses) is sampled from
``TelemetryWriter.stats()`` by ``TelemetryHealthSampler``, a thread of its own that wakes once a
second: the decode loop never waits for it, and the series stay current while the server is
idle (a backlog that drains after an outage with no traffic still shows as drained).

Every finished decode step is either a telemetry row or counted: ``rows_written +
dropped_records + rejected_records + lost_records + queued_records`` equals
``decode_steps_total`` once the writer has caught up, and ``unfinished_steps_total`` counts the
steps that launched but never finished (they never reach the writer).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from sglang_adatree.core.controller import StepReport
from sglang_adatree.telemetry.writer import WriterStats

PREFIX = "adatree"
SAMPLE_EVERY_S = 1.0


@dataclass
class _Children:
    """The labelled series a decode step updates; those per shape and per depth are added
    as steps first need them (labelling one exports it)."""

    decode_steps: Any
    verify_steps: Any
    emitted_tokens: Any
    step_seconds: Any
    drafted_tokens: Any
    shape_steps: Any
    shape_topk: Any
    shape_num_draft_tokens: Any
    measured_ms: Any
    predicted_ms: Any
    per_shape: dict[Any, Any] = field(default_factory=dict)  # by (shape, decision source)
    offered: list[Any] = field(default_factory=list)  # by depth - 1
    accepted: list[Any] = field(default_factory=list)


class AdaTreeMetrics:
    """The adatree series; one instance per serving process, labelled like SGLang's."""

    def __init__(
        self, labels: dict[str, str] | None = None, registry: CollectorRegistry = REGISTRY
    ) -> None:
        self.labels = dict(labels or {})
        names = list(self.labels)

        def counter(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", help_text, [*names, *extra], registry=registry)

        def gauge(name: str, help_text: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(
                f"{PREFIX}_{name}",
                help_text,
                [*names, *extra],
                registry=registry,
                multiprocess_mode="mostrecent",
            )

        self.decode_steps = counter(
            "decode_steps_total", "decode steps finished, with or without speculation"
        )
        self.verify_steps = counter(
            "verify_steps_total",
            "decode steps that verified draft tokens (speculative shapes only)",
        )
        self.unfinished_steps = counter(
            "unfinished_steps_total",
            "decode steps launched whose outcome never came back (no telemetry row)",
        )
        self.drafted_tokens = counter(
            "drafted_tokens_total", "draft tokens verified (tree nodes below the root)"
        )
        self.offered_tokens = counter(
            "offered_tokens_total",
            "draft tokens the target could accept at each depth: children of the accepted "
            "path's node there (depth 1 = the first draft token)",
            ("depth",),
        )
        self.accepted_tokens = counter(
            "accepted_tokens_total", "accepted draft tokens, per tree depth", ("depth",)
        )
        self.emitted_tokens = counter("emitted_tokens_total", "emitted tokens (accepted + bonus)")
        self.step_seconds = counter(
            "step_seconds_total",
            "measured decode step time, summed (goodput = rate of emitted tokens / rate of this)",
        )
        self.steps_per_shape = counter(
            "steps_total",
            "decode steps per chosen shape and decision source",
            ("shape", "source"),
        )
        self.shape = gauge(
            "current_shape",
            "the shape of the latest decode step (steps, topk, num_draft_tokens)",
            ("field",),
        )
        self.step_ms = gauge(
            "step_time_ms",
            "latest decode step time: predicted by the cost model and measured",
            ("kind",),
        )
        # The telemetry writer's health, sampled from its counters (``telemetry_sampled``).
        self.telemetry_queued = gauge(
            "telemetry_queued_records",
            "finished decode steps waiting in the telemetry writer's queue, not yet written",
        )
        self.telemetry_written = counter(
            "telemetry_rows_written_total",
            "finished decode steps written to the telemetry database as steps rows",
        )
        self.telemetry_failures = counter(
            "telemetry_write_failures_total",
            "failed telemetry write attempts (database locked, read-only, missing or down); "
            "each is retried after a backoff, its rows kept",
        )
        self.telemetry_dropped = counter(
            "telemetry_dropped_records_total",
            "finished decode steps not recorded because the telemetry queue was full "
            "(runs.dropped_steps)",
        )
        self.telemetry_rejected = counter(
            "telemetry_rejected_records_total",
            "finished decode steps whose row the database refused (constraint or data "
            "errors; runs.rejected_steps)",
        )
        self.telemetry_lost = counter(
            "telemetry_lost_records_total",
            "finished decode steps still unwritten when the telemetry writer closed",
        )
        self.telemetry_down = gauge(
            "telemetry_database_down",
            "1 while the telemetry writer's latest write failed and none has succeeded since",
        )
        self._sampled = WriterStats(0, 0, 0, 0, 0, 0, None)
        self._children: _Children | None = None  # labelled at the first step
        # Series without labels of their own are exported at 0 from the start: a counter that
        # appears only at its first event has no rate over the window before it.
        unlabelled = (
            self.decode_steps,
            self.verify_steps,
            self.unfinished_steps,
            self.drafted_tokens,
            self.emitted_tokens,
            self.step_seconds,
            self.telemetry_written,
            self.telemetry_failures,
            self.telemetry_dropped,
            self.telemetry_rejected,
            self.telemetry_lost,
        )
        for series in unlabelled if names else ():
            series.labels(**self.labels)

    def step_finished(self, report: StepReport) -> None:
        """Record one decode step (called once its results are on the CPU)."""
        c = self._children or self._first_children()
        decision = report.ticket.decision
        shape = decision.shape
        c.decode_steps.inc()
        if shape.speculative:
            c.verify_steps.inc()
        c.emitted_tokens.inc(report.emitted_tokens)
        if report.outcome.measured_ms > 0:  # a step without a measured time adds none (or NaN)
            c.step_seconds.inc(report.outcome.measured_ms / 1000.0)
        c.drafted_tokens.inc(report.drafted_tokens)
        source = decision.source
        per_shape = c.per_shape.get((shape, source))
        if per_shape is None:
            per_shape = c.per_shape[shape, source] = self.steps_per_shape.labels(
                **self.labels, shape=str(shape), source=str(source)
            )
        per_shape.inc()
        for depth, (offered, accepted) in enumerate(
            zip(report.offered_by_depth, report.accepted_by_depth, strict=False), start=1
        ):
            if depth > len(c.offered):
                c.offered.append(self.offered_tokens.labels(**self.labels, depth=str(depth)))
                c.accepted.append(self.accepted_tokens.labels(**self.labels, depth=str(depth)))
            if offered:
                c.offered[depth - 1].inc(offered)
            if accepted:
                c.accepted[depth - 1].inc(accepted)
        c.shape_steps.set(shape.steps)
        c.shape_topk.set(shape.topk)
        c.shape_num_draft_tokens.set(shape.num_draft_tokens)
        c.measured_ms.set(report.outcome.measured_ms)
        c.predicted_ms.set(decision.predicted_ms)

    def _first_children(self) -> _Children:
        """The series a step writes, labelled once: in multiprocess mode (SGLang's) each
        ``labels()`` call takes the metric's lock and builds its key, most of a step's cost."""
        lv = self.labels
        self._children = _Children(
            decode_steps=self.decode_steps.labels(**lv),
            verify_steps=self.verify_steps.labels(**lv),
            emitted_tokens=self.emitted_tokens.labels(**lv),
            step_seconds=self.step_seconds.labels(**lv),
            drafted_tokens=self.drafted_tokens.labels(**lv),
            shape_steps=self.shape.labels(**lv, field="steps"),
            shape_topk=self.shape.labels(**lv, field="topk"),
            shape_num_draft_tokens=self.shape.labels(**lv, field="num_draft_tokens"),
            measured_ms=self.step_ms.labels(**lv, kind="measured"),
            predicted_ms=self.step_ms.labels(**lv, kind="predicted"),
        )
        return self._children

    def steps_unfinished(self, count: int) -> None:
        self.unfinished_steps.labels(**self.labels).inc(count)

    def telemetry_sampled(self, stats: WriterStats) -> None:
        """Refresh the writer's series from one sample of ``TelemetryWriter.stats()``; its
        counters only grow, so each counter advances by the change since the last sample."""
        lv = self.labels
        last, self._sampled = self._sampled, stats
        for series, now, before in (
            (self.telemetry_written, stats.written, last.written),
            (self.telemetry_failures, stats.failures, last.failures),
            (self.telemetry_dropped, stats.dropped, last.dropped),
            (self.telemetry_rejected, stats.rejected, last.rejected),
            (self.telemetry_lost, stats.lost, last.lost),
        ):
            if now > before:
                series.labels(**lv).inc(now - before)
        self.telemetry_queued.labels(**lv).set(stats.queued)
        self.telemetry_down.labels(**lv).set(1 if stats.down else 0)


class TelemetryHealthSampler:
    """Samples the writer's counters into ``metrics`` every ``every_s`` seconds, on a daemon
    thread (``adatree-telemetry-health``); ``close()`` takes a last sample (losses at close)."""

    def __init__(
        self,
        metrics: AdaTreeMetrics,
        stats: Callable[[], WriterStats],
        every_s: float = SAMPLE_EVERY_S,
    ) -> None:
        self._metrics = metrics
        self._stats = stats
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="adatree-telemetry-health", daemon=True
        )
        self._thread.start()

    def sample(self) -> None:
        self._metrics.telemetry_sampled(self._stats())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.sample()
