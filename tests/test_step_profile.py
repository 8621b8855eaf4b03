"""A deployment's step-time profile as a server's step-time model: ``ProfileStepTime`` prices
feature rows as the profile does, ``load_profile_step_time`` refuses what cannot serve, and a
step controller given a profile prices by it and never refits it away."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from test_controller import Batch, config, outcome

from sglang_adatree.cli import main
from sglang_adatree.core.controller import ControlUpdate, ModelSource, StepController
from sglang_adatree.core.cost_model import PROFILE_ERROR, OnlineCostModel
from sglang_adatree.core.features import NO_GRAPHS, GraphPadding, StepFeatures, feature_matrix
from sglang_adatree.core.policy import DecisionSource, Pin
from sglang_adatree.core.refit import FIRST_REFIT_ROWS, REFIT_EVERY_ROWS
from sglang_adatree.core.shapes import TreeShape, parse_candidates
from sglang_adatree.core.step_profile import (
    ProfileStepTime,
    TableProfile,
    load_profile_step_time,
)
from sglang_adatree.sglang.serve import build_command

SHAPES = parse_candidates("0;3,1,4;2,2,4")
BATCHES = (1, 2, 4)
CONTEXTS = (64, 512)


def profile(shapes=SHAPES, padding=NO_GRAPHS, level_trees: bool = False) -> TableProfile:
    """Step times that differ by shape, batch and context, and are not linear in the shape;
    ``level_trees``: every speculative shape costs the same."""
    ms = np.empty((len(shapes), len(BATCHES), len(CONTEXTS)))
    for i in range(len(shapes)):
        size = min(i, 1) if level_trees else i * i
        for j, b in enumerate(BATCHES):
            for k, c in enumerate(CONTEXTS):
                ms[i, j, k] = 50.0 + 7.0 * size + 9.0 * b + 0.01 * c * b
    return TableProfile("test", "measured", "a test", shapes, BATCHES, CONTEXTS, ms, padding)


def test_rows_are_priced_as_the_profile_prices_each_one():
    table = profile()
    model = ProfileStepTime(table)
    batches = [StepFeatures(1, 1, 100, 100), StepFeatures(3, 3, 900, 500)]
    # One batch's candidates (the decision's call), then rows of two batches mixed.
    x = feature_matrix(batches[1], SHAPES)
    assert model.predict_matrix(x) == pytest.approx([table.step_ms(batches[1], s) for s in SHAPES])
    rows = [(f, s) for s in SHAPES for f in batches]
    mixed = np.vstack([feature_matrix(f, (s,)) for f, s in rows])
    expected = [table.step_ms(f, s) for f, s in rows]
    assert model.predict_matrix(mixed) == pytest.approx(expected)
    assert model.predict_matrix(mixed[:0]).shape == (0,)


def test_a_profile_prices_each_shape_tuple_by_its_own_rows():
    # The rows of the last tuple priced are kept: another tuple must not reuse them.
    table = profile()
    f = StepFeatures(3, 3, 900, 500)
    one_by_one = {s: table.step_ms(f, s) for s in SHAPES}
    for shapes in (SHAPES, SHAPES[::-1], SHAPES[1:], SHAPES, (SHAPES[2],)):
        assert table.step_ms_many(f, shapes).tolist() == [one_by_one[s] for s in shapes]
    with pytest.raises(KeyError, match="no step time for shape 5,1,6"):
        table.step_ms_many(f, (*SHAPES, TreeShape(5, 1, 6)))


def test_one_batch_is_priced_directly_as_its_feature_rows_are():
    model = ProfileStepTime(profile(padding=GraphPadding((1, 2, 4))))
    cost = OnlineCostModel(model, residual_decay=0.5)
    for f in (
        StepFeatures(1, 1, 10, 10),
        StepFeatures(3, 4, 900, 500),
        StepFeatures(9, 9, 90000, 9000),
    ):
        rows = model.predict_matrix(feature_matrix(f, SHAPES))
        assert model.predict_list(f, SHAPES) == rows.tolist()
        assert cost.raw_ms_many(f, SHAPES).tolist() == rows.tolist()


def test_the_profile_pads_a_batch_as_its_deployment_did():
    # Measured with CUDA graphs of 1, 2 and 4: a batch of 3 runs as 4 there.
    table = profile(padding=GraphPadding((1, 2, 4)))
    three = StepFeatures(3, 3, 600, 200)
    four = StepFeatures(4, 4, 800, 200)
    x = feature_matrix(three, SHAPES)
    assert ProfileStepTime(table).predict_matrix(x) == pytest.approx(
        [table.step_ms(four, s) for s in SHAPES]
    )


def test_a_profile_file_is_loaded_for_the_candidates_it_covers(tmp_path):
    path = tmp_path / "cpu.json"
    profile().save(path)
    model = load_profile_step_time(str(path), SHAPES)
    assert model.profile.missing(SHAPES) == []
    assert model.profile.missing((TreeShape(4, 4, 8),)) == [TreeShape(4, 4, 8)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it"),
        ("{not json", "is not a step-time profile"),
        ('{"name": "x"}', "is not a step-time profile"),
        ("partial", "has no step times for the candidate shapes 3,1,4"),
    ],
)
def test_a_profile_that_cannot_serve_is_refused_with_what_to_do(tmp_path, content, message):
    path = tmp_path / "profile.json"
    if content == "partial":
        profile(SHAPES[:2]).save(path)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        load_profile_step_time(path, SHAPES)
    assert str(path) in str(error.value)
    if content == "partial":
        assert "adatree profile" in str(error.value)


def _run(controller: StepController, steps: int, ms) -> None:
    """``steps`` steps of one request, each shape in turn (pinned), the poller's refits
    applied as they come due."""
    batch = Batch(100)
    shapes = controller.candidate_shapes
    for i in range(steps):
        controller.apply(ControlUpdate(pins=(Pin(shapes[i % len(shapes)]),)))
        ticket = controller.begin(batch.view())
        report = controller.finish(ticket, outcome(ticket, ms(ticket)))
        batch.advance(report, ticket)
        update = controller.refit()
        if update is not None:
            controller.apply(update)


def test_a_controller_with_a_profile_prices_by_it_and_never_refits():
    table = profile()
    model = ProfileStepTime(table)
    controller = StepController(config(skip_idle_draft_extend=False), profile=model)
    features = StepFeatures(1, 1, 100, 100)
    ticket = controller.begin(Batch(100).view())
    shape = ticket.decision.shape
    assert ticket.decision.predicted_ms == pytest.approx(table.step_ms(features, shape))
    controller.finish(ticket, outcome(ticket, table.step_ms(features, shape)))
    # The machine runs 30% slower than the profile, every shape alike.
    steps = 2 * REFIT_EVERY_ROWS + FIRST_REFIT_ROWS
    _run(controller, steps, lambda t: 1.3 * table.step_ms(t.features, t.decision.shape))
    assert not controller.measured.fitted  # no analytic refit ran
    assert controller.policy.cost_model.step_time is model
    # The drift took up the machine's speed; each shape keeps the profile's standing.
    later = StepFeatures(1, 1, 700, 700)
    predicted = controller.policy.cost_model.predict_ms_many(later, SHAPES)
    assert predicted == pytest.approx([1.3 * table.step_ms(later, s) for s in SHAPES], rel=0.02)


def _moved_by_slow_explorations(noise: float, profile_error: float | None) -> float:
    """How far three exploring steps of a shape, 40% over its price in slow moments of the
    machine, move its price, while another shape of the same price runs at it with ``noise``.
    Both speculate and their levers are equal, so the split (tilt and offset) cannot take the
    surprise: the shape's part must (``cost_model.ResidualCorrection``)."""
    rng = np.random.default_rng(5)
    table = profile(level_trees=True)
    running, explored = SHAPES[2], SHAPES[1]
    features = StepFeatures(1, 1, 100, 100)
    cost = OnlineCostModel(ProfileStepTime(table), 0.05, profile_error=profile_error)
    for i in range(120):
        ms = table.step_ms(features, running) * math.exp(noise * rng.standard_normal())
        cost.observe(features, running, ms)
        if i in (60, 80, 100):
            cost.observe(features, explored, 1.4 * table.step_ms(features, explored))
    return cost.predict_ms(features, explored) / table.step_ms(features, explored) - 1.0


