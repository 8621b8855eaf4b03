"""Step-time profiles of the policy lab: a decode step's passes composed, the analytic GPU
rooflines (shape, padding, the published anchors) and the profiles built from measured steps
(a deployment's telemetry, a profiled server's step log); JSON round trips of each."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from sqlalchemy import insert
from synthetic_runs import SURFACE, synthetic_run

from sglang_adatree.core.features import NO_GRAPHS, StepFeatures, feature_matrix
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape
from sglang_adatree.core.step_profile import TableProfile
from sglang_adatree.lab.hardware import GPUS, analytic_gpu_profile, implied_speedup
from sglang_adatree.lab.measured import profile_from_served_steps, profile_from_telemetry
from sglang_adatree.lab.passes import (
    SPEC_CAPTURE_SIZES,
    StepOverheads,
    compose_step_ms,
    step_passes,
)
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import Step

pytest_plugins = ["telemetry_fixtures"]

CHAIN = TreeShape(3, 1, 4)
TREE = TreeShape(4, 4, 12)
DEEP = TreeShape(6, 4, 16)


def _features(profile: TableProfile, batch: int, context: int) -> StepFeatures:
    return StepFeatures(batch, profile.padding.padded(batch), batch * context, context)


def _same(a: TableProfile, b: TableProfile) -> None:
    for name in ("name", "source", "made_by", "shapes", "batch_sizes", "context_lens", "padding"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.notes == b.notes
    np.testing.assert_allclose(a.ms, b.ms, atol=1e-4)


# -- passes ----------------------------------------------------------------------------------


class CountingCosts:
    """Pass costs that spell out what was asked: 1000 per target token, 10 per draft token,
    0.1 per extend token (per request), so a sum tells the passes apart."""

    def target_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        return 1000.0 * tokens

    def draft_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        return 10.0 * tokens

    def extend_ms(self, batch_size: int, tokens: int, context_len: int) -> float:
        return 0.1 * tokens


def test_a_step_is_its_passes_as_sglang_runs_them():
    # The module docstring's worked example: 3,2,6 is a verify of 6, two draft passes of 2 and
    # an extend of 6 tokens per request.
    p = step_passes(TreeShape(3, 2, 6))
    assert (p.target_tokens, p.draft_passes, p.draft_tokens, p.extend_tokens) == (6, 2, 2, 6)
    assert p.num_passes == 4
    # A chain of one: the extend expanded the root, no draft pass of its own.
    assert step_passes(TreeShape(1, 1, 2)).num_passes == 2
    assert step_passes(NO_SPEC).num_passes == 1
    overheads = StepOverheads(per_pass_ms=0.001, per_step_ms=0.0001, speculative_ms=0.00001)
    ms = compose_step_ms(TreeShape(3, 2, 6), 8, 100, CountingCosts(), overheads)
    assert ms == pytest.approx(6000 + 2 * 20 + 0.6 + 4 * 0.001 + 0.0001 + 0.00001)
    assert compose_step_ms(NO_SPEC, 8, 100, CountingCosts(), overheads) == pytest.approx(
        1000 + 0.001 + 0.0001
    )


# -- the analytic GPU profiles ---------------------------------------------------------------


@pytest.fixture(scope="module")
def profiles() -> dict[str, TableProfile]:
    return {gpu: analytic_gpu_profile(gpu) for gpu in GPUS}


def test_analytic_profiles_cover_the_default_shapes_on_sglangs_capture_sizes(profiles):
    assert set(GPUS) == {"h100-sxm", "h200-sxm", "a100-sxm-80gb", "l4"}
    for gpu, profile in profiles.items():
        assert profile.source == "analytic" and gpu in profile.made_by
        assert profile.shapes == DEFAULT_CANDIDATES
        assert profile.batch_sizes == SPEC_CAPTURE_SIZES
        assert profile.batch_sizes[:9] == (1, 2, 3, 4, 5, 6, 7, 8, 10)
        assert profile.batch_sizes[-1] == 256
        assert profile.context_lens == (256, 1024, 4096, 16384)
        assert profile.notes["max_kv_tokens"] > 0
    with pytest.raises(ValueError, match="unknown GPU"):
        analytic_gpu_profile("tpu-v5")


def test_analytic_step_times_grow_with_batch_and_context(profiles):
    for profile in profiles.values():
        assert np.all(np.diff(profile.ms, axis=1) > 0)  # [shapes, batch_sizes, contexts]
        assert np.all(np.diff(profile.ms, axis=2) > 0)


def test_a_batch_between_capture_sizes_costs_the_larger_one(profiles):
    profile = profiles["h100-sxm"]
    for shape in (NO_SPEC, CHAIN, TREE):

        def ms(batch: int, shape: TreeShape = shape) -> float:
            return profile.step_ms(_features(profile, batch, 1024), shape)

        assert ms(9) == ms(10) and ms(11) == ms(12)  # 9 runs as 10, 11 as 12
        assert ms(11) > ms(10)  # the jump at the capture size
        assert ms(33) == ms(40) and ms(41) == ms(44) and ms(65) == ms(72)
        assert ms(1) < ms(2) < ms(3)  # every size a graph up to 8


def test_no_speculation_is_the_cheapest_step_and_each_pass_costs(profiles):
    chains = sorted((s for s in DEFAULT_CANDIDATES if s.is_chain), key=lambda s: s.steps)
    for profile in profiles.values():
        index = {s: i for i, s in enumerate(profile.shapes)}
        plain = profile.ms[index[NO_SPEC]]  # [batch_sizes, contexts]
        for shape in profile.shapes:
            if shape.speculative:
                assert np.all(profile.ms[index[shape]] > plain), shape
        # A longer chain runs more draft passes over more verified tokens.
        for shorter, longer in itertools.pairwise(chains):
            assert np.all(profile.ms[index[longer]] > profile.ms[index[shorter]])


def test_the_h100_profile_agrees_with_the_published_anchors(profiles):
    """hardware's docstring: within a factor 1.6 of SGLang's published speedups."""
    profile = profiles["h100-sxm"]
    plain_tok_s = 1000.0 / profile.step_ms(_features(profile, 1, 1024), NO_SPEC)
    assert 158.34 / 1.2 < plain_tok_s < 158.34 * 1.2
    # Batch 1, EAGLE-3 at acceptance length about 6: 2.36x; the deepest default tree.
    at_1 = implied_speedup(profile, DEEP, 6.0, 1, 1024)
    assert 2.36 / 1.6 < at_1 < 2.36 * 1.6
    # Batch 64: 1.38x; the shape is not published, so a chain and a tree, assumed acceptance.
    for shape, accept_len in ((CHAIN, 3.0), (TREE, 3.8)):
        at_64 = implied_speedup(profile, shape, accept_len, 64, 1024)
        assert 1.38 / 1.6 < at_64 < 1.38 * 1.6, shape
        # The gain shrinks with the batch, as the anchors' do.
        assert at_64 < implied_speedup(profile, shape, accept_len, 1, 1024)


def test_the_docstrings_table_is_what_the_profiles_give(profiles):
    """hardware's docstring quotes these implied speedups; they must not drift from the code."""
    expected = {
        "h100-sxm": (2.21, 2.60, 1.90, 1.27),
        "h200-sxm": (2.18, 2.57, 1.56, 0.97),
        "a100-sxm-80gb": (2.24, 2.56, 1.51, 0.90),
        "l4": (2.28, 2.68, 2.32, 1.62),
    }
    for gpu, figures in expected.items():
        profile = profiles[gpu]
        got = [
            implied_speedup(profile, shape, accept_len, batch, 1024)
            for batch in (1, 64)
            for shape, accept_len in ((CHAIN, 3.0), (TREE, 3.8))
        ]
        assert got == pytest.approx(figures, abs=0.006), gpu


