"""Where a decode step's time goes: model forwards against everything around them.

Off unless ``ADATREE_PROFILE_PATH`` names a file. Then every ``ModelRunner.forward`` call (the
target's verify pass, each draft pass, the draft extend) is timed, and the worker appends one
JSON line per decode step to that file: the shape, the shape of the step logged before it, the
decision's source, the emitted tokens per request (speculative steps), the batch size and its
summed context length, the step's wall time and the part of it spent inside model forwards, all
of them and the draft's. ``adatree
profile`` reads these lines to report the overhead of the speculative machinery around the
models, the served step times and acceptance a model card can quote (``adatree models evaluate
--card --served``), and a step-time profile of the policy lab (``--profile-out``).

Forward times are host wall time, which on a CPU is the computation itself; on a GPU they
would only cover kernel launches, so the profile is a CPU tool.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

PROFILE_ENV = "ADATREE_PROFILE_PATH"


class ForwardClock:
    """Seconds spent inside model forwards, summed since the process started; the draft's
    share (its ``ModelRunner`` is a draft worker's) also on its own."""

    seconds = 0.0
    draft_seconds = 0.0
    calls = 0


def _timed_forward(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    started = time.perf_counter()
    try:
        return original(*args, **kwargs)
    finally:
        elapsed = time.perf_counter() - started
        ForwardClock.seconds += elapsed
        ForwardClock.calls += 1
        if args and getattr(args[0], "is_draft_worker", False):
            ForwardClock.draft_seconds += elapsed


def install_hooks() -> None:
    """Time model forwards when profiling is requested (registered at plug-in load)."""
    if not os.environ.get(PROFILE_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        _timed_forward,
        HookType.AROUND,
    )


class StepProfiler:
    """Appends one JSON line per decode step while profiling is on; a no-op otherwise."""

    def __init__(self) -> None:
        path = os.environ.get(PROFILE_ENV)
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - lives with the worker
        self._forward_s = 0.0
        self._draft_s = 0.0
        self._calls = 0
        self._previous_shape: str | None = None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def begin(self) -> None:
        self._forward_s = ForwardClock.seconds
        self._draft_s = ForwardClock.draft_seconds
        self._calls = ForwardClock.calls

    def end(
        self,
        shape: str,
        batch_size: int,
        step_s: float,
        source: str = "",
        emitted: float | None = None,
        sum_context_len: int | None = None,
    ) -> None:
        if self._file is None:
            return
        record = {
            "shape": shape,
            # A step right after one of another shape pays for the change (on a CPU a plain
            # decode after a speculative step, by far the most): ``lab.measured`` leaves it out.
            "previous_shape": self._previous_shape,
            "source": source,  # the decision's: a catch-up step is no speculation plus an extend
            "emitted": emitted,  # tokens per request, speculative steps only
            "batch_size": batch_size,
            "sum_context_len": sum_context_len,  # prompt + output tokens of the batch's requests
            "step_ms": step_s * 1000.0,
            "forward_ms": (ForwardClock.seconds - self._forward_s) * 1000.0,
            "draft_forward_ms": (ForwardClock.draft_seconds - self._draft_s) * 1000.0,
            "forward_calls": ForwardClock.calls - self._calls,
        }
        self._file.write(json.dumps(record) + "\n")
        self._previous_shape = shape
