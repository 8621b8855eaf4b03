"""Retention: old step rows become exact per-minute sums, late rows merge, `adatree db rollup`."""

from __future__ import annotations

import dataclasses
import time

import pytest
from sqlalchemy import select
from telemetry_helpers import RUN, step_count, steps_of

from sglang_adatree import cli
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import StepRollup
from sglang_adatree.telemetry.records import decode_counts
from sglang_adatree.telemetry.retention import rollup

pytest_plugins = ["telemetry_fixtures"]

T0 = 1_700_000_040.0  # a whole minute (divisible by 60)


def _write(writer, recs):
    for rec in recs:
        assert writer.record(rec)
    assert writer.flush(10.0)


def _at(recs, times):
    return [dataclasses.replace(r, wall_time=t) for r, t in zip(recs, times, strict=True)]


def _rollups(url):
    with store.session_scope(url) as s:
        rows = s.scalars(select(StepRollup).order_by(StepRollup.minute, StepRollup.steps))
        return [(r.minute, r.steps, r.topk, r.num_draft_tokens, r) for r in rows]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_rollup_sums_are_exact_and_recent_steps_stay(backend, request, open_writer):
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    writer = open_writer(url)
    run_id = writer.start_run(RUN)
    recs = steps_of(run_id, 40)
    # 30 old steps over minutes 0 and 1 (shapes cycle with period 5), 10 recent ones.
    times = [T0 + 4.0 * i for i in range(30)] + [T0 + 7200.0 + i for i in range(10)]
    recs = _at(recs, times)
    _write(writer, recs)
    result = rollup(url, older_than_s=3600.0, now=T0 + 7200.0 + 30)
    assert result.cutoff == T0 + 3600.0
    assert (result.steps_rolled, step_count(url, run_id)) == (30, 10)
    rows = _rollups(url)
    assert result.rollups_written == len(rows) == 2 * 5  # two minutes x five shapes
    for minute, steps, topk, n, row in rows:
        group = [
            r
            for r in recs[:30]
            if (r.wall_time - r.wall_time % 60, r.steps, r.topk, r.num_draft_tokens)
            == (minute, steps, topk, n)
        ]
        assert row.num_steps == len(group) > 0
        assert row.sum_batch_size == sum(r.batch_size for r in group)
        assert row.max_batch_size == max(r.batch_size for r in group)
        assert row.emitted_tokens == sum(r.emitted_tokens for r in group)
        assert row.sum_measured_step_ms == pytest.approx(sum(r.measured_step_ms for r in group))
        assert row.num_predicted == len(group)
        depth = [sum(col) for col in zip(*(r.accepted_by_depth for r in group), strict=True)]
        assert list(decode_counts(row.accepted_by_depth)) == depth
        sources = {}
        for r in group:
            sources[r.decision_source] = sources.get(r.decision_source, 0) + 1
        assert row.decision_sources == sources
    # Idempotent: nothing older is left to roll up.
    assert rollup(url, older_than_s=3600.0, now=T0 + 7230.0).steps_rolled == 0


def test_late_rows_merge_into_their_minute(sqlite_url, open_writer):
    writer = open_writer(sqlite_url)
    run_id = writer.start_run(RUN)
    chain = {"steps": 3, "topk": 1, "num_draft_tokens": 4}
    recs = [dataclasses.replace(r, **chain) for r in steps_of(run_id, 6)]
    _write(writer, _at(recs[:4], [T0 + 1, T0 + 2, T0 + 3, T0 + 4]))
    rollup(sqlite_url, older_than_s=60.0, now=T0 + 600.0)
    # A step from the same minute arrives after the roll-up (written late after an outage).
    _write(writer, _at(recs[4:], [T0 + 5, T0 + 6]))
    rollup(sqlite_url, older_than_s=60.0, now=T0 + 600.0)
    [(minute, *_shape, row)] = _rollups(sqlite_url)
    assert minute == T0
    assert row.num_steps == 6
    assert row.emitted_tokens == sum(r.emitted_tokens for r in recs)
    assert step_count(sqlite_url, run_id) == 0


def test_cli_rollup(sqlite_url, open_writer, capsys):
    writer = open_writer(sqlite_url)
    run_id = writer.start_run(RUN)
    _write(writer, _at(steps_of(run_id, 3), [T0, T0 + 1, T0 + 2]))  # years old
    assert cli.main(["db", "rollup", "--db", sqlite_url, "--older-than-hours", "1"]) == 0
    assert "rolled up 3 steps" in capsys.readouterr().out
    assert step_count(sqlite_url, run_id) == 0
    assert cli.main(["db", "rollup", "--db", sqlite_url, "--older-than-hours", "-1"]) == 2


def test_writer_rolls_up_periodically(sqlite_url, open_writer):
    writer = open_writer(sqlite_url, retention_hours=1.0)
    run_id = writer.start_run(RUN)
    old = _at(steps_of(run_id, 5), [T0 + i for i in range(5)])
    _write(writer, old)  # the first successful write triggers the first roll-up
    deadline = time.monotonic() + 10.0
    while step_count(sqlite_url, run_id) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert step_count(sqlite_url, run_id) == 0
    assert sum(row.num_steps for *_k, row in _rollups(sqlite_url)) == 5
