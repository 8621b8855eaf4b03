import json
import struct

import numpy as np
import pytest
from synthetic import GPU_PADDING, SyntheticSurface, sample_steps

from sglang_adatree.core.cost_model import AnalyticStepTime, mape
from sglang_adatree.core.features import FEATURE_NAMES, StepFeatures, feature_matrix, feature_rows
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, TreeShape
from sglang_adatree.core.xgb_cost import ARTIFACT_MAGIC, ArtifactError, XGBoostStepTime, fit_xgboost

SURFACE = SyntheticSurface()


@pytest.fixture(scope="module")
def training():
    rng = np.random.default_rng(0)
    features, shapes = sample_steps(2000, DEFAULT_CANDIDATES, rng)
    x = feature_rows(features, shapes)
    return x, SURFACE.step_ms(x, rng)


@pytest.fixture(scope="module")
def model(training):
    x, y = training
    return fit_xgboost(x, y, num_rounds=150, seed=0)


@pytest.fixture(scope="module")
def fresh():
    rng = np.random.default_rng(1)
    features, shapes = sample_steps(1000, DEFAULT_CANDIDATES, rng)
    x = feature_rows(features, shapes)
    return x, SURFACE.step_ms(x, rng)


def test_xgboost_fits_the_surface(training, model, fresh):
    fx, fy = fresh
    assert model.info.metrics.holdout_rows == 400 and model.info.training_rows == 1600
    assert model.info.metrics.mape < 0.05
    assert mape(model.predict_matrix(fx), fy) < 0.05


def test_xgboost_learns_padding_jumps_the_analytic_model_cannot():
    # Where the tile steps dominate (a costly tile), the best linear model, fitted on the same
    # rows, misses them and XGBoost does not.
    surface = SyntheticSurface(per_tile_ms=1.5)
    rng = np.random.default_rng(0)
    x = feature_rows(*sample_steps(2000, DEFAULT_CANDIDATES, rng))
    y = surface.step_ms(x, rng)
    fx = feature_rows(*sample_steps(1000, DEFAULT_CANDIDATES, rng))
    fy = surface.step_ms(fx, rng)
    trained = mape(fit_xgboost(x, y, num_rounds=150, seed=0).predict_matrix(fx), fy)
    analytic = mape(AnalyticStepTime.fit(x, y).predict_matrix(fx), fy)
    assert trained < 0.03 and analytic > 1.8 * trained


def test_xgboost_sees_a_padding_jump():
    # 8 requests x 8 verified tokens = 64 tokens fill one tile; 9 requests (padded to 10)
    # need two. The surface jumps by a tile's cost; so must the model's prediction.
    rng = np.random.default_rng(2)
    features, shapes = sample_steps(3000, [TreeShape(3, 4, 8)], rng, max_batch_size=16)
    x = feature_rows(features, shapes)
    small = fit_xgboost(x, SURFACE.step_ms(x, rng), num_rounds=150)
    before, after = small.predict_matrix(
        np.vstack(
            [
                feature_matrix(
                    StepFeatures.from_context_lens([500] * b, GPU_PADDING), [TreeShape(3, 4, 8)]
                )
                for b in (8, 9)
            ]
        )
    )
    assert after - before == pytest.approx(SURFACE.per_tile_ms, rel=0.3)


def test_artifact_round_trip(model, fresh):
    data = model.to_bytes()
    assert data.startswith(ARTIFACT_MAGIC)
    loaded = XGBoostStepTime.from_bytes(data)
    fx, _ = fresh
    np.testing.assert_array_equal(loaded.predict_matrix(fx), model.predict_matrix(fx))
    assert loaded.info == model.info
    assert loaded.info.feature_names == FEATURE_NAMES
    assert loaded.to_bytes() == data


def rewrite_metadata(data: bytes, change) -> bytes:
    head = len(ARTIFACT_MAGIC)
    (size,) = struct.unpack("<I", data[head : head + 4])
    meta = json.loads(data[head + 4 : head + 4 + size])
    change(meta)
    blob = json.dumps(meta).encode()
    return ARTIFACT_MAGIC + struct.pack("<I", len(blob)) + blob + data[head + 4 + size :]


def test_artifact_refuses_what_it_cannot_use(model):
    data = model.to_bytes()
    with pytest.raises(ArtifactError, match="bad magic"):
        XGBoostStepTime.from_bytes(b"not an artifact")
    renamed = rewrite_metadata(data, lambda m: m["feature_names"].reverse())
    with pytest.raises(ArtifactError, match="retrain"):
        XGBoostStepTime.from_bytes(renamed)
    future = rewrite_metadata(data, lambda m: m.update(format_version=99))
    with pytest.raises(ArtifactError, match="format 99"):
        XGBoostStepTime.from_bytes(future)


def test_fit_is_deterministic(training):
    x, y = training
    a = fit_xgboost(x[:500], y[:500], num_rounds=20, seed=3)
    b = fit_xgboost(x[:500], y[:500], num_rounds=20, seed=3)
    assert a.to_bytes() == b.to_bytes()