def test_an_eagle3_head_drafts_cheaper():
    eagle, eagle3 = (
        analytic_gpu_profile("h100-sxm"),
        analytic_gpu_profile("h100-sxm", draft="eagle3"),
    )
    index = {s: i for i, s in enumerate(eagle.shapes)}
    assert np.allclose(eagle.ms[index[NO_SPEC]], eagle3.ms[index[NO_SPEC]])
    assert np.all(eagle3.ms[index[TREE]] < eagle.ms[index[TREE]])
    with pytest.raises(ValueError, match="eagle"):
        analytic_gpu_profile("h100-sxm", draft="medusa")


def test_an_analytic_profile_round_trips_through_json(profiles, tmp_path):
    profile = profiles["l4"]
    profile.save(tmp_path / "l4.json")
    _same(profile, TableProfile.load(tmp_path / "l4.json"))


# -- profiles from a deployment's telemetry --------------------------------------------------


@pytest.fixture
def telemetry(sqlite_url) -> tuple[str, int]:
    return sqlite_url, synthetic_run(store.get_engine(sqlite_url), 6000, end_time=1.8e9)


def _step_rows(url: str, run_id: int) -> list[dict]:
    """The run's rows, but catch-up steps."""
    with store.get_engine(url).connect() as conn:
        rows = conn.execute(Step.__table__.select().where(Step.run_id == run_id)).mappings().all()
    return [dict(r) for r in rows if r["decision_source"] != "catch-up"]