def test_a_profile_is_worth_more_of_a_shapes_steps_the_noisier_they_are():
    # On this CPU's noise (17%) the profile's standing of a shape, 3% off, outweighs a few
    # slow steps of it; a default model's view of it (worth 4 steps) does not. Under a GPU's
    # noise (2%) a step is as sure as the profile: the profile is worth one step and the same
    # steps move its price further than the default model's. Without the estimated noise, or
    # with the first measured shape left at the worth of an unknown noise, the first holds
    # no more.
    moved = {
        (noise, error): _moved_by_slow_explorations(noise, error)
        for noise in (0.17, 0.02)
        for error in (PROFILE_ERROR, None)
    }
    assert moved[0.17, PROFILE_ERROR] < 0.6 * moved[0.17, None]
    assert moved[0.02, PROFILE_ERROR] > moved[0.02, None]


def test_a_controller_prices_by_its_profile_as_a_measured_profile():
    model = ProfileStepTime(profile())
    controller = StepController(config(skip_idle_draft_extend=False), profile=model)
    assert controller.policy.cost_model.residual.profile_error == PROFILE_ERROR
    _run(controller, 40, lambda t: 100.0)
    rollback = controller.refit(force=True)
    assert rollback is not None
    assert rollback.cost_model.residual.profile_error == PROFILE_ERROR
    refitted = StepController(config(skip_idle_draft_extend=False))
    assert refitted.policy.cost_model.residual.profile_error is None


