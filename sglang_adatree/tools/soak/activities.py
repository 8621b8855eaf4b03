"""The soak's timed activities: each runs on a thread of its own at the soak times it is given,
and logs its exceptions instead of ending the soak. The database faults are timed here too,
and each records when it happened and the planned outage it opens or closes (the window in
which the dashboard may answer 503)."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_adatree.tools.soak.faults import DatabaseFaults, PostgresFaults, SqliteFaults
from sglang_adatree.tools.soak.schedule import Schedule
from sglang_adatree.tools.soak.tally import SoakClock

Event = tuple[float, Callable[[], object]]  # (soak time, action)


def times(start: float, every: float, end: float) -> list[float]:
    """``start``, ``start + every``, ... before ``end``."""
    out, t = [], start
    while t < end:
        out.append(t)
        t += every
    return out


def after_faults(t: float, schedule: Schedule, margin_s: float = 5.0) -> float:
    """``t``, or just after the fault window it falls in (a retrain reads the database)."""
    for w in schedule.faults:
        if w.start_s - margin_s <= t <= w.end_s:
            return w.end_s + margin_s
    return t


class Activities:
    """Threads running timed actions until ``stop``."""

    def __init__(self, clock: SoakClock, stop: threading.Event) -> None:
        self.clock = clock
        self.stop = stop
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []

    def at(self, name: str, events: list[Event]) -> None:
        """Run each action of ``events`` at its time, in order, on one thread."""

        def loop() -> None:
            for t, action in events:
                if self.stop.wait(max(0.0, t - self.clock.now())):
                    return
                try:
                    action()
                except Exception as exc:
                    where = traceback.format_exc().strip().splitlines()[-3:]
                    self.errors.append(f"{name} at {self.clock.now():.0f} s: {exc!r} {where}")

        thread = threading.Thread(target=loop, name=f"soak-{name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def every(self, name: str, at_times: list[float], action: Callable[[], object]) -> None:
        self.at(name, [(t, action) for t in at_times])

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout)


@dataclass
class FaultLog:
    """What the faults did, and the planned outages: (start, end) in soak seconds."""

    steps: list[dict] = field(default_factory=list)
    outages: list[tuple[float, float]] = field(default_factory=list)

    def planned(self, t: float, grace_s: float) -> bool:
        return any(a <= t <= b + grace_s for a, b in self.outages)


def fault_events(
    faults: DatabaseFaults, schedule: Schedule, clock: SoakClock, log: FaultLog
) -> list[Event]:
    """The schedule's fault windows as timed actions on ``faults``."""

    def step(what: str, action: Callable[[], None], opens: bool, closes: bool) -> Callable:
        def run() -> None:
            before = clock.now()
            if opens:  # from the first moment: the action itself takes time
                log.outages.append((before, float("inf")))
            entry: dict = {"at_s": round(before, 1), "what": what}
            try:
                action()
            except Exception as exc:  # the window goes on: the next step may still work
                entry["error"] = f"{type(exc).__name__}: {exc}"
            log.steps.append(entry)
            if closes:
                log.outages[-1] = (log.outages[-1][0], clock.now())

        return run

    events: list[Event] = []
    for w in schedule.faults:
        if isinstance(faults, SqliteFaults):
            events += [
                (w.start_s, step("read-only", faults.read_only, True, False)),
                (w.deleted_s, step("deleted", faults.delete, False, False)),
                (w.end_s, step("restored", faults.restore, False, True)),
            ]
        elif isinstance(faults, PostgresFaults):
            events += [
                (w.start_s, step("stopped", faults.stop, True, False)),
                (w.end_s, step("started", faults.start, False, True)),
            ]
    return events
