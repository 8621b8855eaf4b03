"""Wires one serving rank's adaptive loop from SGLang's resolved configuration.

Rank 0 gets everything: the step controller (the policy and its estimates), its sinks (the
telemetry writer for this run, the Prometheus series under ``--enable-metrics``, with the
writer's health sampled into them once a second) and the control poller. Other
tensor-parallel ranks get nothing: they run the plan rank 0 broadcasts.
"""

from __future__ import annotations

import atexit
import logging
import socket
from dataclasses import dataclass
from typing import Any

import sglang
from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec

import sglang_adatree
from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.controller import StepController, StepSink
from sglang_adatree.core.features import GraphPadding
from sglang_adatree.core.step_profile import load_profile_step_time
from sglang_adatree.telemetry.poller import ControlPoller
from sglang_adatree.telemetry.records import RunRecord

logger = logging.getLogger(__name__)


@dataclass
class ServingLoop:
    """Rank 0's controller with what feeds and reads it; closed at exit."""

    controller: StepController
    run_id: int | None
    writer: Any  # telemetry.writer.TelemetryWriter, or None without telemetry
    poller: ControlPoller | None
    health: Any = None  # telemetry.metrics.TelemetryHealthSampler, with writer and metrics

    def server_state(self) -> dict[str, Any]:
        """``GET /server_info``'s ``internal_states`` entries: the controller's, the run's and
        the telemetry writer's counters (``telemetry.writer.WriterStats``)."""
        state = {**self.controller.server_state(), "adatree_run_id": self.run_id}
        if self.writer is not None:
            stats = self.writer.stats()
            state.update(
                {
                    "adatree_telemetry_queued": stats.queued,
                    "adatree_telemetry_rows_written": stats.written,
                    "adatree_telemetry_write_failures": stats.failures,
                    "adatree_telemetry_dropped": stats.dropped,
                    "adatree_telemetry_rejected": stats.rejected,
                    "adatree_telemetry_lost": stats.lost,
                    "adatree_telemetry_database_down": stats.down,
                    "adatree_telemetry_last_error": stats.last_error,
                }
            )
        return state

    def close(self) -> None:
        """Stop polling, then flush telemetry and close the run."""
        if self.poller is not None:
            self.poller.close()
        if self.writer is not None:
            if self.run_id is not None:
                self.writer.stop_run(self.run_id)
            self.writer.close()
        if self.health is not None:
            self.health.close()


def create_serving_loop(
    worker: Any, config: AdaTreeConfig, padding: GraphPadding
) -> ServingLoop | None:
    """Rank 0's serving loop for ``worker``; None on the other tensor-parallel ranks."""
    if get_parallel().tp_rank != 0:
        return None
    server_args = worker.server_args
    sinks: list[StepSink] = []
    writer = None
    run_id = None
    if config.record_steps:
        from sglang_adatree.telemetry.sink import TelemetrySink
        from sglang_adatree.telemetry.writer import TelemetryWriter

        writer = TelemetryWriter.from_config(config)
        run_id = writer.start_run(
            RunRecord(
                target_model=str(server_args.model_path),
                draft_model=get_spec().speculative_draft_model_path,
                device=str(worker.device),
                sglang_version=sglang.__version__,
                package_version=sglang_adatree.__version__,
                config={
                    **config.to_dict(),
                    "cuda_graph_batch_sizes": list(padding.capture_sizes),
                },
                node=socket.gethostname(),
                rank=0,
            )
        )
        sinks.append(TelemetrySink(writer, run_id))
    health = None
    if getattr(server_args, "enable_metrics", False):
        from sglang_adatree.telemetry.metrics import AdaTreeMetrics, TelemetryHealthSampler

        name = server_args.served_model_name or server_args.model_path
        metrics = AdaTreeMetrics({"model_name": str(name)})
        sinks.append(metrics)
        if writer is not None:
            health = TelemetryHealthSampler(metrics, writer.stats)
    profile = None
    if config.step_time_profile:
        profile = load_profile_step_time(config.step_time_profile, config.candidate_shapes)
    controller = StepController(
        config,
        padding=padding,
        max_batch_size=get_schedule().max_running_requests or 256,
        sinks=sinks,
        profile=profile,
    )
    poller = ControlPoller(controller, config.resolved_db_url, config.control_poll_s)
    loop = ServingLoop(controller, run_id, writer, poller, health)
    atexit.register(loop.close)
    logger.info(
        "adatree: %d candidate shapes, CUDA-graph batch sizes %s, telemetry %s, step times %s",
        len(controller.candidate_shapes),
        list(padding.capture_sizes) or "none",
        f"run {run_id}" if run_id is not None else "off",
        f"from {config.step_time_profile}" if profile else "refitted on this server's steps",
    )
    return loop
