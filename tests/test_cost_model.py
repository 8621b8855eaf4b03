import math

import numpy as np
import pytest
from synthetic import sample_steps

from sglang_adatree.core.cost_model import (
    DRIFT_PRIOR,
    MIN_STEP_MS,
    PART_WALK,
    PRIOR_STEPS,
    PROFILE_ERROR,
    SPLIT_PRIOR,
    AnalyticStepTime,
    OnlineCostModel,
    PriceSplit,
    ResidualCorrection,
    mape,
)
from sglang_adatree.core.features import StepFeatures, feature_matrix, feature_rows
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape


def test_analytic_defaults_by_hand():
    m = AnalyticStepTime()
    f = StepFeatures(batch_size=4, padded_batch_size=4, sum_context_len=4000, max_context_len=1000)
    no_spec, tree = m.predict_matrix(feature_matrix(f, [NO_SPEC, TreeShape(3, 2, 6)]))
    assert no_spec == pytest.approx(4.0 + 0.01 * 4 + 0.02 * 4 + 2e-5 * 4000)
    assert tree == pytest.approx(
        4.0 + 0.01 * 4 + 0.02 * 24 + 2e-5 * 4000 + 0.3 + 0.4 * 3 + 0.002 * 4 * 3 * 2
    )


def test_one_batch_is_priced_as_its_feature_rows_are_whichever_shapes_were_priced_last():
    # ``predict_list`` keeps the last shape tuple's terms: another tuple must not reuse them.
    m = AnalyticStepTime(c_fixed=3.0, c_bs=0.02, c_compute=0.01, c_kv=5e-5, c_spec=0.5,
                         c_draft_pass=0.2, c_draft_token=0.004)  # fmt: skip
    chains = tuple(s for s in DEFAULT_CANDIDATES if s.topk == 1)
    for f in (StepFeatures(1, 1, 300, 300), StepFeatures(6, 8, 9000, 3000)):
        for shapes in (DEFAULT_CANDIDATES, chains, DEFAULT_CANDIDATES, (TreeShape(3, 2, 6),)):
            # Equal to the last bit: a decision and the step's observation price both ways.
            assert m.predict_list(f, shapes) == (
                m.predict_matrix(feature_matrix(f, shapes)).tolist()
            )
    np.testing.assert_allclose(
        m.predict_matrix(feature_matrix(StepFeatures(6, 8, 9000, 3000), DEFAULT_CANDIDATES)),
        m.design_matrix(feature_matrix(StepFeatures(6, 8, 9000, 3000), DEFAULT_CANDIDATES))
        @ np.array(list(m.to_dict().values())),
        rtol=1e-12,
    )


def test_analytic_fit_recovers_a_linear_surface():
    truth = AnalyticStepTime(
        c_fixed=3.0, c_bs=0.02, c_compute=0.01, c_kv=5e-5, c_spec=0.5, c_draft_pass=0.2,
        c_draft_token=0.004,
    )  # fmt: skip
    features, shapes = sample_steps(500, DEFAULT_CANDIDATES, np.random.default_rng(0))
    x = feature_rows(features, shapes)
    fitted = AnalyticStepTime.fit(x, truth.predict_matrix(x))
    for name, value in truth.to_dict().items():
        assert fitted.to_dict()[name] == pytest.approx(value, rel=1e-6), name


def test_analytic_fit_keeps_coefficients_non_negative():
    features, shapes = sample_steps(300, DEFAULT_CANDIDATES, np.random.default_rng(1))
    x = feature_rows(features, shapes)
    # Time falls with batch size here: least squares would want c_bs < 0.
    y = 20.0 - 0.05 * x[:, 0]
    fitted = AnalyticStepTime.fit(x, y)
    assert all(v >= 0 for v in fitted.to_dict().values())


def test_mape():
    assert mape(np.array([11.0, 9.0]), np.array([10.0, 10.0])) == pytest.approx(0.1)


