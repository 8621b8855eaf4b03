"""Wires one serving rank's adaptive loop from SGLang's resolved configuration.

Rank 0 gets everything: the step controller (the policy and its estimates), its sinks (the
telemetry writer for this run, the Prometheus series under ``--enable-metrics``) and the control
poller. Other tensor-parallel ranks get nothing: they run the plan rank 0 broadcasts.
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

    def server_state(self) -> dict[str, Any]:
        """``GET /server_info``'s ``internal_states`` entries: the controller's, and the run's."""
        return {**self.controller.server_state(), "adatree_run_id": self.run_id}

    def close(self) -> None:
        """Stop polling, then flush telemetry and close the run."""
        if self.poller is not None:
            self.poller.close()
        if self.writer is not None:
            if self.run_id is not None:
                self.writer.stop_run(self.run_id)
            self.writer.close()


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
    if getattr(server_args, "enable_metrics", False):
        from sglang_adatree.telemetry.metrics import AdaTreeMetrics

        name = server_args.served_model_name or server_args.model_path
        sinks.append(AdaTreeMetrics({"model_name": str(name)}))
    controller = StepController(
        config,
        padding=padding,
        max_batch_size=get_schedule().max_running_requests or 256,
        sinks=sinks,
    )
    poller = ControlPoller(controller, config.resolved_db_url, config.control_poll_s)
    loop = ServingLoop(controller, run_id, writer, poller)
    atexit.register(loop.close)
    logger.info(
        "adatree: %d candidate shapes, CUDA-graph batch sizes %s, telemetry %s",
        len(controller.candidate_shapes),
        list(padding.capture_sizes) or "none",
        f"run {run_id}" if run_id is not None else "off",
    )
    return loop
