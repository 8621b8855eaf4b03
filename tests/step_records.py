"""Plausible step records for the telemetry tests and the writer's benchmark: values vary with
the step index like a real run's (shapes switching, batch sizes and contexts moving)."""

from __future__ import annotations

import time

from sglang_adatree.telemetry.records import StepRecord

# (steps, topk, num_draft_tokens) cycled through, as an adaptive policy would switch shapes.
SHAPES = ((0, 1, 1), (3, 1, 4), (3, 2, 6), (4, 2, 8), (5, 4, 16))
SOURCES = ("model", "model", "model", "explore", "pin")


def make_step(run_id: int, i: int) -> StepRecord:
    """A plausible step record; values vary with ``i`` like a real run's."""
    steps, topk, num_draft_tokens = SHAPES[i % len(SHAPES)]
    batch_size = 1 + (i * 7) % 32
    accepted = min(steps, 1 + i % 3) * batch_size if steps else 0
    emitted = accepted + batch_size
    step_ms = 8.0 + 0.25 * batch_size + 0.5 * num_draft_tokens
    depth = tuple(accepted // steps for _ in range(steps)) if steps else ()
    return StepRecord(
        run_id=run_id,
        step_index=i,
        wall_time=time.time(),
        batch_size=batch_size,
        padded_batch_size=batch_size,
        sum_context_len=batch_size * (300 + i % 700),
        max_context_len=300 + i % 1500,
        steps=steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        decision_source=SOURCES[i % len(SOURCES)],
        policy_version=3,
        predicted_step_ms=step_ms * 0.97,
        measured_step_ms=step_ms,
        predicted_accept_len=emitted / batch_size * 1.02,
        measured_accept_len=emitted / batch_size,
        emitted_tokens=emitted,
        drafted_tokens=(num_draft_tokens - 1) * batch_size,
        accepted_tokens=accepted,
        goodput=emitted / step_ms * 1000.0,
        runner_up=",".join(map(str, SHAPES[(i + 1) % len(SHAPES)])),
        runner_up_step_ms=step_ms * 1.1,
        runner_up_accept_len=emitted / batch_size * 1.05,
        accepted_by_depth=depth,
        accepted_by_rank=(accepted,) if steps else (),
    )
