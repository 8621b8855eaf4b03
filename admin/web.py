"""What the views share: the app's state (engine, configuration, granule cache, retrain
threads) and the run / range a request asks for."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

from flask import current_app, g
from sglang_adatree.admin import params
from sglang_adatree.admin.errors import AdminError
from sglang_adatree.admin.queries import runs
from sglang_adatree.admin.queries.granules import GranuleCache
from sqlalchemy import Connection, Engine

from sglang_adatree.config import AdaTreeConfig

REFRESH_S = 5.0  # the overview's live refresh period


@dataclass
class AdminState:
    """Per-app state, kept in ``app.extensions["adatree"]``."""

    engine: Engine
    config: AdaTreeConfig
    granules: GranuleCache = field(default_factory=GranuleCache)
    retrain_threads: list[threading.Thread] = field(default_factory=list)

    def join_retrain_threads(self, timeout: float) -> bool:
        """Wait for background retrain jobs (tests and shutdown); True if all ended."""
        for thread in list(self.retrain_threads):
            thread.join(timeout)
        self.retrain_threads = [t for t in self.retrain_threads if t.is_alive()]
        return not self.retrain_threads


def state() -> AdminState:
    return current_app.extensions["adatree"]


@contextmanager
def reading() -> Iterator[Connection]:
    """One connection (one consistent snapshot on SQLite's WAL) for a page's reads."""
    with state().engine.connect() as conn:
        yield conn
    g.database_answered = True  # ends a logged outage (``errors.OutageLog``)


@contextmanager
def writing() -> Iterator[Connection]:
    """One transaction for a change and its audit entry: both or neither."""
    with state().engine.begin() as conn:
        yield conn
    g.database_answered = True


def selected_run(conn: Connection) -> runs.RunSummary | None:
    """The run named by ``?run=``, else the latest run; None when no run exists yet."""
    run_id = params.run_arg()
    if run_id is None:
        run_id = runs.latest_run_id(conn)
        if run_id is None:
            return None
    run = runs.get_run(conn, run_id)
    if run is None:
        raise AdminError(404, f"unknown run {run_id}")
    return run


def required_run(conn: Connection) -> runs.RunSummary:
    """``selected_run`` for the API, where no run at all is a 404."""
    run = selected_run(conn)
    if run is None:
        raise AdminError(404, "no runs recorded yet")
    return run


# ---- template filters ----------------------------------------------------------------------------


def utc(unix_s: object) -> str:
    """``2026-11-30 03:09:12 UTC``; empty for anything but a number."""
    if not _is_number(unix_s):
        return ""
    return datetime.fromtimestamp(unix_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def num(value: object, digits: int = 2) -> str:
    """A number with thousands separators; a dash for anything else (a missing metric)."""
    return f"{value:,.{digits}f}" if _is_number(value) else "–"


def pct(value: object) -> str:
    """A fraction as a percentage (0.031 -> ``3.1%``); a dash for anything else."""
    return f"{value:.1%}" if _is_number(value) else "–"


FILTERS = {"utc": utc, "num": num, "pct": pct}
