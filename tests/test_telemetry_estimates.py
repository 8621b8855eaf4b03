"""``telemetry.estimates`` over a real SQLite store: the per-shape means of what was predicted
and measured, and a runner-up that never ran among the selected steps."""

from __future__ import annotations

import numpy as np
import pytest
from admin_helpers import seed_run
from sqlalchemy import select, update

from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.estimates import estimates
from sglang_adatree.telemetry.models import Step

pytest_plugins = ["admin_fixtures", "telemetry_fixtures"]


def test_per_shape_means_match_a_direct_computation(db_url):
    run_id = seed_run(db_url, 2000, seed=29)
    with store.get_engine(db_url).connect() as conn:
        got = estimates(conn, Step.run_id == run_id)
        rows = conn.execute(
            select(
                Step.steps,
                Step.topk,
                Step.num_draft_tokens,
                Step.predicted_accept_len,
                Step.measured_accept_len,
                Step.predicted_step_ms,
                Step.measured_step_ms,
            ).where(Step.run_id == run_id)
        ).all()
    by_shape = {}
    for s, k, n, *values in rows:
        by_shape.setdefault(f"{s},{k},{n}", []).append(values)
    assert [e.shape for e in got.shapes] == sorted(
        by_shape, key=lambda label: tuple(map(int, label.split(",")))
    )
    for e in got.shapes:
        means = np.mean(by_shape[e.shape], axis=0)
        assert e.num_steps == len(by_shape[e.shape])
        assert (e.predicted_accept_len, e.measured_accept_len) == pytest.approx(means[:2])
        assert (e.predicted_step_ms, e.measured_step_ms) == pytest.approx(means[2:])
    for e in got.shapes:
        pairs = got.runner_ups_of(e.shape)
        assert sum(p.num_steps for p in pairs) == e.num_steps
        assert sum(p.share for p in pairs) == pytest.approx(1.0)


def test_a_runner_up_that_never_ran_has_no_measurement(db_url):
    run_id = seed_run(db_url, 500, seed=30)
    with store.get_engine(db_url).connect() as conn:
        everything = estimates(conn, Step.run_id == run_id)
        chain = everything.shapes[0].shape
        steps, topk, ndt = (int(x) for x in chain.split(","))
        # Only the steps of the first shape: their runner-ups ran elsewhere, not among them.
        alone = estimates(
            conn,
            Step.run_id == run_id,
            Step.steps == steps,
            Step.topk == topk,
            Step.num_draft_tokens == ndt,
        )
    assert [e.shape for e in alone.shapes] == [chain]
    assert alone.runner_ups and all(r.runner_up != chain for r in alone.runner_ups)
    for r in alone.runner_ups:
        assert r.measured_accept_len is None and r.measured_step_ms is None
        assert r.predicted_accept_len is not None and r.predicted_lead is not None
    # Over the whole run the same runner-ups ran, and were measured.
    assert {r.runner_up for r in alone.runner_ups} == {
        r.runner_up for r in everything.runner_ups_of(chain)
    }
    assert all(r.measured_accept_len is not None for r in everything.runner_ups_of(chain))


def test_catch_up_steps_count_but_their_times_do_not(db_url):
    run_id = seed_run(db_url, 600, seed=31)
    engine = store.get_engine(db_url)
    with engine.connect() as conn:
        before = {e.shape: e for e in estimates(conn, Step.run_id == run_id).shapes}
    label = max(before, key=lambda shape: before[shape].num_steps)
    steps, topk, ndt = (int(x) for x in label.split(","))
    of_shape = (Step.steps == steps, Step.topk == topk, Step.num_draft_tokens == ndt)
    with engine.begin() as conn:
        # Every other step of the shape becomes a catch-up that also ran the draft's extend.
        ids = conn.execute(select(Step.id).where(Step.run_id == run_id, *of_shape)).scalars()
        caught = list(ids)[::2]
        conn.execute(
            update(Step)
            .where(Step.id.in_(caught))
            .values(decision_source="catch-up", measured_step_ms=Step.measured_step_ms + 1000.0)
        )
        kept = conn.execute(
            select(Step.predicted_step_ms, Step.measured_step_ms).where(
                Step.run_id == run_id, *of_shape, Step.id.not_in(caught)
            )
        ).all()
    with engine.connect() as conn:
        after = {e.shape: e for e in estimates(conn, Step.run_id == run_id).shapes}
    assert after[label].num_steps == before[label].num_steps
    assert after[label].measured_accept_len == pytest.approx(before[label].measured_accept_len)
    assert (after[label].predicted_step_ms, after[label].measured_step_ms) == pytest.approx(
        tuple(np.mean([tuple(r) for r in kept], axis=0))
    )