def test_the_first_steps_set_the_drift_and_later_ones_a_shapes_own_part():
    shape, other = TreeShape(3, 1, 4), TreeShape(2, 1, 3)
    model = OnlineCostModel(AnalyticStepTime(), residual_decay=0.1)
    f = StepFeatures(8, 8, 8000, 1000)
    raw = model.predict_ms(f, shape)
    raw_other = model.predict_ms(f, other)
    # The default model's scale is unknown (a GPU's costs on a CPU): a first step twice its
    # price says the machine is slower, for every shape.
    model.observe(f, shape, 2 * raw)
    assert model.predict_ms(f, shape) == pytest.approx(2 * raw, rel=0.02)
    assert model.predict_ms(f, other) == pytest.approx(2 * raw_other, rel=0.02)
    for _ in range(20):
        model.observe(f, shape, 2 * raw)
    assert model.predict_ms(f, shape) == pytest.approx(2 * raw, rel=1e-3)
    # Another shape at the model's own price: it is that shape that is cheaper than the drift
    # says, not the machine that got faster, since the first shape keeps costing twice.
    for _ in range(60):
        model.observe(f, other, raw_other)
        model.observe(f, shape, 2 * raw)
    assert model.predict_ms(f, other) == pytest.approx(raw_other, rel=0.03)
    assert model.predict_ms(f, shape) == pytest.approx(2 * raw, rel=0.02)
    assert model.residual.measured(shape) == 81 and model.residual.measured(other) == 60


def test_an_exploring_step_corrects_the_shape_it_measures_not_the_drift():
    # Under a CPU's noise a rarely run shape can be priced 20% off by its few warm-up steps.
    # The running shape pins drift + its own part; a step of the rare shape then mostly
    # corrects the rare shape, and the running shape's prediction stays where it was.
    rng = np.random.default_rng(0)
    running, rare, f = TreeShape(1, 1, 2), TreeShape(2, 2, 4), StepFeatures(1, 1, 200, 200)
    model = OnlineCostModel(AnalyticStepTime(), residual_decay=0.05)
    truth = {running: 100.0, rare: 80.0}
    for _ in range(3):  # warm-up: the rare shape measured in three slow steps
        model.observe(f, running, truth[running] * math.exp(rng.normal(0, 0.15)))
        model.observe(f, rare, truth[rare] * 1.25)
    for _ in range(300):
        model.observe(f, running, truth[running] * math.exp(rng.normal(0, 0.15)))
    assert model.predict_ms(f, rare) > 1.1 * truth[rare]
    before = model.predict_ms(f, running)
    for _ in range(4):  # four exploring steps, a hundred running steps apart
        model.observe(f, rare, truth[rare])
        for _ in range(100):
            model.observe(f, running, truth[running] * math.exp(rng.normal(0, 0.15)))
    assert model.predict_ms(f, rare) == pytest.approx(truth[rare], rel=0.06)
    assert model.predict_ms(f, running) == pytest.approx(before, rel=0.1)


CHAIN, TREE = TreeShape(1, 1, 2), TreeShape(2, 2, 4)
AT_BATCH_1 = StepFeatures(1, 1, 200, 200)


def _settled(truth: dict[TreeShape, float], rounds: int = 200) -> OnlineCostModel:
    """A cost model that has seen the shapes of ``truth`` run in turn at those step times."""
    model = OnlineCostModel(AnalyticStepTime(), residual_decay=0.05)
    for _ in range(rounds):
        for shape, ms in truth.items():
            model.observe(AT_BATCH_1, shape, ms)
    return model


def test_a_cost_of_one_shape_stays_with_that_shape():
    chain, tree, f = CHAIN, TREE, AT_BATCH_1
    truth = {chain: 120.0, tree: 150.0}
    model = _settled(truth)
    # The tree alone gets dearer while both run in turn: the drift it causes is undone by the
    # chain's steps, and in the end the tree alone carries it.
    truth[tree] = 300.0
    for _ in range(300):
        for shape, ms in truth.items():
            model.observe(f, shape, ms)
    assert model.predict_ms(f, chain) == pytest.approx(120.0, rel=0.01)
    assert model.predict_ms(f, tree) == pytest.approx(300.0, rel=0.01)


