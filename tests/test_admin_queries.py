"""The query layer against brute force on seeded runs: every downsampling tier gives the exact
bucket means, the granule cache grows by row id, roll-ups count once, and the queries run
on PostgreSQL too."""

from __future__ import annotations

import numpy as np
import pytest
from admin_helpers import END_TIME, seed_run
from sglang_adatree.admin.queries import costs, runs, shapes, timeseries
from sglang_adatree.admin.queries.granules import GRANULE_S, GranuleCache
from sglang_adatree.admin.queries.sums import BucketSums, fold
from sqlalchemy import select, update
from synthetic_runs import insert_steps, step_rows

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.telemetry import control, store
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.retention import rollup

pytest_plugins = ["admin_fixtures", "telemetry_fixtures"]


def raw_steps(url: str, run_id: int) -> dict[str, np.ndarray]:
    cols = ("wall_time", "measured_step_ms", "measured_accept_len", "batch_size", "emitted_tokens")
    with store.get_engine(url).connect() as conn:
        rows = conn.execute(
            select(*(getattr(Step, c) for c in cols)).where(Step.run_id == run_id)
        ).all()
    table = np.asarray(rows, dtype=np.float64)
    return {c: table[:, i] for i, c in enumerate(cols)}


def brute_force(raw: dict[str, np.ndarray], width: float) -> dict[float, dict[str, float]]:
    """Bucket means straight from the rows: what every tier must reproduce."""
    key = np.floor(raw["wall_time"] / width) * width
    out = {}
    for k in np.unique(key):
        m = key == k
        out[float(k)] = {
            "num_steps": float(m.sum()),
            "goodput": raw["emitted_tokens"][m].sum() / raw["measured_step_ms"][m].sum() * 1000,
            "accept_len": raw["measured_accept_len"][m].mean(),
            "batch_size": raw["batch_size"][m].mean(),
            "step_ms": raw["measured_step_ms"][m].mean(),
        }
    return out


def whole_run(url: str, run_id: int, **kw) -> timeseries.Overview:
    with store.get_engine(url).connect() as conn:
        run = runs.get_run(conn, run_id)
        tr = runs.resolve_range(conn, run, "run")
        return timeseries.overview(conn, run_id, tr, kw.pop("cache", GranuleCache()), **kw)


def test_bucket_width_keeps_within_max_points():
    assert timeseries.bucket_width(300.0) == 0.2
    assert timeseries.bucket_width(3600.0) == 2.0
    assert timeseries.bucket_width(86400.0) == 60.0
    for span in (1.0, 299.0, 3601.0, 1e5, 1e6, 3e7):
        width = timeseries.bucket_width(span)
        assert span / width + 3 <= timeseries.MAX_POINTS
        if width != timeseries.WIDTHS_S[0]:
            smaller = timeseries.WIDTHS_S[timeseries.WIDTHS_S.index(width) - 1]
            assert span / smaller + 3 > timeseries.MAX_POINTS


@pytest.mark.parametrize(
    ("max_points", "scan_limit", "tier"),
    [(10_000, 0, "step"), (2000, 100_000, "scan"), (2000, 0, "granules")],
)
def test_every_tier_gives_the_exact_bucket_means(db_url, max_points, scan_limit, tier):
    run_id = seed_run(db_url, 6000, seed=21)  # two minutes
    ov = whole_run(db_url, run_id, max_points=max_points, scan_limit=scan_limit)
    assert ov.tier == tier and 0 < len(ov.points) <= max_points
    raw = raw_steps(db_url, run_id)
    assert ov.num_steps == 6000
    assert ov.goodput == pytest.approx(
        raw["emitted_tokens"].sum() / raw["measured_step_ms"].sum() * 1000
    )
    if tier == "step":
        order = np.argsort(raw["wall_time"])
        assert np.allclose(ov.points.time, raw["wall_time"][order])
        assert np.allclose(ov.points.step_ms, raw["measured_step_ms"][order])
        return
    expected = brute_force(raw, ov.bucket_s)
    assert [float(t) for t in ov.points.time] == sorted(expected)
    for i, t in enumerate(ov.points.time):
        want = expected[float(t)]
        for name, value in want.items():
            assert getattr(ov.points, name)[i] == pytest.approx(value), (name, t)


