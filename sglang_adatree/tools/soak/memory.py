"""Memory of a server's process tree: RSS over the soak (its slope after warm-up) and, at the
end, RSS and USS per process beside the reference server's.

The slope that judges flatness is that of the series' upper envelope: the peak of each window
as long as the control poller's period of handing freed heap back to the system. Those releases
make RSS a sawtooth (down by up to a few hundred MB, then the load takes the pages again), and
a least-squares line through every sample then reads the sawtooth's phase at the soak's two
ends as much as any growth. A leak raises every window's peak; a release lowers none of them.

RSS is split by kind as it is sampled: anonymous pages (the heaps: Python's, the C library's,
torch's tensors) and resident pages of mapped files or shared memory (``statm``'s shared
count: libraries and weights read through a mapping, which the kernel can drop and read
again). Growth in the first is memory held; in the second, mostly a mapping's pages touched
for the first time.

RSS counts pages shared between processes (the torch and Python libraries every SGLang process
maps) once per process, so the sum over a server's processes overstates what it holds; USS
(pages only that process holds, from ``/proc/PID/smaps``) is what stopping it would free.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass

import psutil

from sglang_adatree.sglang import allocator

MB = 1024 * 1024


@dataclass(frozen=True)
class ProcessMemory:
    role: str  # SGLang's process title (sglang::scheduler, ...) or the launcher
    pid: int
    rss_mb: float
    uss_mb: float | None  # None when smaps could not be read
    allocator: str = "unknown"  # tcmalloc, system (glibc's malloc), ...: from its mappings

    def to_json(self) -> dict:
        return asdict(self)


def _role(process: psutil.Process) -> str:
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return "?"
    first = cmdline[0] if cmdline else process.name()
    if first.startswith("sglang::"):
        return first
    if "sglang.launch_server" in cmdline or any("adatree" in c for c in cmdline[:2]):
        return "launcher (HTTP server, tokenizer)"
    if any("resource_tracker" in c for c in cmdline):
        return "multiprocessing resource tracker"
    return first.rsplit("/", 1)[-1]


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def per_process(pid: int) -> list[ProcessMemory]:
    """RSS and USS of every process of the tree (reads each one's smaps: call it rarely)."""
    out = []
    for p in tree(pid):
        try:
            info = p.memory_full_info()
            rss, uss = info.rss / MB, info.uss / MB
        except psutil.AccessDenied:
            rss, uss = p.memory_info().rss / MB, None
        except psutil.NoSuchProcess:
            continue
        out.append(ProcessMemory(_role(p), p.pid, rss, uss, allocator.mapped_allocator(p.pid)))
    return sorted(out, key=lambda m: -m.rss_mb)


def envelopes(
    samples: list[tuple[float, float]], window_s: float
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The peak and the floor of each consecutive ``window_s`` of (seconds, MB) samples, each
    at the time it was sampled; a window whose samples end before its middle (the last one,
    cut short by the soak's end, or one the sampler stalled in) is left out, since its peak
    would be sampled over less time than the others'."""
    if not samples or window_s <= 0:
        return [], []
    peaks: list[tuple[float, float]] = []
    floors: list[tuple[float, float]] = []
    first = samples[0][0]
    windows: dict[int, list[tuple[float, float]]] = {}
    for t, m in samples:
        windows.setdefault(int((t - first) // window_s), []).append((t, m))
    for index, window in sorted(windows.items()):
        if window[-1][0] - (first + index * window_s) >= window_s / 2:
            peaks.append(max(window, key=lambda s: s[1]))
            floors.append(min(window, key=lambda s: s[1]))
    return peaks, floors


def slope_mb_per_min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples, in MB per minute; None under 3 samples."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (m - mean_m) for t, m in samples)
    return cov / var * 60.0


class RssSampler:
    """The tree's RSS every ``every_s`` seconds, in total and per process role, on a daemon
    thread. Per role, so a slope says which process grows: the scheduler (the models, the
    draft's runtime state, adatree's controller and telemetry writer) or SGLang's others."""

    def __init__(self, pid: int, clock, every_s: float) -> None:
        self.pid = pid
        self.clock = clock
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []
        self.by_role: dict[str, list[tuple[float, float]]] = {}
        self.by_kind: dict[str, list[tuple[float, float]]] = {"anonymous": [], "file_or_shared": []}
        self._roles: dict[int, str] = {}  # pid -> role: a process's title is read once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _sample(self) -> None:
        now = self.clock.now()
        roles: dict[str, float] = {}
        shared = 0.0
        for p in tree(self.pid):
            with contextlib.suppress(psutil.Error):
                role = self._roles.get(p.pid)
                if role is None:
                    role = self._roles[p.pid] = _role(p)
                info = p.memory_info()
                roles[role] = roles.get(role, 0.0) + info.rss / MB
                # ``shared`` is Linux's (resident file-backed and shared-memory pages).
                shared += getattr(info, "shared", 0) / MB
        total = sum(roles.values())
        self.samples.append((now, total))
        self.by_kind["anonymous"].append((now, total - shared))
        self.by_kind["file_or_shared"].append((now, shared))
        for role, mb in roles.items():
            self.by_role.setdefault(role, []).append((now, mb))

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.every_s):
                return

    def to_json(self, warmup_s: float, window_s: float) -> dict:
        out = _series_json(self.samples, warmup_s, window_s)
        out["per_process"] = [
            {"role": role, **_series_json(samples, warmup_s, window_s, keep_samples=False)}
            for role, samples in sorted(self.by_role.items(), key=lambda kv: -kv[1][-1][1])
        ]
        out["by_kind"] = {
            kind: _series_json(samples, warmup_s, window_s, keep_samples=False)
            for kind, samples in self.by_kind.items()
        }
        return out


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _series_json(
    samples: list[tuple[float, float]],
    warmup_s: float,
    window_s: float,
    keep_samples: bool = True,
) -> dict:
    """Start, end, max and the slopes after warm-up of one RSS series: of its peaks and its
    floors over windows of ``window_s`` (the peaks' judges flatness), of every sample, and of
    every sample over the later half, which tells growth that is settling (an allocator's
    caches filling) from growth that goes on (a leak): the first is steeper early than late."""
    after = [(t, m) for t, m in samples if t >= warmup_s]
    middle = (after[0][0] + after[-1][0]) / 2 if after else 0.0
    late = [(t, m) for t, m in after if t >= middle]
    peaks, floors = envelopes(after, window_s)
    out = {
        "start_mb": round(samples[0][1], 1) if samples else None,
        "end_mb": round(samples[-1][1], 1) if samples else None,
        "max_mb": round(max(m for _, m in samples), 1) if samples else None,
        "slope_after_s": warmup_s,
        "envelope_window_s": window_s,
        "peak_slope_mb_per_min": _rounded(slope_mb_per_min(peaks)),
        "floor_slope_mb_per_min": _rounded(slope_mb_per_min(floors)),
        "slope_mb_per_min": _rounded(slope_mb_per_min(after)),
        "late_slope_mb_per_min": _rounded(slope_mb_per_min(late)),
    }
    if keep_samples:
        out["samples"] = [[round(t, 1), round(m, 1)] for t, m in samples]
    return out


def comparison(ours: list[ProcessMemory], reference: list[ProcessMemory]) -> dict:
    """Per role, the soaked server's memory beside the reference's, and the difference."""

    def by_role(items: list[ProcessMemory]) -> dict[str, ProcessMemory]:
        return {m.role: m for m in items}

    mine, theirs = by_role(ours), by_role(reference)
    roles = []
    for role in sorted(set(mine) | set(theirs)):
        a, b = mine.get(role), theirs.get(role)
        roles.append(
            {
                "role": role,
                "adatree_rss_mb": None if a is None else round(a.rss_mb, 1),
                "reference_rss_mb": None if b is None else round(b.rss_mb, 1),
                "adatree_uss_mb": None if a is None or a.uss_mb is None else round(a.uss_mb, 1),
                "reference_uss_mb": None if b is None or b.uss_mb is None else round(b.uss_mb, 1),
                "adatree_allocator": None if a is None else a.allocator,
                "reference_allocator": None if b is None else b.allocator,
            }
        )

    def total(items: list[ProcessMemory], uss: bool) -> float | None:
        values = [m.uss_mb if uss else m.rss_mb for m in items]
        return None if not items or None in values else round(sum(values), 1)

    out = {
        "per_process": roles,
        "adatree_rss_total_mb": total(ours, False),
        "reference_rss_total_mb": total(reference, False),
        "adatree_uss_total_mb": total(ours, True),
        "reference_uss_total_mb": total(reference, True),
    }
    if out["adatree_uss_total_mb"] is not None and out["reference_uss_total_mb"] is not None:
        out["adatree_part_uss_mb"] = round(
            out["adatree_uss_total_mb"] - out["reference_uss_total_mb"], 1
        )
    return out
