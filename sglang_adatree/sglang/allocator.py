"""The memory allocator of a CPU server's processes: tcmalloc, preloaded where it is installed.

SGLang's CPU guide runs its servers with tcmalloc in ``LD_PRELOAD``. Under glibc's malloc the
decode loop's short-lived tensors, freed between longer-lived blocks, keep raising the heap's
top: the scheduler's RSS rises under load while its live heap stays flat, and handing the freed
heap back (the control poller's ``malloc_trim``) only turns the rise into a sawtooth
(``docs/notes/2026-12-03-where-the-schedulers-rss-goes.md``). tcmalloc serves sizes from classes
and spans it reuses, so the process grows to its working set in the first minutes and stays
there; it keeps that memory rather than returning it.

``ADATREE_ALLOCATOR`` chooses: ``tcmalloc`` (the default: preloaded when found, glibc's malloc
otherwise, with a line saying so) or ``system`` (no preload). An ``LD_PRELOAD`` that already
names an allocator is the operator's choice and is left as it is.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Mapping
from pathlib import Path

ALLOCATOR_ENV = "ADATREE_ALLOCATOR"
ALLOCATORS = ("tcmalloc", "system")
# Debian's libtcmalloc-minimal4 (the allocator alone, no profiler) first.
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
# Substrings of library names that replace malloc: a preload naming one is left alone.
ALLOCATOR_LIBRARIES = ("tcmalloc", "jemalloc", "tbbmalloc", "mimalloc")


def _library_dirs() -> list[Path]:
    multiarch = sysconfig.get_config_var("MULTIARCH")
    dirs = [f"/usr/lib/{multiarch}"] if multiarch else []
    return [Path(d) for d in (*dirs, "/usr/lib64", "/usr/lib", "/usr/local/lib")]


def find_tcmalloc() -> Path | None:
    """The tcmalloc shared library installed on this machine, or None."""
    for name in TCMALLOC_NAMES:
        for folder in _library_dirs():
            path = folder / name
            if path.is_file():
                return path
    return None


def chosen_allocator(environ: Mapping[str, str]) -> str:
    """``ADATREE_ALLOCATOR`` from ``environ`` (default ``tcmalloc``); ``ValueError`` naming
    the choices for anything else."""
    value = environ.get(ALLOCATOR_ENV, "tcmalloc").strip().lower() or "tcmalloc"
    if value not in ALLOCATORS:
        raise ValueError(f"{ALLOCATOR_ENV}={value!r}: expected one of {', '.join(ALLOCATORS)}")
    return value


def _left_as_it_is(environ: Mapping[str, str]) -> bool:
    """Whether the operator chose the allocator: ``system``, or a preload naming one."""
    if chosen_allocator(environ) == "system":
        return True
    return any(name in environ.get("LD_PRELOAD", "") for name in ALLOCATOR_LIBRARIES)


def preload(environ: Mapping[str, str], library: Path | None = None) -> str | None:
    """The ``LD_PRELOAD`` a CPU server's processes should start with, or None to leave
    ``environ``'s as it is: when ``system`` is chosen, when the preload already names an
    allocator, or when tcmalloc is not installed. ``library``: tcmalloc's path (default: found
    on this machine). Raises ``ValueError`` for a bad ``ADATREE_ALLOCATOR``."""
    if _left_as_it_is(environ):
        return None
    current = environ.get("LD_PRELOAD", "").strip()
    library = library or find_tcmalloc()
    if library is None:
        return None
    return f"{library}:{current}" if current else str(library)


def missing_note(environ: Mapping[str, str]) -> str | None:
    """A line for the operator when tcmalloc is wanted and not installed; None otherwise."""
    if _left_as_it_is(environ) or find_tcmalloc() is not None:
        return None
    return (
        "tcmalloc not found (Debian: libtcmalloc-minimal4): the CPU server runs on glibc's "
        f"malloc, whose RSS creeps under load; set {ALLOCATOR_ENV}=system to silence this"
    )


def mapped_allocator(pid: int) -> str:
    """Which allocator process ``pid`` runs on, from its mappings: ``tcmalloc``, ``jemalloc``,
    ... or ``system``; ``unknown`` when ``/proc/PID/maps`` cannot be read."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return "unknown"
    for name in ALLOCATOR_LIBRARIES:
        if f"lib{name}" in maps:
            return name
    return "system"