def test_points_carry_the_most_chosen_shape(db_url):
    run_id = seed_run(db_url, 3000, seed=22)
    ov = whole_run(db_url, run_id, max_points=100, scan_limit=0)
    with store.get_engine(db_url).connect() as conn:
        rows = conn.execute(
            select(Step.wall_time, Step.steps, Step.topk, Step.num_draft_tokens).where(
                Step.run_id == run_id
            )
        ).all()
    for t, label in zip(ov.points.time, ov.points.shape, strict=True):
        in_bucket = [f"{s},{k},{n}" for w, s, k, n in rows if t <= w < t + ov.bucket_s]
        counts = {s: in_bucket.count(s) for s in set(in_bucket)}
        assert counts[label] == max(counts.values())


def test_granule_cache_adds_rows_by_id_including_late_ones(db_url):
    run_id = seed_run(db_url, 2000, seed=23)
    cache = GranuleCache()
    engine = store.get_engine(db_url)
    shapes_ = AdaTreeConfig().candidate_shapes
    with engine.connect() as conn:
        assert cache.sums(conn, run_id, 0, 2e9).num_steps.sum() == 2000
    # 500 new steps, then 100 "late" steps stamped in the middle of the run.
    newer = step_rows(
        run_id, 500, start_time=END_TIME, steps_per_s=50, shapes=shapes_, first_index=2000
    )
    late = step_rows(
        run_id, 100, start_time=END_TIME - 20, steps_per_s=50, shapes=shapes_, first_index=9000
    )
    insert_steps(engine, newer)
    insert_steps(engine, late)
    with engine.connect() as conn:
        sums = cache.sums(conn, run_id, 0, 2e9)
    assert sums.num_steps.sum() == 2600
    assert sums.emitted_tokens.sum() == raw_steps(db_url, run_id)["emitted_tokens"].sum()
    assert np.all(np.diff(sums.start) >= 0)
    assert np.all(sums.start % GRANULE_S == 0)


def test_rolled_up_minutes_count_once_in_every_tier(db_url):
    run_id = seed_run(db_url, 9000, seed=24)  # three minutes
    raw = raw_steps(db_url, run_id)
    cache = GranuleCache()
    before = whole_run(db_url, run_id, cache=cache, scan_limit=0)  # fills the cache
    assert not before.rolled_up
    result = rollup(db_url, older_than_s=90.0, now=END_TIME)
    assert result.steps_rolled > 0
    for kw in ({"cache": cache, "scan_limit": 0}, {"scan_limit": 100_000}, {"max_points": 20_000}):
        after = whole_run(db_url, run_id, **kw)
        assert after.rolled_up
        assert after.num_steps == 9000, kw
        assert after.goodput == pytest.approx(before.goodput)
        assert after.accept_len == pytest.approx(raw["measured_accept_len"].mean())
        assert len(after.points) <= kw.get("max_points", timeseries.MAX_POINTS)


def test_range_ends_at_the_runs_newest_data(db_url):
    run_id = seed_run(db_url, 30_000, seed=25)  # ten minutes
    with store.get_engine(db_url).connect() as conn:
        run = runs.get_run(conn, run_id)
        tr = runs.resolve_range(conn, run, "5m")
        assert tr.end == pytest.approx(END_TIME, abs=0.1)
        assert tr.span_s == pytest.approx(300.0)
        ov = timeseries.overview(conn, run_id, tr, GranuleCache())
        assert ov.tier == "scan" and ov.bucket_s == 0.2
        assert ov.num_steps == pytest.approx(15_000, abs=20)
        window = runs.newest_rows(conn, run_id, tr, 1000)
        assert window.end == tr.end and window.span_s == pytest.approx(20.0, abs=0.1)


