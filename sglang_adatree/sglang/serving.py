"""Builds the adaptive runtime for a worker from SGLang's resolved configuration."""

from __future__ import annotations

import atexit
import logging
import socket
from typing import Any

import sglang
from sglang.srt.runtime_context import get_parallel, get_schedule, get_spec

import sglang_adatree
from sglang_adatree.config import load_config
from sglang_adatree.runtime import AdaTreeRuntime
from sglang_adatree.telemetry.records import RunRecord

logger = logging.getLogger(__name__)


def create_runtime(worker: Any) -> AdaTreeRuntime:
    """The runtime of one serving rank; rank 0 records telemetry and polls operator control."""
    config = load_config()
    rank = get_parallel().tp_rank
    server_args = worker.server_args
    metrics = None
    if rank == 0 and getattr(server_args, "enable_metrics", False):
        from sglang_adatree.metrics import AdaTreeMetrics

        name = server_args.served_model_name or server_args.model_path
        metrics = AdaTreeMetrics({"model_name": str(name)})
    run = None
    if rank == 0:
        run = RunRecord(
            target_model=str(server_args.model_path),
            draft_model=get_spec().speculative_draft_model_path,
            device=str(worker.device),
            sglang_version=sglang.__version__,
            package_version=sglang_adatree.__version__,
            config=config.to_dict(),
            node=socket.gethostname(),
            rank=rank,
        )
    runtime = AdaTreeRuntime(
        config,
        run,
        metrics=metrics,
        max_batch_size=get_schedule().max_running_requests or 256,
        control=rank == 0,
    )
    atexit.register(runtime.close)
    logger.info(
        "adatree: rank %d, %d candidate shapes, telemetry %s",
        rank,
        len(runtime.candidate_shapes),
        f"run {runtime.run_id}" if runtime.run_id is not None else "off",
    )
    return runtime