def test_telemetry_cells_hold_medians_or_the_fit(telemetry):
    url, run_id = telemetry
    profile = profile_from_telemetry(url, run_id)
    notes = profile.notes
    assert profile.source == "telemetry" and profile.name == f"telemetry-run{run_id}"
    assert "profile_from_telemetry" in profile.made_by and f"run_id={run_id}" in profile.made_by
    assert notes["rows"] == 6000 and notes["min_rows_per_cell"] == 5
    assert notes["cells_measured"] > 0 and notes["cells_filled"] > 0
    assert notes["cells_measured"] + notes["cells_filled"] == profile.ms.size
    per_shape = notes["per_shape"]
    assert sum(v["rows"] for v in per_shape.values()) == 6000
    assert sum(v["cells_measured"] for v in per_shape.values()) == notes["cells_measured"]
    # The GPU run's padding is the padded sizes it ran at; the grid's batch sizes are those.
    assert profile.padding.capture_sizes == profile.batch_sizes
    assert set(profile.batch_sizes) <= set(SPEC_CAPTURE_SIZES)
    # The busiest cell of the chain 1,1,2 holds its rows' median.
    rows = [r for r in _step_rows(url, run_id) if (r["steps"], r["num_draft_tokens"]) == (1, 2)]
    cells: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        mean = r["sum_context_len"] / r["batch_size"]
        c = min(profile.context_lens, key=lambda g, m=mean: abs(np.log(g / m)))
        cells.setdefault((r["padded_batch_size"], c), []).append(r["measured_step_ms"])
    (b, c), times = max(cells.items(), key=lambda kv: len(kv[1]))
    assert len(times) >= 5
    i = profile.shapes.index(TreeShape(1, 1, 2))
    j, k = profile.batch_sizes.index(b), profile.context_lens.index(c)
    assert profile.ms[i, j, k] == pytest.approx(float(np.median(times)))
    # Every cell, a median or the fit (its trend, the shape's level), follows the surface the
    # steps were drawn from, but for the tile jumps a linear fit cannot see.
    errors = []
    for i, shape in enumerate(profile.shapes):
        for j, b in enumerate(profile.batch_sizes):
            for k, c in enumerate(profile.context_lens):
                x = feature_matrix(StepFeatures(b, b, b * c, c), [shape])
                truth = float(SURFACE.step_ms(x)[0])
                errors.append(abs(profile.ms[i, j, k] / truth - 1.0))
    assert np.median(errors) < 0.08  # 0.035 when written


def test_telemetry_leaves_out_catch_up_steps_and_fills_unseen_shapes(telemetry):
    url, run_id = telemetry
    before = profile_from_telemetry(url, run_id)
    # Catch-up steps cost no speculation plus the draft's extend: they teach no cost model.
    row = _step_rows(url, run_id)[100]
    row.pop("id")
    extra = [
        {**row, "step_index": 10_000 + n, "decision_source": "catch-up", "measured_step_ms": 1e6}
        for n in range(50)
    ]
    with store.get_engine(url).begin() as conn:
        conn.execute(insert(Step), extra)
    after = profile_from_telemetry(url, run_id)
    np.testing.assert_allclose(after.ms, before.ms)
    assert after.ms.max() < 1e5
    # A shape no step ran is the fit's alone.
    unseen = TreeShape(7, 2, 10)
    widened = profile_from_telemetry(url, run_id, shapes=(*DEFAULT_CANDIDATES, unseen))
    assert widened.notes["per_shape"][str(unseen)] == {
        "rows": 0,
        "cells_measured": 0,
        "cells_filled": widened.ms[0].size,
        "fit_scale": 1.0,
    }
    # No learnable steps at all: refused.
    with pytest.raises(ValueError, match="no learnable steps"):
        profile_from_telemetry(url, run_id + 1)