def test_candidate_set_is_the_latest_runs_else_the_config(db_url):
    engine = store.get_engine(db_url)
    fallback = AdaTreeConfig().candidate_shapes
    with engine.connect() as conn:
        assert control.candidate_set(conn, fallback).source == "config"
    mine = (TreeShape(0, 1, 1), TreeShape(2, 1, 3), TreeShape(4, 2, 8))
    run_id = seed_run(db_url, 10, shapes=mine)
    with engine.connect() as conn:
        candidates = control.candidate_set(conn, fallback)
    assert candidates.shapes == mine and candidates.run_id == run_id
    with engine.begin() as conn:
        conn.execute(update(Run).values(config={"candidate_shapes": ["not a shape"]}))
    with engine.connect() as conn:
        assert control.candidate_set(conn, fallback).shapes == fallback


def test_shape_usage_counts_every_step_once(db_url):
    run_id = seed_run(db_url, 4000, seed=26)
    with store.get_engine(db_url).connect() as conn:
        tr = runs.resolve_range(conn, runs.get_run(conn, run_id), "run")
        usage = shapes.shape_usage(conn, run_id, tr)
        capped = shapes.shape_usage(conn, run_id, tr, max_rows=1000)
    assert usage.num_steps == 4000 and not usage.truncated
    assert sum(sum(c.values()) for c in usage.by_batch.values()) == 4000
    assert sum(sum(c.values()) for c in usage.by_accept.values()) == 4000
    assert capped.truncated and capped.num_steps == pytest.approx(1000, abs=5)
    for rates in usage.depth_rate.values():
        assert all(0 <= r <= 1 for r in rates)
        assert rates == sorted(rates, reverse=True)  # paths that reach depth d reached d - 1
    assert shapes.batch_bin(1) == "1" and shapes.batch_bin(3) == "3-4"
    assert shapes.batch_bin(5000) == ">1024" and shapes.accept_bin(2.3) == "2.25-2.50"


def test_cost_report_matches_a_direct_computation(db_url):
    run_id = seed_run(db_url, 3000, seed=27)
    with store.get_engine(db_url).connect() as conn:
        tr = runs.resolve_range(conn, runs.get_run(conn, run_id), "run")
        report = costs.cost_report(conn, run_id, tr)
        rows = conn.execute(
            select(Step.policy_version, Step.predicted_step_ms, Step.measured_step_ms).where(
                Step.run_id == run_id
            )
        ).all()
    by_version = {}
    for v, p, m in rows:
        by_version.setdefault(costs.version_label(v), []).append(abs(p - m) / m)
    assert {v.version: v.num_steps for v in report.versions} == {
        k: len(a) for k, a in by_version.items()
    }
    for v in report.versions:
        assert v.step_time_mape == pytest.approx(np.mean(by_version[v.version]))
    assert 0 < len(report.sample.time) <= timeseries.MAX_POINTS
    assert {e.version for e in report.error_over_time} == set(by_version)


def test_the_cost_reports_sample_carries_each_steps_price_split(db_url):
    run_id = seed_run(db_url, 1000, seed=30)
    engine = store.get_engine(db_url)
    with engine.begin() as conn:
        conn.execute(
            update(Step)
            .where(Step.step_index < 100)
            .values(price_drift=None, price_tilt=None, price_offset=None)
        )
    with engine.connect() as conn:
        tr = runs.resolve_range(conn, runs.get_run(conn, run_id), "run")
        report = costs.cost_report(conn, run_id, tr)
        split = {
            t: (d, k, o)
            for t, d, k, o in conn.execute(
                select(Step.wall_time, Step.price_drift, Step.price_tilt, Step.price_offset)
            )
        }
    s = report.sample
    for t, d, k, o in zip(s.time, s.price_drift, s.price_tilt, s.price_offset, strict=True):
        want = split[float(t)]
        if want[0] is None:
            assert np.isnan(d) and np.isnan(k) and np.isnan(o)
        else:
            assert (d, k, o) == pytest.approx(want)
    assert np.isnan(s.price_drift).any() and not np.isnan(s.price_drift).all()
    sample = report.to_json()["sample"]
    assert None in sample["price_drift"] and len(sample["price_tilt"]) == len(s.time)


