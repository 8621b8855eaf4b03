"""Interleaved timing for the scripts' micro-benchmarks of one product against another.

Every round runs each call once, in the same order, so drift on a shared, noisy machine (other
jobs, frequency changes, a cache another process evicted) falls on all of them alike; medians
then compare the calls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def interleaved_medians(calls: Mapping[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each call over ``rounds`` rounds that run every call once."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            tic = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - tic) * 1000.0)
    return {name: statistics.median(t) for name, t in times.items()}
