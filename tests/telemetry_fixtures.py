"""Fixtures of the telemetry tests, loaded with ``pytest_plugins = ["telemetry_fixtures"]``:
migrated SQLite and PostgreSQL databases and a writer factory that closes what it opened.
Plain helpers live in ``telemetry_helpers``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from pg import PostgresServer

from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.writer import TelemetryWriter


@pytest.fixture
def sqlite_url(tmp_path) -> Iterator[str]:
    """A migrated SQLite database in a temporary directory; ``?timeout=0.2`` keeps lock waits
    in the fault tests short."""
    url = f"sqlite:///{tmp_path / 'telemetry.sqlite'}?timeout=0.2"
    store.upgrade(url)
    yield url
    store.get_engine(url).dispose()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    server = PostgresServer.find()
    if server is None:
        pytest.skip("PostgreSQL binaries not found under /usr/lib/postgresql (make system-deps)")
    server.start()
    yield server
    server.close()


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh database on the test server, migrated to head."""
    if not pg_server.is_running():
        pg_server.start()
    url = pg_server.create_database()
    store.upgrade(url)
    return url


@pytest.fixture
def open_writer() -> Iterator[Callable[..., TelemetryWriter]]:
    """``open_writer(url, **kw)``: a writer that is closed after the test whatever happens."""
    writers: list[TelemetryWriter] = []

    def factory(url: str, **kw) -> TelemetryWriter:
        kw.setdefault("flush_s", 0.05)
        kw.setdefault("backoff_max_s", 0.2)
        writers.append(TelemetryWriter(url, **kw))
        return writers[-1]

    yield factory
    for w in writers:
        w.close(timeout=2.0)
