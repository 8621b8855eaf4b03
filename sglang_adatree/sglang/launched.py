"""A launched decode step travels on SGLang's result object to the step that completes it.

The worker attaches a ``LaunchedStep`` (its ticket, timing and accepted paths) to the
``GenerationBatchResult`` it returns; when the scheduler's result processor has that result's
accept counts on the CPU, ``finish_on_resolved_tokens`` (a hook the plug-in registers) hands
both to the worker. No queue pairs results with steps, so a result that never comes back
leaves no other step with the wrong record. Light to import: the plug-in registers the hook in
every SGLang process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.controller import StepTicket

# The attribute of SGLang's ``GenerationBatchResult`` that carries a launched step to its
# completion.
LAUNCHED_ATTR = "adatree_launched"


@dataclass(frozen=True)
class LaunchedStep:
    """A launched decode step on rank 0, riding on its result until the accept counts are
    on the CPU."""

    ticket: StepTicket
    # perf_counter seconds the step's time counts from (``step_period_start``)
    started: float
    finished: float | None  # perf_counter seconds; None on GPUs (read the events)
    start_event: Any  # device events bracketing the step on GPUs; None on CPUs
    end_event: Any
    paths: AcceptedPathStats | None  # host copies; None without speculation

    def measured_ms(self) -> float:
        if self.end_event is not None:
            # The scheduler copied this step's results to the host, so the step is done.
            return float(self.start_event.elapsed_time(self.end_event))
        assert self.finished is not None
        return (self.finished - self.started) * 1000.0


def step_period_start(started: float, finished: float, previous_end: float | None) -> float:
    """When a CPU decode step's time counts from: the end of the decode step before it, when
    they ran back to back, else its own start (perf_counter seconds).

    Between two decode steps the scheduler processes the first one's results (streaming them
    out) and prepares the second's batch: about as much host time a step whatever its shape,
    which a step without speculation spends per token and a tree shares over the tokens it
    emits. Left out of the measured time, it priced plain decoding low against speculation by
    that much (docs/results.md). A prefill in between breaks the chain (the worker's
    ``_forward``), and a gap longer than the step itself is not taken for host work (the
    scheduler waited)."""
    if previous_end is None or not previous_end <= started:
        return started
    return previous_end if started - previous_end <= finished - started else started


def finish_on_resolved_tokens(
    ret: Any, processor: Any, result: Any, batch: Any, *args: Any, **kwargs: Any
) -> None:
    """AFTER hook on the scheduler's ``_resolve_spec_v2_tokens(result, batch)``: the result's
    accept counts are on the CPU now; finish the step it carries, if adatree launched it."""
    launched = getattr(result, LAUNCHED_ATTR, None)
    worker = getattr(processor, "model_worker", None)
    if launched is None or not hasattr(worker, "finish_launched_step"):
        return None
    worker.finish_launched_step(launched, result.num_correct_drafts_per_req_cpu)
    return None
