"""The control poller: operator control and new cost models, handed to the step controller.

A background thread of the serving rank 0. At start and then every ``control_poll_s`` it reads
the active pins and policy version from the store (``telemetry.control``), and hands the step
controller one ``ControlUpdate`` when something changed:

* pins: the active pins of candidate shapes, newest first;
* a newly activated policy version: its XGBoost model loaded and tabulated here (seconds, never
  on the decode loop), corrected by the steps this server measured;
* no version active: the analytic model refitted on this server's measured steps on the
  schedule of ``core.refit`` (TurboSpec's closed loop), or the deployment's step-time profile,
  never refitted; after a rollback to no version, at once.

A database that cannot be read leaves serving as it is; the poller logs once when reading fails
and once when it works again.

glibc keeps freed pages in its heap: only a free stretch at the heap's top goes back to the
system by itself. A replaced policy version (an XGBoost booster and its table) is freed on the
decode loop, so each activation would leave the server's RSS higher for good by about the size
of the model it replaced; and the decode loop's short-lived tensors, freed between longer-lived
blocks, leave the heap's high-water mark resident, so the process's RSS creeps up for as long
as it serves while the memory it uses does not. The poller hands the free pages back
(``malloc_trim``, the whole process's heap, SGLang's part included) once the controller has
applied a version that came or went, and every ``heap_release_s`` besides. A release walks the
heap's free chunks under each arena's lock, tens of milliseconds on a large fragmented heap
during which the decode loop's allocations wait, so it runs on that clock and at version
changes, not after the frequent analytic refits. A CPU server started by ``adatree serve`` runs
on tcmalloc (``sglang.allocator``), which reuses freed memory within its size classes, so its
steady decode loop stops growing once its working set is reached; but it keeps what a burst took
(a database outage's backlog of rows, say) until asked to give back its free spans, which the
same release does.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from sglang_adatree.core.controller import ControlUpdate, StepController
from sglang_adatree.core.policy import Pin
from sglang_adatree.core.xgb_cost import ArtifactError, XGBoostStepTime
from sglang_adatree.telemetry.control import read_control_state
from sglang_adatree.telemetry.store import display_url

logger = logging.getLogger(__name__)

# A release every few minutes bounds the creep to what a few minutes of serving leave behind,
# for arena locks held tens of milliseconds once in that time.
HEAP_RELEASE_S = 180.0


def release_freed_heap() -> bool:
    """Return the allocators' free pages to the system: tcmalloc's free spans where it is
    loaded (``MallocExtension_ReleaseFreeMemory``), glibc's free heap (``malloc_trim``); False
    where neither is there."""
    process = ctypes.CDLL(None)
    released = False
    for name, args in (("MallocExtension_ReleaseFreeMemory", ()), ("malloc_trim", (0,))):
        release = getattr(process, name, None)
        if release is not None:
            release(*args)
            released = True
    return released


class ControlPoller:
    """Polls ``db_url`` for ``controller``; see the module docstring."""

    def __init__(
        self,
        controller: StepController,
        db_url: str,
        poll_s: float,
        *,
        start: bool = True,
        heap_release_s: float = HEAP_RELEASE_S,  # 0: only when a version comes or goes
    ) -> None:
        self.controller = controller
        self.db_url = db_url
        self.poll_s = poll_s
        self.heap_release_s = heap_release_s
        self._released_at = time.monotonic()
        self._known_version: int | None = None
        self._failed_version: int | None = None
        self._pins: tuple[Pin, ...] = ()
        self._down_since: float | None = None
        self._model_handed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="adatree-control", daemon=True)
            self._thread.start()

    def poll(self) -> ControlUpdate | None:
        """Read the store once and hand the controller what changed (also returned)."""
        now = time.monotonic()
        if self._model_handed and not self.controller.updates_pending:
            # The decode loop has swapped the model in and dropped the one it replaced.
            self._model_handed = False
            self._released_at = now
            release_freed_heap()
        elif 0 < self.heap_release_s <= now - self._released_at:
            self._released_at = now
            release_freed_heap()
        update = self._read()
        if update is None and self._known_version is None:
            update = self.controller.refit()
        if update is not None:
            self.controller.apply(update)
        return update

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        # Read first, then wait: a pin or policy version set before the server started applies
        # from its first decode steps, not a poll interval later.
        while True:
            try:
                self.poll()
            except Exception:  # a bug here must not end control for the server's life
                logger.exception("adatree: control poll failed")
            if self._stop.wait(self.poll_s):
                return

    def _read(self) -> ControlUpdate | None:
        """The store's pins and policy version as an update, or None if nothing changed."""
        try:
            state = read_control_state(self.db_url, self._known_version)
        except Exception as exc:  # the database may be down; serving goes on as it is
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.warning(
                    "adatree: cannot read pins / policy versions from %s (%s); serving goes on "
                    "with the current ones",
                    display_url(self.db_url),
                    str(exc).splitlines()[0],
                )
            return None
        if self._down_since is not None:
            logger.warning(
                "adatree: pins / policy versions readable again after %.1f s",
                time.monotonic() - self._down_since,
            )
            self._down_since = None
        candidates = self.controller.candidate_shapes
        pins = tuple(r.pin for r in state.pins if r.shape in candidates)
        new_pins = pins if pins != self._pins else None
        self._pins = pins
        update = None
        if state.policy is not None and state.policy.version != self._failed_version:
            version = state.policy.version
            try:
                model = XGBoostStepTime.from_bytes(state.policy.artifact)
                update = self.controller.tabulate(model, version)
                self._known_version = version
                self._model_handed = True
            except (ArtifactError, ValueError) as exc:
                logger.error(
                    "adatree: policy version %s cannot be loaded (%s); keeping the current "
                    "cost model",
                    version,
                    exc,
                )
                self._failed_version = version
        elif state.active_policy_version is None and self._known_version is not None:
            # Rolled back to no trained version: the refitted analytic model (or the profile)
            # again, now.
            self._known_version = None
            update = self.controller.refit(force=True)
            self._model_handed = True
        if new_pins is None:
            return update
        if update is None:
            return ControlUpdate(pins=new_pins)
        return ControlUpdate(
            new_pins, update.cost_model, update.policy_version, update.model_source
        )
