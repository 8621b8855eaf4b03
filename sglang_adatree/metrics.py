"""adatree's Prometheus series, exported beside SGLang's on the same ``/metrics`` endpoint.

SGLang runs ``prometheus_client`` in multiprocess mode when started with ``--enable-metrics``:
series created in the scheduler process land in the shared directory the HTTP server collects
from, so creating them here (in the process that decides shapes) is all it takes. Counters
follow vLLM's speculative-decoding names (drafted and accepted tokens, per position); gauges
show the current shape and the cost model's predicted against measured step time.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge

from sglang_adatree.shapes import TreeShape

PREFIX = "adatree"


class AdaTreeMetrics:
    """The adatree series; one instance per serving process, labelled like SGLang's."""

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        self.labels = dict(labels or {})
        names = list(self.labels)
        self.verify_steps = Counter(
            f"{PREFIX}_verify_steps_total", "decode steps verified by the target", names
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

    def observe(
        self,
        shape: TreeShape,
        source: str,
        predicted_ms: float | None,
        measured_ms: float,
        emitted_tokens: int,
        drafted_tokens: int,
        offered_by_depth: Sequence[int],
        accepted_by_depth: Sequence[int],
    ) -> None:
        """Record one decode step (called off the hot path, once its results are on the CPU)."""
        lv = self.labels
        self.verify_steps.labels(**lv).inc()
        self.emitted_tokens.labels(**lv).inc(emitted_tokens)
        self.drafted_tokens.labels(**lv).inc(drafted_tokens)
        self.steps_per_shape.labels(**lv, shape=str(shape), source=source).inc()
        for depth, (offered, accepted) in enumerate(
            zip(offered_by_depth, accepted_by_depth, strict=False), start=1
        ):
            if offered:
                self.offered_tokens.labels(**lv, depth=str(depth)).inc(offered)
            if accepted:
                self.accepted_tokens.labels(**lv, depth=str(depth)).inc(accepted)
        self.shape.labels(**lv, field="steps").set(shape.steps)
        self.shape.labels(**lv, field="topk").set(shape.topk)
        self.shape.labels(**lv, field="num_draft_tokens").set(shape.num_draft_tokens)
        self.step_ms.labels(**lv, kind="measured").set(measured_ms)
        if predicted_ms is not None:
            self.step_ms.labels(**lv, kind="predicted").set(predicted_ms)