def test_a_change_common_to_every_shape_reaches_the_ones_that_do_not_run():
    chain, tree, f = CHAIN, TREE, AT_BATCH_1
    model = _settled({chain: 120.0, tree: 150.0})
    assert model.predict_ms(f, tree) == pytest.approx(150.0, rel=0.01)
    # The machine gets 20% faster while only the chain runs (what this CPU did for 200 steps):
    # the chain learns it, and the tree's prediction follows most of the way (about 80% of the
    # change in log terms) instead of keeping its old 150 ms.
    for _ in range(200):
        model.observe(f, chain, 100.0)
    assert model.predict_ms(f, chain) == pytest.approx(100.0, rel=0.01)
    assert model.predict_ms(f, tree) < 150.0 * (100.0 / 120.0) ** 0.75


def test_predict_many_matches_predict_one_with_corrections():
    model = OnlineCostModel(AnalyticStepTime(), residual_decay=0.5)
    f = StepFeatures(3, 3, 300, 100)
    for i, shape in enumerate(DEFAULT_CANDIDATES):
        model.observe(f, shape, 5.0 + i)
    many = model.predict_ms_many(f, DEFAULT_CANDIDATES)
    one = [model.predict_ms(f, s) for s in DEFAULT_CANDIDATES]
    np.testing.assert_allclose(many, one)
    # Updates after the factors were cached still show up.
    model.observe(f, DEFAULT_CANDIDATES[3], 50.0)
    assert model.predict_ms_many(f, DEFAULT_CANDIDATES)[3] == pytest.approx(
        model.predict_ms(f, DEFAULT_CANDIDATES[3])
    )


def test_a_step_is_observed_against_its_own_batch_whichever_was_priced_last():
    # The decision's row is kept for the step's observation; a later batch must not stand in.
    shape = DEFAULT_CANDIDATES[2]
    a, b = StepFeatures(1, 1, 300, 300), StepFeatures(4, 4, 9000, 3000)
    kept, fresh = (OnlineCostModel(AnalyticStepTime(), residual_decay=0.5) for _ in range(2))
    kept.predict_ms_many(a, DEFAULT_CANDIDATES)
    kept.observe(a, shape, 40.0)
    kept.predict_ms_many(b, DEFAULT_CANDIDATES)
    kept.observe(a, shape, 40.0)
    assert kept.predict_ms(a, shape) == AnalyticStepTime().predict_matrix(
        feature_matrix(a, (shape,))
    )[0] * kept.residual.factor(shape, kept.lever(a, shape))
    fresh.observe(a, shape, 40.0)
    fresh.observe(a, shape, 40.0)
    assert kept.residual.factor(shape) == fresh.residual.factor(shape)
    assert kept.predict_ms_many(b, DEFAULT_CANDIDATES).tolist() == (
        fresh.predict_ms_many(b, DEFAULT_CANDIDATES).tolist()
    )


def test_a_shapes_lever_is_the_log_of_its_price_over_no_speculations():
    model, f = OnlineCostModel(AnalyticStepTime(), residual_decay=0.1), StepFeatures(4, 4, 800, 300)
    raw = dict(zip(DEFAULT_CANDIDATES, model.raw_ms_many(f, DEFAULT_CANDIDATES), strict=True))
    assert model.lever(f, NO_SPEC) == 0.0
    for shape in DEFAULT_CANDIDATES:
        assert model.lever(f, shape) == pytest.approx(math.log(raw[shape] / raw[NO_SPEC]))