def test_steps_without_predictions_are_left_out_of_the_cost_report(db_url):
    run_id = seed_run(db_url, 500, seed=28)
    engine = store.get_engine(db_url)
    with engine.begin() as conn:
        conn.execute(update(Step).where(Step.step_index < 100).values(predicted_step_ms=None))
    with engine.connect() as conn:
        tr = runs.resolve_range(conn, runs.get_run(conn, run_id), "run")
        report = costs.cost_report(conn, run_id, tr)
    assert sum(v.num_steps for v in report.versions) == 400


def test_fold_of_nothing_is_empty():
    assert len(fold(BucketSums.empty(), 10.0)) == 0


def test_queries_on_postgresql(pg_url):
    run_id = seed_run(pg_url, 3000, seed=29)
    raw = raw_steps(pg_url, run_id)
    for kw in ({"max_points": 10_000}, {"scan_limit": 100_000}, {"scan_limit": 0}):
        ov = whole_run(pg_url, run_id, **kw)
        assert ov.num_steps == 3000
        if ov.bucket_s:
            expected = brute_force(raw, ov.bucket_s)
            assert [float(t) for t in ov.points.time] == sorted(expected)
    with store.get_engine(pg_url).connect() as conn:
        tr = runs.resolve_range(conn, runs.get_run(conn, run_id), "run")
        assert shapes.shape_usage(conn, run_id, tr).num_steps == 3000
        assert sum(v.num_steps for v in costs.cost_report(conn, run_id, tr).versions) == 3000


def test_runner_ups_match_a_direct_computation(db_url):
    run_id = seed_run(db_url, 3000, seed=28)
    with store.get_engine(db_url).connect() as conn:
        tr = runs.resolve_range(conn, runs.get_run(conn, run_id), "run")
        usage = shapes.shape_usage(conn, run_id, tr)
        rows = conn.execute(
            select(
                Step.steps,
                Step.topk,
                Step.num_draft_tokens,
                Step.runner_up,
                Step.predicted_step_ms,
                Step.predicted_accept_len,
                Step.runner_up_step_ms,
                Step.runner_up_accept_len,
                Step.measured_step_ms,
                Step.measured_accept_len,
            ).where(Step.run_id == run_id)
        ).all()
    ran, pairs = {}, {}
    for s, k, n, ru, p_ms, p_acc, ru_ms, ru_acc, m_ms, m_acc in rows:
        label = f"{s},{k},{n}"
        ran.setdefault(label, []).append((m_acc, m_ms))
        pairs.setdefault((label, ru), []).append((p_acc / p_ms / (ru_acc / ru_ms), ru_acc, ru_ms))
    assert {(r.shape, r.runner_up) for r in usage.runner_ups} == set(pairs)
    assert sum(r.num_steps for r in usage.runner_ups) == 3000
    for r in usage.runner_ups:
        got = pairs[(r.shape, r.runner_up)]
        assert r.num_steps == len(got)
        assert r.share == pytest.approx(len(got) / len(ran[r.shape]))
        assert r.predicted_lead == pytest.approx(np.mean([g[0] for g in got]) - 1.0)
        assert r.predicted_accept_len == pytest.approx(np.mean([g[1] for g in got]))
        assert r.predicted_step_ms == pytest.approx(np.mean([g[2] for g in got]))
        own = ran.get(r.runner_up)
        if own is None:
            assert r.measured_accept_len is None and r.measured_step_ms is None
        else:
            assert r.measured_accept_len == pytest.approx(np.mean([o[0] for o in own]))
            assert r.measured_step_ms == pytest.approx(np.mean([o[1] for o in own]))
    # The runner-ups of one shape come most seen first.
    for shape in usage.shapes:
        counts = [r.num_steps for r in usage.runner_ups if r.shape == shape]
        assert counts == sorted(counts, reverse=True)
