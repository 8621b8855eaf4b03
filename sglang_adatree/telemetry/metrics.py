"""adatree's Prometheus series, exported beside SGLang's on the same ``/metrics`` endpoint.

SGLang runs ``prometheus_client`` in multiprocess mode when started with ``--enable-metrics``:
series created in the scheduler process land in the shared directory the HTTP server collects
from, so creating them here (in the process that decides shapes) is all it takes. Counters
follow vLLM's speculative-decoding names (drafted and accepted tokens, per position); gauges
show the current shape and the cost model's predicted against measured step time.

``AdaTreeMetrics`` is a step sink (``core.controller.StepSink``): the SGLang adapter wires it
into the step controller, which hands it every finished step.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from sglang_adatree.core.controller import StepReport

PREFIX = "adatree"


class AdaTreeMetrics:
    """The adatree series; one instance per serving process, labelled like SGLang's."""

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        self.labels = dict(labels or {})
        names = list(self.labels)
        self.decode_steps = Counter(
            f"{PREFIX}_decode_steps_total",
            "decode steps finished, with or without speculation",
            names,
        )
        self.verify_steps = Counter(
            f"{PREFIX}_verify_steps_total",
            "decode steps that verified draft tokens (speculative shapes only)",
            names,
        )
        self.unfinished_steps = Counter(
            f"{PREFIX}_unfinished_steps_total",
            "decode steps launched whose outcome never came back (no telemetry row)",
            names,
        )
        self.drafted_tokens = Counter(
            f"{PREFIX}_drafted_tokens_total",
            "draft tokens verified (tree nodes below the root)",
            names,
        )
        self.offered_tokens = Counter(
            f"{PREFIX}_offered_tokens_total",
            "draft tokens the target could accept at each depth: children of the accepted "
            "path's node there (depth 1 = the first draft token)",
            [*names, "depth"],
        )
        self.accepted_tokens = Counter(
            f"{PREFIX}_accepted_tokens_total",
            "accepted draft tokens, per tree depth",
            [*names, "depth"],
        )
        self.emitted_tokens = Counter(
            f"{PREFIX}_emitted_tokens_total", "emitted tokens (accepted + bonus)", names
        )
        self.steps_per_shape = Counter(
            f"{PREFIX}_steps_total",
            "decode steps per chosen shape and decision source",
            [*names, "shape", "source"],
        )
        self.shape = Gauge(
            f"{PREFIX}_current_shape",
            "the shape of the latest decode step (steps, topk, num_draft_tokens)",
            [*names, "field"],
            multiprocess_mode="mostrecent",
        )
        self.step_ms = Gauge(
            f"{PREFIX}_step_time_ms",
            "latest decode step time: predicted by the cost model and measured",
            [*names, "kind"],
            multiprocess_mode="mostrecent",
        )

    def step_finished(self, report: StepReport) -> None:
        """Record one decode step (called once its results are on the CPU)."""
        lv = self.labels
        decision = report.ticket.decision
        shape = decision.shape
        self.decode_steps.labels(**lv).inc()
        if shape.speculative:
            self.verify_steps.labels(**lv).inc()
        self.emitted_tokens.labels(**lv).inc(report.emitted_tokens)
        self.drafted_tokens.labels(**lv).inc(report.drafted_tokens)
        self.steps_per_shape.labels(**lv, shape=str(shape), source=str(decision.source)).inc()
        for depth, (offered, accepted) in enumerate(
            zip(report.offered_by_depth, report.accepted_by_depth, strict=False), start=1
        ):
            if offered:
                self.offered_tokens.labels(**lv, depth=str(depth)).inc(offered)
            if accepted:
                self.accepted_tokens.labels(**lv, depth=str(depth)).inc(accepted)
        self.shape.labels(**lv, field="steps").set(shape.steps)
        self.shape.labels(**lv, field="topk").set(shape.topk)
        self.shape.labels(**lv, field="num_draft_tokens").set(shape.num_draft_tokens)
        self.step_ms.labels(**lv, kind="measured").set(report.outcome.measured_ms)
        self.step_ms.labels(**lv, kind="predicted").set(decision.predicted_ms)

    def steps_unfinished(self, count: int) -> None:
        self.unfinished_steps.labels(**self.labels).inc(count)
