import numpy as np
import pytest
from synthetic import GPU_PADDING, SyntheticSurface, sample_steps

from sglang_adatree.core.cost_model import AnalyticStepTime, OnlineCostModel
from sglang_adatree.core.cost_table import CostTable, TableGrid, table_error
from sglang_adatree.core.features import StepFeatures, feature_matrix, feature_rows
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES
from sglang_adatree.core.xgb_cost import fit_xgboost

GRID = TableGrid(
    max_batch_size=64,
    mean_context=(64.0, 1024.0, 8192.0),
    longest_ratio=(1.0, 4.0),
)


def test_grid_points_are_exact():
    model = fit_xgboost(
        *_synthetic(600, seed=0), num_rounds=30
    )  # any non-linear model: grid points must not be interpolated
    table = CostTable.build(model, DEFAULT_CANDIDATES, GRID, GPU_PADDING)
    for b, mean, ratio in [(1, 64, 1), (7, 1024, 4), (64, 8192, 1)]:
        total = b * mean
        f = StepFeatures(b, GPU_PADDING.padded(b), total, int(min(total, mean * ratio)))
        direct = model.predict_matrix(feature_matrix(f, DEFAULT_CANDIDATES))
        np.testing.assert_allclose(table.lookup(f), direct, rtol=1e-6)


def test_analytic_model_interpolates_exactly():
    # The analytic model is linear in context at a fixed batch size, so linear interpolation
    # between grid points reproduces it.
    model = AnalyticStepTime()
    table = CostTable.build(model, DEFAULT_CANDIDATES, GRID, GPU_PADDING)
    features, _ = sample_steps(200, DEFAULT_CANDIDATES, np.random.default_rng(1), max_batch_size=64)
    mean_err, p99_err = table_error(model, table, features)
    assert mean_err < 1e-9 and p99_err < 1e-9


def test_table_close_to_xgboost_and_to_the_truth():
    x, y = _synthetic(2000, seed=2)
    model = fit_xgboost(x, y, num_rounds=100)
    table = CostTable.build(model, DEFAULT_CANDIDATES, TableGrid(max_batch_size=64), GPU_PADDING)
    probe, _ = sample_steps(200, DEFAULT_CANDIDATES, np.random.default_rng(3), max_batch_size=64)
    mean_err, _ = table_error(model, table, probe)
    assert mean_err < 0.03
    n = len(DEFAULT_CANDIDATES)
    xp = feature_rows([f for f in probe for _ in range(n)], list(DEFAULT_CANDIDATES) * len(probe))
    truth = SyntheticSurface().step_ms(xp).reshape(len(probe), n)
    looked_up = np.stack([table.lookup(f) for f in probe])
    assert np.mean(np.abs(looked_up - truth) / truth) < 0.05


def test_online_model_uses_the_table_inside_its_grid_only():
    model = AnalyticStepTime()
    table = CostTable.build(model, DEFAULT_CANDIDATES, GRID)
    online = OnlineCostModel(model, residual_decay=0.1, table=table)
    inside, outside = StepFeatures(10, 10, 5000, 800), StepFeatures(100, 100, 50_000, 800)
    assert table.lookup(outside) is None
    for f in (inside, outside):
        direct = model.predict_matrix(feature_matrix(f, DEFAULT_CANDIDATES))
        np.testing.assert_allclose(online.predict_ms_many(f, DEFAULT_CANDIDATES), direct)
        assert online.predict_ms(f, DEFAULT_CANDIDATES[4]) == pytest.approx(direct[4])


def test_grid_validation():
    with pytest.raises(ValueError, match="increasing"):
        TableGrid(mean_context=(64.0,))
    with pytest.raises(ValueError, match="increasing"):
        TableGrid(longest_ratio=(1.0, 4.0, 2.0))


def _synthetic(n, seed):
    rng = np.random.default_rng(seed)
    features, shapes = sample_steps(n, DEFAULT_CANDIDATES, rng, max_batch_size=64)
    x = feature_rows(features, shapes)
    return x, SyntheticSurface().step_ms(x, rng)
