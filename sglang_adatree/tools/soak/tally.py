"""What a soak observes, counted from several threads: load requests by outcome, greedy answers,
dashboard responses, and the soak's clock.

Counters take a lock per event (a few per second); reading them happens once, at the end.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass

SERVED = "served"
ABORTED = "aborted_by_client"  # the soak's own disconnects mid-stream, on purpose


class SoakClock:
    """Seconds since the soak started (monotonic: the system clock may step mid-soak, so times
    in the database are compared with each other, never with these)."""

    def __init__(self) -> None:
        self._mono = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._mono


class RequestTally:
    """Load requests by outcome: served, aborted by the client, or failed by cause."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: Counter[str] = Counter()
        self._examples: dict[str, str] = {}
        self._by_phase: Counter[str] = Counter()

    def add(self, outcome: str, phase: str, detail: str = "") -> None:
        with self._lock:
            self._outcomes[outcome] += 1
            self._by_phase[phase] += 1
            if detail and outcome not in self._examples:
                self._examples[outcome] = detail[:300]

    def to_json(self) -> dict:
        with self._lock:
            failed = {k: v for k, v in self._outcomes.items() if k not in (SERVED, ABORTED)}
            return {
                "sent": sum(self._outcomes.values()),
                "served": self._outcomes[SERVED],
                "aborted_by_client": self._outcomes[ABORTED],
                "failed": sum(failed.values()),
                "failed_by_cause": dict(sorted(failed.items())),
                "failure_examples": dict(self._examples),
                "sent_by_phase": dict(self._by_phase),
            }


class GreedyAnswers:
    """The fixed greedy prompts: the reference server's token ids, and every answer the soaked
    server gave, compared token for token."""

    def __init__(self, texts: tuple[str, ...], reference: tuple[tuple[int, ...], ...]) -> None:
        assert len(texts) == len(reference)
        self.texts = texts
        self.reference = reference
        self._lock = threading.Lock()
        self._compared = 0
        self._differing: list[dict] = []

    def check(self, index: int, output_ids: list[int], t: float) -> bool:
        """Record one answer to prompt ``index``; True when it equals the reference's."""
        expected = self.reference[index]
        same = tuple(output_ids) == expected
        with self._lock:
            self._compared += 1
            if not same:
                first = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(output_ids, expected, strict=False))
                        if a != b
                    ),
                    min(len(output_ids), len(expected)),
                )
                self._differing.append(
                    {"prompt": index, "at_s": round(t, 1), "first_differing_token": first}
                )
        return same

    def to_json(self) -> dict:
        with self._lock:
            return {
                "prompts": len(self.texts),
                "answers_compared": self._compared,
                "answers_differing": len(self._differing),
                "differing": self._differing[:20],
            }


@dataclass(frozen=True)
class DashboardResponse:
    at_s: float
    client: str  # "browser", "operator"
    method: str
    path: str
    status: int


class DashboardLog:
    """Every response the dashboard gave the soak's browser and operator."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: list[DashboardResponse] = []

    def add(self, response: DashboardResponse) -> None:
        with self._lock:
            self.responses.append(response)

    def snapshot(self) -> list[DashboardResponse]:
        with self._lock:
            return list(self.responses)