def test_a_machine_that_splits_its_time_otherwise_reprices_no_speculation_unrun():
    # Trees cost more against plain decoding than the model says: each shape's time over the
    # model's is exp(tilt * lever). A chain runs and a large tree is explored now and then; no
    # speculation never runs. The drift the chain sets would price no speculation at the
    # chain's surcharge; the two levers tell the tilt from the drift, and no speculation's
    # price comes back to what it costs.
    rng = np.random.default_rng(2)
    tilt, f = 1.0, StepFeatures(1, 1, 200, 200)
    chain, tree = TreeShape(1, 1, 2), TreeShape(4, 4, 12)
    model = OnlineCostModel(AnalyticStepTime(), residual_decay=0.05)
    drift_only = ResidualCorrection(0.05)
    for t in range(400):
        shape = tree if t % 50 == 25 else chain
        raw, lever = model.raw_ms_many(f, (shape,))[0], model.lever(f, shape)
        ms = raw * math.exp(tilt * lever + 0.05 * rng.standard_normal())
        model.observe(f, shape, ms)
        drift_only.update(shape, ms, raw)
    assert model.lever(f, chain) > 0.1 and model.lever(f, tree) > 2.0 * model.lever(f, chain)
    plain = model.raw_ms_many(f, (NO_SPEC,))[0]
    assert model.predict_ms(f, NO_SPEC) == pytest.approx(plain, rel=0.05)
    assert model.split().tilt == pytest.approx(tilt, rel=0.15)
    assert drift_only.factor(NO_SPEC) > math.exp(0.8 * tilt * model.lever(f, chain))
    for shape in (chain, tree):
        truth = model.raw_ms_many(f, (shape,))[0] * math.exp(tilt * model.lever(f, shape))
        assert model.predict_ms(f, shape) == pytest.approx(truth, rel=0.05)


def test_the_split_reads_the_filters_state_as_it_stands():
    rng = np.random.default_rng(3)
    f, chain, tree = StepFeatures(1, 1, 200, 200), TreeShape(1, 1, 2), TreeShape(4, 4, 12)
    model = OnlineCostModel(AnalyticStepTime(), residual_decay=0.05)
    assert model.split() == PriceSplit(0.0, 0.0, 0.0)
    for t in range(300):
        shape = (NO_SPEC, chain, tree)[t % 3]
        raw, lever = model.raw_ms_many(f, (shape,))[0], model.lever(f, shape)
        # The machine is 2x the model's time; speculation 1.3x dearer, and 1.5x more per
        # unit of lever.
        spec = math.log(1.3) + math.log(1.5) * lever if shape.speculative else 0.0
        model.observe(f, shape, raw * math.exp(math.log(2.0) + spec + 0.03 * rng.normal()))
    split = model.split()
    assert split is model.split()  # one object until the next step
    assert math.exp(split.drift) == pytest.approx(2.0, rel=0.05)
    assert split.tilt == pytest.approx(math.log(1.5), abs=0.05)
    assert split.offset == pytest.approx(math.log(1.3), abs=0.05)
    model.observe(f, NO_SPEC, model.raw_ms_many(f, (NO_SPEC,))[0])
    assert model.split() is not split and model.split().drift < split.drift


def test_one_step_without_speculation_reprices_it_against_a_profile_worth_tens_of_steps():
    # Priced by a profile, on a CPU's noise: every speculative shape costs 60% more against
    # plain decoding than the profile says. The trees run; the drift they set prices plain
    # decoding 60% over its cost; its part, priced by the profile, is worth tens of steps. One
    # step of it, at its cost, sets the offset common to the speculative shapes instead.
    rng = np.random.default_rng(4)
    f, trees = StepFeatures(1, 1, 200, 200), (TreeShape(3, 4, 8), TreeShape(4, 4, 12))
    model = OnlineCostModel(AnalyticStepTime(), 0.05, profile_error=PROFILE_ERROR)
    plain = model.raw_ms_many(f, (NO_SPEC,))[0]

    def run(steps: int) -> None:
        for t in range(steps):
            shape = trees[t % 7 == 3]
            cost = 1.6 * model.raw_ms_many(f, (shape,))[0]
            model.observe(f, shape, cost * math.exp(0.17 * rng.standard_normal()))

    run(400)
    assert model.predict_ms(f, NO_SPEC) > 1.3 * plain
    model.observe(f, NO_SPEC, plain)
    run(100)
    assert model.predict_ms(f, NO_SPEC) == pytest.approx(plain, rel=0.1)
    assert model.split().offset > 0.2
    for tree in trees:
        cost = 1.6 * model.raw_ms_many(f, (tree,))[0]
        assert model.predict_ms(f, tree) == pytest.approx(cost, rel=0.1)