def test_fewer_rows_than_the_minimum_are_filled(telemetry):
    url, run_id = telemetry
    strict = profile_from_telemetry(url, run_id, min_rows=10_000)
    assert strict.notes["cells_measured"] == 0
    loose = profile_from_telemetry(url, run_id, min_rows=1)
    assert (
        loose.notes["cells_measured"] > profile_from_telemetry(url, run_id).notes["cells_measured"]
    )


def test_a_telemetry_profile_round_trips_through_json(telemetry, tmp_path):
    url, run_id = telemetry
    profile = profile_from_telemetry(url, run_id, made_by="adatree simulate --profile-from-db X")
    assert profile.made_by == "adatree simulate --profile-from-db X"
    profile.save(tmp_path / "telemetry.json")
    _same(profile, TableProfile.load(tmp_path / "telemetry.json"))


# -- profiles from a profiled server's step log ----------------------------------------------


def _log_line(shape: str, batch: int, context: int, ms: float, **kw) -> str:
    row = {"shape": shape, "source": "warmup", "emitted": None, "batch_size": batch,
           "sum_context_len": batch * context, "step_ms": ms, "forward_ms": 0.9 * ms,
           "draft_forward_ms": 0.0, "forward_calls": 3}  # fmt: skip
    return json.dumps({**row, **kw}) + "\n"


def test_a_served_step_log_becomes_a_measured_profile(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for batch in (1, 2, 4):
        for context in (100, 400):
            for _ in range(6):
                noise = rng.uniform(0.98, 1.02)
                # Plain steps ran the draft's extend (12 ms): the profile charges them without.
                lines.append(
                    _log_line("0,1,1", batch, context, (112 + 10 * batch) * noise,
                              draft_forward_ms=12.0)
                )  # fmt: skip
                lines.append(_log_line("1,1,2", batch, context, (120 + 15 * batch) * noise))
    # Left out: a catch-up step, a step right after one of another shape (it pays for the
    # change), a step without forwards, a line from before contexts were logged.
    lines.append(_log_line("0,1,1", 1, 100, 900.0, source="catch-up"))
    lines.append(_log_line("0,1,1", 1, 100, 900.0, previous_shape="6,4,16"))
    lines.append(_log_line("1,1,2", 1, 100, 120.0, previous_shape="1,1,2"))  # kept
    lines.append(_log_line("0,1,1", 1, 100, 900.0, forward_ms=0.0))
    old = json.loads(_log_line("0,1,1", 1, 100, 900.0))
    del old["sum_context_len"]
    lines.append(json.dumps(old) + "\n")
    # Too few steps for their own cell (batch 3): filled by the fit.
    lines += [_log_line("1,1,2", 3, 400, 165.0) for _ in range(2)]
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(lines))
    profile = profile_from_served_steps(
        path, made_by="adatree profile ... (2026-12-02)", name="cpu"
    )
    assert profile.source == "measured" and profile.name == "cpu"
    assert profile.padding == NO_GRAPHS
    assert profile.batch_sizes == (1, 2, 3, 4) and profile.context_lens == (128, 256, 512)
    assert profile.notes["rows"] == 2 * 36 + 2 + 1
    assert profile.notes["step_log"] == "steps.jsonl"
    plain = profile.step_ms(StepFeatures(1, 1, 100, 100), NO_SPEC)
    assert plain == pytest.approx(110.0, rel=0.03)  # 122 ms less the draft's 12
    assert profile.step_ms(StepFeatures(4, 4, 1600, 400), TreeShape(1, 1, 2)) == pytest.approx(
        180.0, rel=0.03
    )
    # Batch 3 of the chain: two steps are too few; the fit lies between batch 2's and 4's.
    filled = profile.step_ms(StepFeatures(3, 3, 1200, 400), TreeShape(1, 1, 2))
    two = profile.step_ms(StepFeatures(2, 2, 800, 400), TreeShape(1, 1, 2))
    assert two < filled < 180.0 * 1.03
    per_shape = profile.notes["per_shape"]
    assert per_shape["1,1,2"]["cells_measured"] == 6 and per_shape["0,1,1"]["cells_measured"] == 6
    profile.save(tmp_path / "cpu.json")
    _same(profile, TableProfile.load(tmp_path / "cpu.json"))


def test_a_log_without_contexts_is_refused(tmp_path):
    path = tmp_path / "old.jsonl"
    row = json.loads(_log_line("0,1,1", 1, 100, 90.0))
    del row["sum_context_len"]
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="no usable steps"):
        profile_from_served_steps(path, made_by="x")
