"""Tensor parallelism: only rank 0 decides; every rank runs its plan.

Two real processes in a gloo group. Rank 0 holds the step controller and feeds it its
measurements; rank 1 holds none and receives each step's plan (shape, source, whether the
draft's extend runs) by broadcast, so the ranks agree every step, catch-ups included.
"""

from __future__ import annotations

import os

import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.controller import (
    BatchView,
    StepController,
    StepOutcome,
    plan_on_every_rank,
)

STEPS = 60


class GlooGroup:
    """The part of SGLang's GroupCoordinator that plan_on_every_rank uses, over gloo."""

    def __init__(self) -> None:
        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = GlooGroup()
    config = AdaTreeConfig().replace(
        candidate_shapes="0;1,1,2;3,1,4;2,2,4", warmup_steps=4, explore_fraction=0.0,
        record_steps=False, residual_decay=0.5,
    )  # fmt: skip
    controller = StepController(config) if rank == 0 else None
    plans = []
    for step in range(STEPS):
        view = BatchView(("a", "b"), (100 + step, 80 + step))
        plan, ticket = plan_on_every_rank(controller, view, group)
        assert (ticket is None) == (rank != 0)
        plans.append((str(plan.shape), str(plan.source), plan.skips_draft_extend))
        if ticket is not None:
            # Speculation looks cheap on rank 0's hardware: its decisions move with it.
            accepted = (min(1, plan.shape.steps),) * 2
            controller.finish(ticket, StepOutcome(10.0 + step % 3, accepted, float(step)))
    everyone = [None, None]
    dist.all_gather_object(everyone, plans)
    if rank == 0:
        out.put(everyone)
    dist.destroy_process_group()


def _run() -> list[list[tuple[str, str, bool]]]:
    from sglang_servers import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return result


def test_only_rank_0_decides_and_every_rank_runs_its_plan():
    rank0, rank1 = _run()
    assert rank0 == rank1
    # The run covered what the plan carries: warm-up of every shape and a catch-up step.
    assert {source for _, source, _ in rank0} >= {"warmup", "catch-up"}
    assert any(skips for _, _, skips in rank0)