def test_predictions_never_reach_zero():
    model = OnlineCostModel(AnalyticStepTime(*([0.0] * 7)), residual_decay=0.1)
    assert model.predict_ms(StepFeatures(1, 1, 1, 1), NO_SPEC) == MIN_STEP_MS


def test_bad_residual_decay():
    with pytest.raises(ValueError, match="decay"):
        ResidualCorrection(0.0)
    with pytest.raises(ValueError, match="decay"):
        ResidualCorrection(1.5)
    for error in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="profile's error"):
            ResidualCorrection(0.1, profile_error=error)


@pytest.mark.parametrize("noise", [0.02, 0.17])
def test_the_filter_estimates_a_steps_noise_from_its_surprises(noise):
    # Steps of two shapes, each off the model by its own factor, the machine drifting slowly,
    # every step's log time off by ``noise``: the estimate lands within 20% of the truth on a
    # GPU's noise and on this CPU's alike.
    rng = np.random.default_rng(3)
    residual = ResidualCorrection(0.05)
    assert residual.step_noise is None
    shapes, off = (TreeShape(2, 2, 4), TreeShape(1, 1, 2)), (1.2, 0.9)
    for t in range(3000):
        i = 1 if t % 10 == 0 else 0
        drift = 0.1 * math.sin(t / 500.0)
        ms = 100.0 * off[i] * math.exp(drift + noise * rng.standard_normal())
        residual.update(shapes[i], ms, 100.0)
    assert residual.noise_var == pytest.approx(noise * noise, rel=0.2)
    assert residual.step_noise == pytest.approx(noise, rel=0.1)


def _kalman_reference(steps, decay, profile_error):
    """The filter's corrections after ``steps`` (shape, measured, predicted, lever), as the
    textbook matrix filter computes them: a reference for the list arithmetic the filter runs
    (the noise estimate and a profile's part widths taken from the filter under test)."""
    residual = ResidualCorrection(decay, profile_error)
    shapes = sorted({s for s, *_ in steps})
    n = 3 + len(shapes)
    x, p = np.zeros(n), np.zeros((n, n))
    p[0, 0], p[1, 1], p[2, 2] = DRIFT_PRIOR, SPLIT_PRIOR, SPLIT_PRIOR
    seen: list[TreeShape] = []
    for shape, measured, predicted, lever in steps:
        i = 3 + shapes.index(shape)
        if shape not in seen:
            seen.append(shape)
            p[i, i] = (
                1.0 / PRIOR_STEPS if profile_error is None else residual._profile_var(profile_error)
            )
        walk = np.full(n, PART_WALK)
        walk[0] = residual.drift_walk
        walk[[3 + shapes.index(s) for s in shapes if s not in seen]] = 0.0  # not yet a state
        p += np.diag(walk)
        h = np.zeros(n)
        h[:3] = 1.0, lever, 1.0 if shape.speculative else 0.0
        h[i] += 1.0
        k = p @ h / (h @ p @ h + 1.0)
        x = x + k * (math.log(measured / predicted) - h @ x)
        p = p - np.outer(k, h @ p)
        residual.update(shape, measured, predicted, lever)
    return residual, x, shapes, p


