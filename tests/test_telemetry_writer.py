"""The writer: records land intact, concurrent producers lose nothing, the drop policy, flush at
close and at interpreter exit, rows the database refuses."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import select
from telemetry_helpers import RUN, run_row, step_count, step_indexes, steps_of

from sglang_adatree.config import load_config
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.records import StepRecord, decode_counts, encode_counts
from sglang_adatree.telemetry.writer import TelemetryWriter

pytest_plugins = ["telemetry_fixtures"]


def test_counts_encoding_round_trips():
    assert encode_counts((12, 7, 3)) == "12,7,3"
    assert decode_counts("12,7,3") == (12, 7, 3)
    assert encode_counts(()) == "" and decode_counts("") == ()
    assert encode_counts([4, 1]) == "4,1"  # a list is encoded too, just not cached


def test_step_record_is_frozen_and_slotted():
    rec = steps_of(1, 1)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.steps = 9  # type: ignore[misc]
    assert not hasattr(rec, "__dict__")


def _as_record(row: Step) -> StepRecord:
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(StepRecord)}
    for name in ("accepted_by_depth", "accepted_by_rank"):
        values[name] = decode_counts(values[name])
    return StepRecord(**values)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_records_land_with_every_field(backend, request, open_writer):
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    writer = open_writer(url)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 50)
    no_spec_pinned = dataclasses.replace(
        recs[0],
        step_index=50,
        steps=0,
        topk=1,
        num_draft_tokens=1,
        decision_source="pin",
        policy_version=None,
        predicted_step_ms=None,
        predicted_accept_len=None,
        accepted_by_depth=(),
        accepted_by_rank=(),
    )
    recs.append(no_spec_pinned)
    assert all(writer.record(r) for r in recs)
    assert writer.flush(10.0)
    with store.session_scope(url) as s:
        rows = s.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.step_index))
        assert [_as_record(row) for row in rows] == recs
    run = run_row(url, run_id)
    assert (run.target_model, run.config, run.dropped_steps, run.stopped_at) == (
        "test-target",
        {"min_gain": 0.03},
        0,
        None,
    )
    assert writer.stop_run(run_id)
    assert run_row(url, run_id).stopped_at is not None


def test_concurrent_producers_lose_no_record(sqlite_url, open_writer):
    writer = open_writer(sqlite_url, queue_size=100_000, batch_size=512)
    run_ids = [writer.start_run(RUN) for _ in range(4)]
    n = 5000

    def produce(run_id: int) -> None:
        for rec in steps_of(run_id, n):
            assert writer.record(rec)

    threads = [threading.Thread(target=produce, args=(r,)) for r in run_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = writer.close()
    assert (stats.written, stats.dropped, stats.lost, stats.queued) == (4 * n, 0, 0, 0)
    for run_id in run_ids:
        assert sorted(step_indexes(sqlite_url, run_id)) == list(range(n))


def test_full_queue_drops_newest_and_persists_the_count(sqlite_url, open_writer):
    writer = open_writer(sqlite_url, queue_size=100, flush_s=30.0)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 130)
    # The writer wakes only on a full batch or flush_s, so the first 100 fill the queue.
    accepted = [writer.record(r) for r in recs]
    assert accepted == [True] * 100 + [False] * 30
    assert writer.stats().dropped == 30
    assert writer.flush(10.0)
    assert sorted(step_indexes(sqlite_url, run_id)) == list(range(100))  # the oldest kept
    assert run_row(sqlite_url, run_id).dropped_steps == 30
    writer.close()
    assert not writer.record(recs[0])  # after close: dropped, counted, never raised
    assert writer.stats().dropped == 31


def test_record_is_fast_and_flush_s_bounds_the_wait(sqlite_url, open_writer):
    writer = open_writer(sqlite_url, flush_s=0.2)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 2000)
    t0 = time.perf_counter()
    for r in recs:
        writer.record(r)
    per_call_us = (time.perf_counter() - t0) / len(recs) * 1e6
    assert per_call_us < 50  # a deque append; typically ~0.3 us
    deadline = time.monotonic() + 5.0
    while step_count(sqlite_url, run_id) < len(recs):
        assert time.monotonic() < deadline, "rows not written within flush_s"
        time.sleep(0.05)


def test_a_full_batch_is_written_without_waiting_for_flush_s(sqlite_url, open_writer):
    # The thread sleeps flush_s between writes; a full batch wakes it.
    writer = open_writer(sqlite_url, batch_size=50, flush_s=30.0)
    run_id = writer.start_run(RUN)
    for r in steps_of(run_id, 50):
        writer.record(r)
    deadline = time.monotonic() + 5.0
    while step_count(sqlite_url, run_id) < 50:
        assert time.monotonic() < deadline, "a full batch waited for flush_s"
        time.sleep(0.05)


def test_batches_do_not_checkpoint_the_wal_as_they_close(sqlite_url, open_writer):
    # The last connection to a WAL database checkpoints and deletes the WAL as it closes; the
    # writer's idle connection keeps each batch's from being the last, and closes with it.
    wal = Path(f"{store.sqlite_path(sqlite_url)}-wal")
    writer = open_writer(sqlite_url)
    run_id = writer.start_run(RUN)
    sizes = []
    for i, r in enumerate(steps_of(run_id, 80)):
        writer.record(r)
        if i % 20 == 19:
            assert writer.flush(10.0)
            sizes.append(wal.stat().st_size if wal.exists() else 0)
    # The idle connection opens after the first successful batch; from then on every batch
    # adds to the WAL.
    assert 0 < sizes[1] < sizes[2] < sizes[3], sizes
    assert writer.close().written == 80
    assert not wal.exists()
    assert step_count(sqlite_url, run_id) == 80


def test_rows_the_database_refuses_are_counted_not_retried(sqlite_url, open_writer):
    writer = open_writer(sqlite_url)
    run_id = writer.start_run(RUN)
    good = steps_of(run_id, 20)
    orphan = dataclasses.replace(good[0], run_id=run_id + 1000)  # no such run: a FK violation
    for rec in [*good[:10], orphan, *good[10:]]:
        writer.record(rec)
    assert writer.flush(10.0)
    assert sorted(step_indexes(sqlite_url, run_id)) == list(range(20))
    stats = writer.stats()
    assert (stats.rejected, stats.written) == (1, 20)


def test_rejected_count_persisted_on_its_run(pg_url, open_writer):
    writer = open_writer(pg_url)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 5)
    huge = dataclasses.replace(recs[0], batch_size=2**40)  # out of INTEGER range on PostgreSQL
    for rec in [*recs, huge]:
        writer.record(rec)
    assert writer.flush(10.0)
    assert step_count(pg_url, run_id) == 5
    assert run_row(pg_url, run_id).rejected_steps == 1


def test_from_config_uses_the_telemetry_settings(sqlite_url):
    cfg = load_config(env={}, db_url=sqlite_url, telemetry_queue_size=123)
    writer = TelemetryWriter.from_config(cfg)
    try:
        assert writer.queue_size == 123
    finally:
        writer.close()


def test_unclosed_writer_flushes_at_interpreter_exit(sqlite_url):
    script = textwrap.dedent(f"""
        from step_records import make_step
        from sglang_adatree.telemetry.records import RunRecord
        from sglang_adatree.telemetry.writer import TelemetryWriter
        w = TelemetryWriter({sqlite_url!r}, flush_s=60.0)
        run_id = w.start_run(RunRecord("t", None, "cpu", None, "0"))
        for i in range(777):
            w.record(make_step(run_id, i))
        print(run_id)
    """)  # no close(): atexit must write the 777 queued rows
    tests = str(Path(__file__).resolve().parent)  # step_records lives beside this file
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": tests},
    )
    assert done.returncode == 0, done.stderr
    assert step_count(sqlite_url, int(done.stdout)) == 777
