"""Fault tests: the database locked by another writer, made read-only, deleted, and PostgreSQL
stopped and restarted. In each the producer keeps its bound (``record()`` never waits for the
database), records that do not fit are counted as drops (and the count is persisted), and
recording resumes once the database is back."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest
from telemetry_helpers import RUN, run_row, step_count, step_indexes, steps_of, unprivileged

from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.writer import TelemetryWriter

pytest_plugins = ["telemetry_fixtures"]

# A record() that waited on the database would take at least the busy timeout (0.2 s) or a
# connection attempt; a deque append takes microseconds. 0.1 s leaves room for a loaded machine.
PRODUCER_BOUND_S = 0.1


def _record_paced(writer: TelemetryWriter, recs, interval_s: float = 0.001) -> float:
    """Record like a decode loop at ~1/interval steps per second; the slowest record() call."""
    worst = 0.0
    for rec in recs:
        t0 = time.perf_counter()
        writer.record(rec)
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(interval_s)
    return worst


def _wait_for_failure(writer: TelemetryWriter, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while writer.stats().failures == 0:
        assert time.monotonic() < deadline, "the writer never noticed the fault"
        time.sleep(0.01)


def _check_outage(writer, url, run_id, before, during, after) -> None:
    """Rows recorded before the outage and after the writer caught up are all there; of those
    recorded during it, exactly the dropped ones are missing; the drop count is on the run."""
    assert writer.flush(20.0)
    dropped = writer.stats().dropped
    indexes = set(step_indexes(url, run_id))
    assert {r.step_index for r in before + after} <= indexes
    assert len(indexes) == len(before) + len(during) + len(after) - dropped
    assert run_row(url, run_id).dropped_steps == dropped


def test_sqlite_locked_by_another_writer(sqlite_url, open_writer):
    writer = open_writer(sqlite_url, queue_size=200, batch_size=50)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 900)
    before, during, after = recs[:100], recs[100:700], recs[700:]
    assert _record_paced(writer, before) < PRODUCER_BOUND_S
    assert writer.flush(10.0)
    blocker = sqlite3.connect(store.sqlite_path(sqlite_url), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # holds the write lock, as a long transaction would
    try:
        assert _record_paced(writer, during) < PRODUCER_BOUND_S
        _wait_for_failure(writer)
        assert writer.stats().dropped > 0  # 600 records, room for 200 queued + 50 in flight
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert writer.flush(10.0)  # caught up with what it held
    assert _record_paced(writer, after) < PRODUCER_BOUND_S
    _check_outage(writer, sqlite_url, run_id, before, during, after)


@pytest.fixture
def private_dir():
    """A directory an unprivileged user can reach (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="adatree-ro-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_sqlite_made_read_only(private_dir, open_writer):
    db = private_dir / "ro.sqlite"
    url = f"sqlite:///{db}?timeout=0.2"
    store.upgrade(url)
    with unprivileged(private_dir, db):
        writer = open_writer(url, queue_size=5000)
        run_id = writer.start_run(RUN)
        recs = steps_of(run_id, 500)
        before, during, after = recs[:100], recs[100:400], recs[400:]
        _record_paced(writer, before)
        assert writer.flush(10.0)
        db.chmod(0o444)
        try:
            assert _record_paced(writer, during) < PRODUCER_BOUND_S
            _wait_for_failure(writer)
            assert "readonly" in (writer.stats().last_error or "")
        finally:
            # SQLite gives the -wal and -shm files it creates the database file's mode, so
            # the operator's fix is `chmod u+w ro.sqlite*`, not the main file alone.
            for f in private_dir.glob("ro.sqlite*"):
                f.chmod(0o644)
        assert writer.flush(10.0)
        assert _record_paced(writer, after) < PRODUCER_BOUND_S
        assert writer.flush(10.0)
    _check_outage(writer, url, run_id, before, during, after)
    assert writer.stats().dropped == 0  # the queue held the whole outage


def test_sqlite_file_deleted_then_restored(sqlite_url, open_writer, tmp_path):
    path = store.sqlite_path(sqlite_url)
    writer = open_writer(sqlite_url, queue_size=150, batch_size=50)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 600)
    before, during, after = recs[:100], recs[100:500], recs[500:]
    _record_paced(writer, before)
    assert writer.flush(10.0)
    backup = tmp_path / "backup.sqlite"
    with sqlite3.connect(path) as src, sqlite3.connect(backup) as dst:
        src.backup(dst)
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    assert _record_paced(writer, during) < PRODUCER_BOUND_S
    _wait_for_failure(writer)
    assert not path.exists(), "the writer must not create an empty database in its place"
    assert writer.stats().dropped > 0  # 400 records, room for 150 queued + 50 in flight
    shutil.copy(backup, path)  # the operator restores the database
    assert writer.flush(10.0)
    assert _record_paced(writer, after) < PRODUCER_BOUND_S
    _check_outage(writer, sqlite_url, run_id, before, during, after)


def test_postgres_stopped_and_restarted(pg_server, pg_url, open_writer):
    writer = open_writer(pg_url, queue_size=200, batch_size=50)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 800)
    before, during, after = recs[:100], recs[100:600], recs[600:]
    _record_paced(writer, before)
    assert writer.flush(10.0)
    pg_server.stop()
    try:
        assert _record_paced(writer, during) < PRODUCER_BOUND_S
        _wait_for_failure(writer)
        assert writer.stats().dropped > 0  # 500 records, room for 200 queued + 50 in flight
    finally:
        pg_server.start()
    assert writer.flush(20.0)
    assert _record_paced(writer, after) < PRODUCER_BOUND_S
    _check_outage(writer, pg_url, run_id, before, during, after)


def test_close_gives_up_after_its_timeout_and_counts_the_loss(sqlite_url, open_writer):
    path = store.sqlite_path(sqlite_url)
    writer = open_writer(sqlite_url)
    run_id = writer.start_run(RUN)
    os.replace(path, f"{path}.away")  # the database is gone for good
    for rec in steps_of(run_id, 30):
        writer.record(rec)
    t0 = time.monotonic()
    stats = writer.close(timeout=1.0)
    assert time.monotonic() - t0 < 3.0
    assert (stats.lost, stats.written) == (30, 0)
    os.replace(f"{path}.away", path)
    assert step_count(sqlite_url, run_id) == 0


def test_an_outage_is_logged_once_and_its_end_once(sqlite_url, open_writer, caplog):
    caplog.set_level(logging.WARNING, logger="sglang_adatree.telemetry.writer")
    path = store.sqlite_path(sqlite_url)
    writer = open_writer(sqlite_url, backoff_max_s=0.05)
    run_id = writer.start_run(RUN)
    os.replace(path, f"{path}.away")
    try:
        for rec in steps_of(run_id, 50):
            writer.record(rec)
        deadline = time.monotonic() + 10.0
        while writer.stats().failures < 5:  # retried several times within the outage
            assert time.monotonic() < deadline, "the writer stopped retrying"
            time.sleep(0.01)
        assert writer.stats().down
    finally:
        os.replace(f"{path}.away", path)
    assert writer.flush(10.0)
    assert not writer.stats().down
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot write to" in m for m in messages) == 1
    assert sum("writable again" in m for m in messages) == 1
    assert len(messages) == 2