@pytest.mark.parametrize("profile_error", [None, 0.2])
def test_the_filter_is_the_matrix_kalman_filter(profile_error):
    # Random steps of four shapes, levers and all; few enough that a profile's parts are not
    # yet settled to the noise (that reshaping is the filter's own, tested above).
    rng = np.random.default_rng(7)
    shapes = (NO_SPEC, TreeShape(1, 1, 2), TreeShape(3, 2, 6), TreeShape(4, 4, 12))
    steps = []
    for _ in range(15):
        shape = shapes[rng.integers(len(shapes))]
        lever = float(rng.uniform(0.1, 0.8)) if shape.speculative else 0.0
        steps.append((shape, float(rng.uniform(20, 80)), float(rng.uniform(20, 80)), lever))
    residual, x, order, p = _kalman_reference(steps, 0.05, profile_error)
    assert residual.split().tilt == pytest.approx(x[1], rel=1e-9, abs=1e-12)
    assert residual.split().offset == pytest.approx(x[2], rel=1e-9, abs=1e-12)
    for j, shape in enumerate(order):
        lever = 0.3 if shape.speculative else 0.0
        spec = x[2] if shape.speculative else 0.0
        expected = math.exp(x[0] + lever * x[1] + spec + x[3 + j])
        assert residual.factor(shape, lever) == pytest.approx(expected, rel=1e-9)
    levers = np.array([0.3 if s.speculative else 0.0 for s in order])
    assert residual.factors(order, levers) == pytest.approx(
        [residual.factor(s, lv) for s, lv in zip(order, levers.tolist(), strict=True)], rel=1e-12
    )
    # How far each price may be off against a reference: the variance of the difference of the
    # two shapes' corrections, drift left out, in the noise's units.
    spec = [1.0 if s.speculative else 0.0 for s in order]
    for reference in (None, *order):
        sds = residual.relative_sd(order, levers.tolist(), reference)
        for j in range(len(order)):
            h = np.zeros(3 + len(order))
            h[1:3] = levers[j], spec[j]
            h[3 + j] += 1.0
            if reference is not None:
                r = order.index(reference)
                h[1:3] -= levers[r], spec[r]
                h[3 + r] -= 1.0
            expected = math.sqrt(residual.noise_var * max(h @ p @ h, 0.0))
            assert sds[j] == pytest.approx(expected, rel=1e-9, abs=1e-12)
        if reference is not None:
            assert sds[order.index(reference)] == 0.0


def test_a_shape_unrun_for_a_while_may_be_priced_further_off_than_one_run_beside_it():
    # The chain runs; the tree 2,2,4 runs beside it every tenth step; 3,4,8 ran once, long ago.
    # Against the chain, the tree's price is known to within its steps' noise, the deep tree's
    # has walked since. The machine's speed, common to all three, is not part of either.
    rng = np.random.default_rng(0)
    residual = ResidualCorrection(0.05)
    chain, tree, deep = TreeShape(1, 1, 2), TreeShape(2, 2, 4), TreeShape(3, 4, 8)
    shapes, levers = (chain, tree, deep), [0.1, 0.25, 0.5]
    residual.update(deep, 150.0, 140.0, levers[2])
    for t in range(600):
        i = 1 if t % 10 == 0 else 0
        ms = 100.0 * math.exp(0.15 * rng.standard_normal() + 0.3 * math.sin(t / 50.0))
        residual.update(shapes[i], ms, 100.0, levers[i])
    sd = residual.relative_sd(shapes, levers, chain)
    assert sd[0] == 0.0 < sd[1] < 0.1 < sd[2]
    # The answer is kept until the next update, and recomputed after it.
    assert residual.relative_sd(shapes, levers, chain) is sd
    residual.update(deep, 120.0, 100.0, levers[2])
    after = residual.relative_sd(shapes, levers, chain)
    assert after is not sd and after[2] < sd[2]


def test_replay_is_observing_in_order():
    f = StepFeatures(2, 2, 400, 300)
    shapes = [TreeShape(3, 1, 4), TreeShape(2, 1, 3), TreeShape(3, 1, 4)]
    times = np.array([30.0, 12.0, 40.0])
    replayed = OnlineCostModel(AnalyticStepTime(), residual_decay=0.2)
    replayed.replay(feature_rows([f] * 3, shapes), shapes, times)
    observed = OnlineCostModel(AnalyticStepTime(), residual_decay=0.2)
    for shape, ms in zip(shapes, times, strict=True):
        observed.observe(f, shape, float(ms))
    for shape in set(shapes):
        assert replayed.predict_ms(f, shape) == pytest.approx(observed.predict_ms(f, shape))
        assert replayed.residual.measured(shape) == observed.residual.measured(shape)
    with pytest.raises(ValueError, match="one shape and one time"):
        replayed.replay(feature_rows([f], shapes[:1]), shapes, times)
