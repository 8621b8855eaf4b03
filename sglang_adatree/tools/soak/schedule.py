"""When each activity of a soak happens: the load's phases, the operator's pin cycles, retrain
jobs, bad requests and the database faults, in seconds from the soak's start.

The 30-minute soak is the reference (``FULL_MINUTES``): a pin cycle every minute, a retrain every
10 minutes, the database read-only for a minute and then deleted (or stopped) for 30 s, load
phases of 30 s idle, 90 s of bursts and 120 s of Poisson arrivals. A shorter soak scales every
period and fault by ``minutes / 30`` with a floor for each (``FLOORS_S``), so that a 3-minute
run in CI still pins, retrains, breaks and restores its database, and cycles its load; a longer
soak keeps the 30-minute periods and repeats the faults every 30 minutes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sglang_adatree.telemetry.poller import HEAP_RELEASE_S

FULL_MINUTES = 30.0
# The shortest each period may become in a short soak: a pin must outlive a control poll and a
# few decode steps, a fault must outlive the writer's flush and the dashboard's refresh.
FLOORS_S = {
    "idle": 10.0,
    "burst": 20.0,
    "poisson": 20.0,
    "pin_cycle": 20.0,
    "retrain": 60.0,
    "read_only": 10.0,
    "deleted": 10.0,
    "bad_requests": 20.0,
    "browser_reload": 15.0,
}


class Phase(StrEnum):
    """What the load generator sends during a stretch of the soak."""

    IDLE = "idle"  # nothing: the server sleeps, the dashboard and the operator go on
    BURST = "burst"  # a closed loop of ``burst_concurrency`` clients
    POISSON = "poisson"  # an open loop, exponential gaps at ``poisson_rate`` requests/s


@dataclass(frozen=True)
class LoadPhase:
    phase: Phase
    seconds: float


@dataclass(frozen=True)
class FaultWindow:
    """One planned database outage: read-only from ``start_s``, deleted (SQLite) from
    ``deleted_s``, restored at ``end_s``. PostgreSQL is stopped for the whole window."""

    start_s: float
    deleted_s: float
    end_s: float


@dataclass(frozen=True)
class Schedule:
    """Every period of one soak, derived from its length (``for_minutes``)."""

    minutes: float
    phases: tuple[LoadPhase, ...]  # one cycle, repeated until the end
    pin_cycle_s: float  # pin a shape, change it a third later, clear it a third after that
    retrain_every_s: float
    faults: tuple[FaultWindow, ...]
    bad_requests_every_s: float
    browser_reload_s: float
    burst_concurrency: int = 8
    poisson_rate: float = 0.5  # requests per second
    abort_fraction: float = 0.1  # streamed requests whose client disconnects mid-stream
    greedy_every: int = 4  # every n-th load request is one of the fixed greedy prompts
    rss_every_s: float = 5.0

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0

    @property
    def warmup_s(self) -> float:
        """RSS before this is warm-up (allocator caches, each shape's first run, packed
        weights): the slope starts after it. The pin cycles have run every candidate shape by
        then in a 30-minute soak (two pins a cycle, twelve shapes)."""
        return min(600.0, 0.3 * self.seconds)

    @property
    def rss_window_s(self) -> float:
        """The window whose RSS peaks judge flatness: the server's period of handing freed heap
        back, so each window holds a whole sawtooth tooth; shorter in a short soak, which
        still gets six windows after warm-up."""
        return min(HEAP_RELEASE_S, (self.seconds - self.warmup_s) / 6)

    @classmethod
    def for_minutes(cls, minutes: float) -> Schedule:
        if minutes <= 0:
            raise ValueError(f"a soak needs a positive length, got {minutes} minutes")
        scale = min(1.0, minutes / FULL_MINUTES)

        def period(name: str, full_s: float) -> float:
            return max(FLOORS_S[name], full_s * scale)

        total = minutes * 60.0
        read_only, deleted = period("read_only", 60.0), period("deleted", 30.0)
        # One window at 35% of each 30-minute block (of the whole soak when shorter), after
        # the first retrain and a few pin cycles, with load on both sides of it.
        block = min(total, FULL_MINUTES * 60.0)
        faults = []
        start = 0.35 * block
        while start + read_only + deleted < total:
            faults.append(FaultWindow(start, start + read_only, start + read_only + deleted))
            start += block
        return cls(
            minutes=minutes,
            phases=(
                LoadPhase(Phase.IDLE, period("idle", 30.0)),
                LoadPhase(Phase.BURST, period("burst", 90.0)),
                LoadPhase(Phase.POISSON, period("poisson", 120.0)),
            ),
            pin_cycle_s=period("pin_cycle", 60.0),
            retrain_every_s=period("retrain", 600.0),
            faults=tuple(faults),
            bad_requests_every_s=period("bad_requests", 60.0),
            browser_reload_s=period("browser_reload", 30.0),
        )

    def phase_at(self, t: float) -> tuple[LoadPhase, float]:
        """The load phase at ``t`` seconds and the seconds left in it."""
        cycle = sum(p.seconds for p in self.phases)
        offset = t % cycle
        for p in self.phases:
            if offset < p.seconds:
                return p, p.seconds - offset
            offset -= p.seconds
        return self.phases[-1], 0.0  # not reached: offset < cycle

    def to_json(self) -> dict:
        return {
            "minutes": self.minutes,
            "load_phases_s": {str(p.phase): p.seconds for p in self.phases},
            "burst_concurrency": self.burst_concurrency,
            "poisson_rate": self.poisson_rate,
            "abort_fraction": self.abort_fraction,
            "pin_cycle_s": self.pin_cycle_s,
            "retrain_every_s": self.retrain_every_s,
            "bad_requests_every_s": self.bad_requests_every_s,
            "browser_reload_s": self.browser_reload_s,
            "faults_s": [[w.start_s, w.deleted_s, w.end_s] for w in self.faults],
            "rss_warmup_s": self.warmup_s,
            "rss_window_s": self.rss_window_s,
        }
