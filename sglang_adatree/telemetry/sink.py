"""The telemetry writer as a step sink: one ``steps`` row per finished decode step.

The step controller hands every finished step to its sinks (``core.controller.StepSink``); this
one turns the report into a ``StepRecord`` for the writer's bounded queue (no I/O here), and
counts the steps that never finished into the run's row.
"""

from __future__ import annotations

from sglang_adatree.core.controller import StepReport
from sglang_adatree.telemetry.records import StepRecord
from sglang_adatree.telemetry.writer import TelemetryWriter


class TelemetrySink:
    """Records finished steps of one run through ``writer``."""

    def __init__(self, writer: TelemetryWriter, run_id: int) -> None:
        self.writer = writer
        self.run_id = run_id

    def step_finished(self, report: StepReport) -> None:
        ticket = report.ticket
        decision = ticket.decision
        features = ticket.features
        shape = decision.shape
        split = decision.split
        self.writer.record(
            StepRecord(
                run_id=self.run_id,
                step_index=ticket.id,
                wall_time=report.outcome.wall_time,
                batch_size=features.batch_size,
                padded_batch_size=features.padded_batch_size,
                sum_context_len=features.sum_context_len,
                max_context_len=features.max_context_len,
                steps=shape.steps,
                topk=shape.topk,
                num_draft_tokens=shape.num_draft_tokens,
                decision_source=str(decision.source),
                policy_version=report.policy_version,
                predicted_step_ms=decision.predicted_ms,
                measured_step_ms=report.outcome.measured_ms,
                predicted_accept_len=decision.predicted_emitted,
                measured_accept_len=report.accept_len,
                emitted_tokens=report.emitted_tokens,
                drafted_tokens=report.drafted_tokens,
                accepted_tokens=report.accepted_tokens,
                goodput=report.goodput,
                runner_up=None if decision.runner_up is None else str(decision.runner_up),
                runner_up_step_ms=decision.runner_up_ms,
                runner_up_accept_len=decision.runner_up_emitted,
                price_drift=None if split is None else split.drift,
                price_tilt=None if split is None else split.tilt,
                price_offset=None if split is None else split.offset,
                accepted_by_depth=report.accepted_by_depth,
                accepted_by_rank=report.accepted_by_rank,
            )
        )

    def steps_unfinished(self, count: int) -> None:
        self.writer.count_unfinished(self.run_id, count)
