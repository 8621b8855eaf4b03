"""The lab's simulator and runner on parametric traces and a hand-made profile: determinism, the
oracles' order, arrivals, and adatree's serving loop driven as the server drives it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.policy import DecisionSource
from sglang_adatree.core.shapes import NO_SPEC, TreeShape
from sglang_adatree.core.step_profile import ProfileStepTime, TableProfile
from sglang_adatree.lab.runner import DECOMPOSITION, run_scenario
from sglang_adatree.lab.simulator import (
    PREFILL_TOKENS_PER_STEP,
    Arrivals,
    SimConfig,
    controller_chooser_factory,
    hindsight_abs_error,
    simulate,
    static_chooser,
)
from sglang_adatree.lab.traces import parametric_traces

SHAPES = (NO_SPEC, TreeShape(1, 1, 2), TreeShape(3, 1, 4), TreeShape(2, 2, 4), TreeShape(3, 2, 6))
HAZARDS = {
    "easy": np.array([[0.85, 0.4]] * 4),
    "hard": np.array([[0.35, 0.2]] * 4),
}


def profile(per_token: float = 2.0, per_pass: float = 3.0) -> TableProfile:
    """A GPU-like profile: a floor, a cost per verified token and per draft pass, rising with
    batch size and context."""
    batch = (1, 4, 16, 64)
    ctx = (128, 1024)
    ms = np.empty((len(SHAPES), len(batch), len(ctx)))
    for i, s in enumerate(SHAPES):
        for j, b in enumerate(batch):
            for k, c in enumerate(ctx):
                tokens = b * s.num_draft_tokens
                ms[i, j, k] = 10.0 + per_token * tokens / 4 + per_pass * s.steps + 1e-4 * b * c
    return TableProfile("test", "analytic", "tests", SHAPES, batch, ctx, ms)


TRACES = parametric_traces("t", "test pair", SHAPES, HAZARDS, num_requests=12, answer_len=64)
CONFIG = AdaTreeConfig(candidate_shapes=SHAPES, record_steps=False)


def test_a_run_is_a_pure_function_of_its_inputs():
    sim = SimConfig(Arrivals("closed", concurrency=3), num_requests=12, noise=0.05, drift=0.1)
    make = controller_chooser_factory(CONFIG, TRACES)
    a = simulate(TRACES, profile(), sim, make, "adatree", keep_timeline=True)
    b = simulate(TRACES, profile(), sim, make, "adatree", keep_timeline=True)
    assert a == b and a.timeline == b.timeline
    other = SimConfig(sim.arrivals, 12, noise=0.05, drift=0.1, seed=1)
    c = simulate(TRACES, profile(), other, make, "x")
    assert c.goodput_tok_s != a.goodput_tok_s


@pytest.mark.parametrize("keep", [0.0, 0.6])
def test_step_noise_has_its_sigma_and_its_step_to_step_correlation(keep):
    from sglang_adatree.lab.simulator import _Machine

    cfg = SimConfig(Arrivals("closed", concurrency=1), num_requests=1, noise=0.15, noise_keep=keep)
    machine = _Machine(profile(), cfg)
    log_noise = np.log([machine.measured(100.0) / 100.0 for _ in range(20_000)])  # [steps]
    assert log_noise.std() == pytest.approx(0.15, rel=0.05)
    lag1 = np.corrcoef(log_noise[:-1], log_noise[1:])[0, 1]
    assert lag1 == pytest.approx(keep, abs=0.03)
    with pytest.raises(ValueError, match="noise_keep"):
        SimConfig(Arrivals("closed", concurrency=1), num_requests=1, noise_keep=1.0)


@pytest.mark.parametrize("tilt", [0.5, -0.5])
def test_a_tilt_raises_each_shapes_ratio_to_no_speculation(tilt):
    from sglang_adatree.lab.simulator import _Machine

    table = profile()
    arrivals = Arrivals("closed", concurrency=1)
    level = _Machine(table, SimConfig(arrivals, num_requests=1))
    tilted = _Machine(table, SimConfig(arrivals, num_requests=1, tilt=tilt))
    features = StepFeatures(4, 4, 2000, 600)
    plain = table.step_ms(features, NO_SPEC)
    assert tilted.true_ms(features, NO_SPEC) == level.true_ms(features, NO_SPEC) == plain
    for shape in SHAPES[1:]:
        ratio = table.step_ms(features, shape) / plain
        assert level.true_ms(features, shape) == pytest.approx(plain * ratio)
        assert tilted.true_ms(features, shape) == pytest.approx(plain * ratio ** np.exp(tilt))
        # A positive tilt makes every tree dearer against no speculation, a negative cheaper.
        assert (tilted.true_ms(features, shape) > level.true_ms(features, shape)) == (tilt > 0)
    catch_up, tilted_catch_up = level.catch_up_ms(features), tilted.catch_up_ms(features)
    assert tilted_catch_up == pytest.approx(plain * (catch_up / plain) ** np.exp(tilt))
    assert tilted.prefill_ms(100) == level.prefill_ms(100)


def test_a_cold_step_costs_a_shapes_first_step_once():
    arrivals = Arrivals("closed", concurrency=1)
    tree = TreeShape(2, 2, 4)
    plain, cold = (
        SimConfig(arrivals, num_requests=4, cold_step=f, shuffle=False) for f in (1.0, 1.5)
    )
    runs = {
        (shape, c.cold_step): simulate(
            TRACES, profile(), c, lambda m, t, s=shape: static_chooser(s), "x"
        )
        for shape in (NO_SPEC, tree)
        for c in (plain, cold)
    }
    # No speculation pays nothing; the tree pays half of its first step once.
    assert runs[(NO_SPEC, 1.5)] == runs[(NO_SPEC, 1.0)]
    first = profile().step_ms(
        StepFeatures.from_context_lens([TRACES.requests[0].prompt_len + 1]), tree
    )
    extra = runs[(tree, 1.5)].decode_s - runs[(tree, 1.0)].decode_s
    assert extra * 1000.0 == pytest.approx(0.5 * first)
    assert runs[(tree, 1.5)].steps == runs[(tree, 1.0)].steps
    with pytest.raises(ValueError, match="cold_step"):
        SimConfig(arrivals, num_requests=1, cold_step=0.0)


def test_a_prefill_costs_a_step_without_speculation_per_64_prompt_tokens():
    from sglang_adatree.lab.simulator import _Machine

    table = profile()
    machine = _Machine(table, SimConfig(Arrivals("closed", concurrency=1), num_requests=1))
    for prompt in (1, 100, 640):
        step = table.step_ms(StepFeatures(1, 1, prompt, 1), NO_SPEC)
        expected = step * (1 + prompt / PREFILL_TOKENS_PER_STEP)
        assert machine.prefill_ms(prompt) == pytest.approx(expected)
    # A long prompt is dearer than a short one, and far cheaper than a decode step per token.
    assert machine.prefill_ms(640) > machine.prefill_ms(100)
    assert machine.prefill_ms(640) < 640 * table.step_ms(StepFeatures(1, 1, 640, 1), NO_SPEC) / 10


def test_every_token_of_every_request_is_served_once():
    for arrivals in (
        Arrivals("closed", concurrency=4),
        Arrivals("poisson", rate_per_s=3.0),
        Arrivals("bursts", bursts=((2.0, 6), (3.0, 0), (1.0, 1))),
        Arrivals("recorded", times=tuple(0.5 * i for i in range(10))),
    ):
        sim = SimConfig(arrivals, num_requests=10)
        run = simulate(TRACES, profile(), sim, lambda m, c: static_chooser(SHAPES[3]), "s")
        expected = sum(r.answer_len for r in [TRACES.requests[i] for i in _order(10)])
        assert run.output_tokens == expected, arrivals.describe()
        assert run.makespan_s > 0 and run.steps > 0


def _order(n: int) -> list[int]:
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(TRACES.requests))
    return [int(perm[i % len(perm)]) for i in range(n)]


def test_a_static_shape_emits_what_its_traces_say():
    sim = SimConfig(Arrivals("closed", concurrency=1), num_requests=4)
    for shape in SHAPES:
        run = simulate(TRACES, profile(), sim, lambda m, c, s=shape: static_chooser(s), str(shape))
        assert run.shape_shares == {str(shape): 1.0}
        if shape == NO_SPEC:
            assert run.accept_len_mean == 1.0
    ar = simulate(TRACES, profile(), sim, lambda m, c: static_chooser(NO_SPEC), "ar")
    assert ar.steps == sum(TRACES.requests[i].answer_len - 1 for i in _order(4))


def test_walked_emitted_is_what_a_static_shape_emits_per_step():
    # One request alone: a static shape's emitted tokens per step are the request's walk under
    # that shape.
    for request in TRACES.requests[:4]:
        one = dataclasses.replace(TRACES, requests=(request,))
        walked = request.walked_emitted()
        sim = SimConfig(Arrivals("closed", concurrency=1), num_requests=1)
        for shape in SHAPES:
            run = simulate(one, profile(), sim, lambda m, c, s=shape: static_chooser(s), "s")
            assert run.accept_len_mean == pytest.approx(walked[one.column(shape)])
    # A hard stretch of 20 positions and an easy one of 20 (4 tokens a step): 20 steps and 5,
    # 40 tokens in 25 steps, where the mean over positions reads 2.5.
    template = TRACES.requests[0]
    emitted = np.ones((41, len(SHAPES)), dtype=np.int16)
    emitted[21:, :] = 4
    stretches = dataclasses.replace(
        template,
        emitted=emitted,
        num_children=np.zeros((41, *template.num_children.shape[1:]), dtype=np.int8),
        accepted_rank=np.full((41, *template.accepted_rank.shape[1:]), -1, dtype=np.int8),
        draft_expected=np.zeros((41, len(SHAPES)), dtype=np.float32),
    )
    assert stretches.walked_emitted() == pytest.approx([40 / 25] * len(SHAPES))
    assert emitted[1:].mean() == 2.5


@settings(max_examples=10, deadline=None)
@given(
    top=st.floats(0.2, 0.95),
    concurrency=st.sampled_from([1, 3, 8]),
    per_pass=st.floats(0.5, 20.0),
    seed=st.integers(0, 1000),
)
# Chosen by the best step's rate instead of the run's, the oracle trails static 3,1,4 by 1.003%.
@example(top=0.90625, concurrency=3, per_pass=1.0, seed=155)
def test_the_per_step_oracle_is_at_or_above_every_static_shape(top, concurrency, per_pass, seed):
    # The per-step oracle chooses each step at the run's rate; it visits other positions than a
    # static shape does, so on a run of a few hundred steps it may trail one by the luck of
    # those positions, never by more than 1%.
    traces = parametric_traces(
        "p", "pair", SHAPES, {"c": np.array([[top, top / 2]] * 4)}, num_requests=24,
        answer_len=96, seed=seed,
    )  # fmt: skip
    sim = SimConfig(
        Arrivals("closed", concurrency=concurrency), num_requests=24, noise=0.05, drift=0.1,
        seed=seed,
    )  # fmt: skip
    result = run_scenario(
        traces, profile(per_pass=per_pass), sim, CONFIG, SHAPES, policies=("none",),
        decompose=False,
    )  # fmt: skip
    oracle = result.runs["per-step-oracle"].goodput_tok_s
    for name, run in result.runs.items():
        if name.startswith("static:") or name == "ar":
            assert oracle >= run.goodput_tok_s * 0.99, name


def test_the_runner_scores_every_policy_and_splits_adatrees_loss():
    sim = SimConfig(Arrivals("closed", concurrency=2), num_requests=12, noise=0.05, drift=0.1)
    result = run_scenario(TRACES, profile(), sim, CONFIG, SHAPES)
    names = set(result.runs)
    assert {"ar", "oracle-static", "per-step-oracle", "adatree", "turbospec"} <= names
    assert {f"static:{s}" for s in SHAPES if s.speculative} <= names
    oracle_static = result.runs["oracle-static"].goodput_tok_s
    assert oracle_static == max(
        r.goodput_tok_s for n, r in result.runs.items() if n.startswith("static:") or n == "ar"
    )
    # Every cause of the split is measured, and the split adds up to the whole gap.
    assert set(result.decomposition) == {*DECOMPOSITION, "rest"}
    gap = 1.0 - result.ratio("adatree", "per-step-oracle")
    assert sum(result.decomposition.values()) == pytest.approx(gap, abs=1e-9)
    # With every estimate true the loop is close to the per-step oracle.
    assert result.ratio(f"adatree+{'+'.join(DECOMPOSITION)}", "per-step-oracle") > 0.9


def test_the_split_replaces_the_causes_in_the_order_asked():
    # Another order names other variants and may move a cause's share, but its last variant has
    # every estimate true, as the default order's has, and its shares add up to the same gap.
    sim = SimConfig(Arrivals("closed", concurrency=2), num_requests=12, noise=0.05, drift=0.1)
    order = ("step-time", "exploration", "acceptance", "switching")
    default = run_scenario(TRACES, profile(), sim, CONFIG, SHAPES, policies=("adatree",))
    other = run_scenario(
        TRACES, profile(), sim, CONFIG, SHAPES, policies=("adatree",), decompose_order=order
    )
    assert tuple(other.decomposition) == (*order, "rest")
    assert "adatree+step-time" in other.runs and "adatree+step-time" not in default.runs
    assert other.runs[f"adatree+{'+'.join(order)}"].goodput_tok_s == pytest.approx(
        default.runs[f"adatree+{'+'.join(DECOMPOSITION)}"].goodput_tok_s
    )
    assert sum(other.decomposition.values()) == pytest.approx(
        sum(default.decomposition.values()), abs=1e-9
    )
    with pytest.raises(ValueError, match="each of"):
        run_scenario(TRACES, profile(), sim, CONFIG, SHAPES, decompose_order=order[:3])


def test_a_server_priced_by_a_profile_stops_speculating_on_a_machine_where_trees_cost_more():
    # The machine splits its time otherwise than the profile the controller starts from:
    # every tree's ratio to plain decoding is the profile's raised to exp(1.2), and plain
    # decoding is the best static choice. The speculative steps' surprise is taken by the
    # split, not by a drift common to plain decoding too, so plain decoding is priced right
    # and the server serves almost all its steps without speculation.
    traces = parametric_traces("t", "test pair", SHAPES, HAZARDS, num_requests=24, answer_len=128)
    sim = SimConfig(Arrivals("closed", concurrency=1), num_requests=24, noise=0.1, tilt=1.2)
    result = run_scenario(
        traces, profile(), sim, CONFIG, SHAPES, policies=("adatree",), decompose=False,
        timelines=(), profiled=ProfileStepTime(profile()),
    )  # fmt: skip
    assert result.oracle_static == "ar"
    assert result.ratio("adatree", "ar") > 0.97
    assert result.runs["adatree"].shape_shares[str(NO_SPEC)] > 0.95


def _logged_controller(log: list):
    """A controller chooser factory whose controller logs every finished step's shape,
    decision, emitted tokens and measured time."""
    make = controller_chooser_factory(CONFIG, TRACES)

    def logged(machine, clock):
        chooser = make(machine, clock)
        finish = chooser.controller.finish

        def finish_logged(ticket, outcome):
            emitted = [a + 1 for a in outcome.accepted_per_request]
            log.append((ticket.decision.shape, ticket.decision, emitted, outcome.measured_ms))
            return finish(ticket, outcome)

        chooser.controller.finish = finish_logged
        return chooser

    return logged


@pytest.mark.parametrize("warmup_requests", [0, 3])
def test_the_estimates_are_what_the_controller_predicted_for_its_measured_steps(warmup_requests):
    log: list = []
    sim = SimConfig(
        Arrivals("closed", concurrency=2), num_requests=8, noise=0.05,
        warmup_requests=warmup_requests,
    )  # fmt: skip
    run = simulate(TRACES, profile(), sim, _logged_controller(log), "adatree")
    steps = log[len(log) - run.steps :]  # the warm-up requests' steps are not counted
    assert warmup_requests == 0 or len(steps) < len(log)

    def of(sources):
        rows = [(d, e) for s, d, e, _ in steps if s.speculative and d.source in sources]
        n = sum(len(e) for _, e in rows)
        return (
            len(rows),
            sum(d.predicted_emitted * len(e) for d, e in rows) / n,
            sum(sum(e) for _, e in rows) / n,
        )

    est = run.estimates
    chosen = of({DecisionSource.MODEL, DecisionSource.FALLBACK})
    explored = of({DecisionSource.EXPLORE})
    assert (est.chosen_steps, est.chosen_predicted, est.chosen_emitted) == pytest.approx(chosen)
    assert (est.explored_steps, est.explored_predicted, est.explored_emitted) == pytest.approx(
        explored
    )
    assert est.chosen_bias == pytest.approx(chosen[1] / chosen[2] - 1)
    speculative = [(d, e) for s, d, e, _ in steps if s.speculative]
    assert est.emitted_abs_error == pytest.approx(
        sum(abs(d.predicted_emitted - x) for d, e in speculative for x in e)
        / sum(len(e) for _, e in speculative)
    )
    priced = [(d, ms) for _, d, _, ms in steps if d.source is not DecisionSource.CATCH_UP]
    assert est.step_ms_rel_error == pytest.approx(
        sum(abs(d.predicted_ms - ms) / ms for d, ms in priced) / len(priced)
    )
    # The references predict nothing.
    assert (
        simulate(TRACES, profile(), sim, lambda m, c: static_chooser(SHAPES[3]), "s").estimates
        is None
    )


def test_declined_steps_are_priced_against_what_their_best_speculative_shape_would_emit():
    # Speculation must beat none by 100%: with no warm-up, probes or exploration the policy
    # serves every step without speculation, each one declined on its estimates.
    config = CONFIG.replace(
        no_spec_margin=1.0, warmup_steps=0, explore_fraction=0.0, new_batch_steps=0
    )
    make, log = controller_chooser_factory(config, TRACES), []

    def logged(machine, clock):
        chooser = make(machine, clock)
        begin, policy = chooser.controller.begin, chooser.controller.policy

        def begin_logged(view):
            ticket = begin(view)
            predictions = policy.predictions(ticket.features, view.request_ids, ticket.confidence)
            log.append((*predictions, ticket.features))
            return ticket

        chooser.controller.begin = begin_logged
        return chooser

    run = simulate(TRACES, profile(), SimConfig(Arrivals("closed", concurrency=1), 3), logged, "a")
    est = run.estimates
    assert est.chosen_steps == 0 and est.declined_steps == run.steps == len(log)
    # One request at a time, one token a step: positions 1, 2, ... of each in the drawn order.
    positions = [
        (TRACES.requests[i], p) for i in _order(3) for p in range(1, TRACES.requests[i].answer_len)
    ]
    assert len(positions) == len(log)
    speculative = [i for i, s in enumerate(SHAPES) if s.speculative]
    plain = SHAPES.index(NO_SPEC)
    predicted, would, priced = [], [], []
    for (times, emitted, features), (trace, p) in zip(log, positions, strict=True):
        best = max(speculative, key=lambda i: emitted[i] / times[i])
        predicted.append(emitted[best])
        would.append(trace.emitted[p, TRACES.column(SHAPES[best])])
        true = profile().step_ms(features, SHAPES[best]) / profile().step_ms(features, NO_SPEC)
        priced.append(times[best] / times[plain] / true)
    assert est.declined_predicted == pytest.approx(np.mean(predicted))
    assert est.declined_would_emit == pytest.approx(np.mean(would))
    assert est.declined_bias == pytest.approx(np.mean(predicted) / np.mean(would) - 1)
    # The analytic model prices the shapes otherwise than the profile does.
    assert est.declined_time_bias == pytest.approx(np.mean(priced) - 1)
    assert abs(est.declined_time_bias) > 0.01


def test_warm_up_requests_are_served_first_and_not_measured():
    sim = SimConfig(Arrivals("closed", concurrency=2), num_requests=5, warmup_requests=4)
    run = simulate(TRACES, profile(), sim, controller_chooser_factory(CONFIG, TRACES), "a")
    measured = _order(9)[4:]
    assert run.output_tokens == sum(TRACES.requests[i].answer_len for i in measured)
    cold = simulate(
        TRACES, profile(), SimConfig(sim.arrivals, num_requests=5),
        controller_chooser_factory(CONFIG, TRACES), "a",
    )  # fmt: skip
    # The warmed loop has left its warm-up shapes behind by the measured requests.
    assert run.shape_shares != cold.shape_shares


def test_every_candidates_error_is_judged_on_every_step_against_its_trace():
    sim = SimConfig(Arrivals("closed", concurrency=2), num_requests=12, noise=0.05)
    make = controller_chooser_factory(CONFIG, TRACES)
    est = simulate(TRACES, profile(), sim, make, "adatree").estimates
    # Requests of two classes: a level per request predicts them better than one estimate per
    # shape, and the fit to the run's own steps in hindsight better still.
    assert est.hindsight_abs_error < est.candidate_abs_error < est.shape_abs_error
    # The references predict nothing.
    static = simulate(TRACES, profile(), sim, lambda m, c: static_chooser(SHAPES[3]), "s")
    assert static.estimates is None


def test_the_hindsight_fit_is_a_product_of_a_request_level_and_a_confidence_level():
    rng = np.random.default_rng(0)
    keys = [(f"r{rng.integers(4)}", int(rng.integers(-1, 10))) for _ in range(400)]
    level = {f"r{i}": f for i, f in enumerate((0.5, 1.0, 1.5, 2.0))}
    bins = 0.2 + 0.1 * np.arange(-1, 10)  # [bins], bin -1 first
    per_candidate = np.array([0.4, 1.1, 2.0])  # [candidates]
    exact = 1.0 + np.array([level[r] * bins[b + 1] for r, b in keys])[:, None] * per_candidate
    assert hindsight_abs_error(exact, keys) == pytest.approx(0.0, abs=1e-6)
    # One request, one bin: each candidate's mean.
    draws = rng.integers(1, 5, size=(300, 3)).astype(float)
    one = [("r", 3)] * len(draws)
    assert hindsight_abs_error(draws, one) == pytest.approx(
        np.abs(draws - draws.mean(axis=0)).mean()
    )
    assert np.isnan(hindsight_abs_error(np.zeros((0, 0)), []))