def test_a_controller_with_a_profile_runs_no_warm_up():
    # The profile prices every shape already: the first step is the policy's own choice.
    warm = config(skip_idle_draft_extend=False, warmup_steps=32)
    profiled = StepController(warm, profile=ProfileStepTime(profile()))
    refitted = StepController(warm)
    for controller, sources in (
        (profiled, {DecisionSource.FALLBACK}),
        (refitted, {DecisionSource.WARMUP}),
    ):
        seen = set()
        for _ in range(len(SHAPES)):
            ticket = controller.begin(Batch(100).view())
            seen.add(ticket.decision.source)
            controller.finish(ticket, outcome(ticket, 100.0))
        assert seen == sources
    assert profiled.config.warmup_steps == 32  # the operator's setting reads as set


def test_rolling_back_from_a_trained_version_hands_back_the_profile():
    model = ProfileStepTime(profile())
    controller = StepController(config(skip_idle_draft_extend=False), profile=model)
    _run(controller, 40, lambda t: 100.0)
    update = controller.refit(force=True)
    assert update is not None and update.model_source is ModelSource.PROFILE
    assert update.cost_model.step_time is model
    # With the measured steps' corrections replayed: every shape's prediction near 100 ms.
    predicted = update.cost_model.predict_ms_many(StepFeatures(1, 1, 140, 140), SHAPES)
    assert predicted == pytest.approx([100.0] * len(SHAPES), rel=0.1)


def test_adatree_serve_hands_the_profile_to_every_sglang_process(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env: dict[str, str] = {}
    command = build_command(
        ["--model-path", "T", "--device", "cuda", "--step-time-profile", "cpu.json"], env
    )
    assert env["ADATREE_STEP_TIME_PROFILE"] == str(tmp_path / "cpu.json")
    assert "--step-time-profile" not in command and "cpu.json" not in command


def _pair(tmp_path):
    """Model folders a dry run accepts: a target and an EAGLE head, their configs only."""
    for name, arch in (("target", "LlamaForCausalLM"), ("head", "LlamaForCausalLMEagle")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "head")]


def test_adatree_bench_serves_adatree_priced_by_a_profile(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    profile().save(tmp_path / "cpu.json")
    pair = _pair(tmp_path)

    def bench(candidates: str, *more: str) -> int:
        policies = ["--policies", "ar,adatree+profile", "--loads", "c1", "--prompts", "mtbench"]
        dry = ["--dry-run", "--work-dir", str(tmp_path / "work")]
        return main(["bench", *pair, "--candidate-shapes", candidates, *dry, *policies, *more])

    assert bench("0;3,1,4;2,2,4", "--step-time-profile", "cpu.json") == 0
    out = capsys.readouterr().out
    assert f"--step-time-profile {tmp_path / 'cpu.json'}" in out  # absolute: servers run elsewhere
    with pytest.raises(SystemExit, match=r"adatree bench: .*--step-time-profile FILE"):
        bench("0;3,1,4;2,2,4")
    # A profile that lacks a candidate, or no file at all, stops it before any server starts.
    with pytest.raises(SystemExit, match=r"adatree bench: .*6,4,16"):
        bench("0;3,1,4;6,4,16", "--step-time-profile", "cpu.json")
    with pytest.raises(SystemExit, match=r"adatree bench: .*missing\.json"):
        bench("0;3,1,4;2,2,4", "--step-time-profile", "missing.json")
