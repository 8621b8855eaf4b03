"""Tensor parallelism: every rank runs rank 0's shape, even when their measurements differ.

Two real processes in a gloo group, each with its own runtime fed different step times (as
two GPUs measure differently). Without the broadcast their decisions drift apart; with it they
agree every step.
"""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.runtime import AdaTreeRuntime, broadcast_decision

STEPS = 60


class GlooGroup:
    """The part of SGLang's GroupCoordinator that broadcast_decision uses, over gloo."""

    def __init__(self) -> None:
        self.world_size = dist.get_world_size()
        self.rank_in_group = dist.get_rank()

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]


def _rank(rank: int, port: int, broadcast: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = GlooGroup()
    # One warm-up round measures every shape: what sets rank 1 apart is how shapes differ (a
    # cost common to all of them moves the cost model's global correction, not the decision).
    config = AdaTreeConfig().replace(
        candidate_shapes="0;1,1,2;3,1,4;2,2,4", warmup_steps=4, explore_fraction=0.0,
        record_steps=False, residual_decay=0.5,
    )  # fmt: skip
    runtime = AdaTreeRuntime(config, None, control=False)
    shapes = []
    for step in range(STEPS):
        decision, features = runtime.decide([100 + step, 80])
        if broadcast:
            decision = broadcast_decision(decision, group)
        shapes.append(str(decision.shape))
        # Rank 1's hardware makes speculation look expensive, rank 0's makes it cheap.
        cost = 10.0 * decision.shape.num_draft_tokens if rank == 1 else 10.0
        runtime.complete_step(decision, features, cost, [2, 2])
    everyone = [None, None]
    dist.all_gather_object(everyone, shapes)
    if rank == 0:
        out.put(everyone)
    dist.destroy_process_group()


def _run(broadcast: bool) -> list[list[str]]:
    from sglang_servers import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, broadcast, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return result


@pytest.mark.parametrize("broadcast", [False, True])
def test_ranks_agree_only_with_the_broadcast(broadcast):
    rank0, rank1 = _run(broadcast)
    if broadcast:
        assert rank0 == rank1
    else:
        assert rank0 != rank1, "the scenario must make independent decisions drift apart"
