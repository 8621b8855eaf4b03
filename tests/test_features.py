import numpy as np
import pytest

from sglang_adatree.core.features import (
    COLUMN,
    FEATURE_NAMES,
    NO_GRAPHS,
    NUM_FEATURES,
    GraphPadding,
    StepFeatures,
    feature_matrix,
    feature_rows,
)
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape

PADDING = GraphPadding((1, 2, 4, 8, 10, 12, 16, 24, 32))


def row_dict(row: np.ndarray) -> dict[str, float]:
    return {name: float(row[i]) for i, name in enumerate(FEATURE_NAMES)}


def test_worked_example_from_the_docstring():
    f = StepFeatures.from_context_lens([100, 200, 700], GraphPadding((1, 2, 4, 8)))
    row = row_dict(feature_matrix(f, [TreeShape(3, 2, 6)])[0])
    assert row == {
        "batch_size": 3,
        "padded_batch_size": 4,
        "steps": 3,
        "topk": 2,
        "num_draft_tokens": 6,
        "speculative": 1,
        "verified_tokens": 18,
        "padded_verified_tokens": 24,
        "draft_tokens": 18,
        "sum_context_len": 1000,
        "max_context_len": 700,
        "attention_tokens": 6000,
    }


def test_no_speculation_row():
    f = StepFeatures.from_context_lens([100] * 9, PADDING)
    row = row_dict(feature_matrix(f, [NO_SPEC])[0])
    assert row["speculative"] == 0 and row["draft_tokens"] == 0 and row["steps"] == 0
    assert row["verified_tokens"] == 9
    assert row["padded_batch_size"] == 10  # 9 pads to the capture size 10
    assert row["padded_verified_tokens"] == 10


def test_without_graphs_a_batch_runs_unpadded():
    f = StepFeatures.from_context_lens([50] * 9)
    assert f.padded_batch_size == 9 and NO_GRAPHS.padded(300) == 300
    np.testing.assert_array_equal(NO_GRAPHS.padded_array(np.array([1.0, 7.0])), [1.0, 7.0])


@pytest.mark.parametrize(
    ("batch_size", "padded"),
    [(1, 1), (3, 4), (8, 8), (9, 10), (13, 16), (31, 32), (32, 32), (33, 33), (100, 100)],
)
def test_padded_batch_size(batch_size, padded):
    assert PADDING.padded(batch_size) == padded


def test_padding_is_the_smallest_capture_size_not_below():
    sizes = PADDING.capture_sizes
    batches = np.arange(1, 60)
    vectorised = PADDING.padded_array(batches)
    for b, v in zip(batches.tolist(), vectorised.tolist(), strict=True):
        bigger = [s for s in sizes if s >= b]
        assert PADDING.padded(b) == v == (min(bigger) if bigger else b)
        f = StepFeatures.from_context_lens([10] * b, PADDING)
        assert feature_matrix(f, [NO_SPEC])[0, COLUMN["padded_batch_size"]] == v


@pytest.mark.parametrize("sizes", [(2, 1), (0, 4), (4, 4)])
def test_capture_sizes_must_increase_from_one_up(sizes):
    with pytest.raises(ValueError, match="capture sizes"):
        GraphPadding(sizes)


def test_feature_rows_match_feature_matrix():
    rng = np.random.default_rng(0)
    feats = [
        StepFeatures.from_context_lens(rng.integers(1, 4000, size=int(b)), PADDING)
        for b in rng.integers(1, 40, size=20)
    ]
    shapes = [DEFAULT_CANDIDATES[i % len(DEFAULT_CANDIDATES)] for i in range(20)]
    rows = feature_rows(feats, shapes)
    assert rows.shape == (20, NUM_FEATURES)
    for i, (f, s) in enumerate(zip(feats, shapes, strict=True)):
        np.testing.assert_array_equal(rows[i], feature_matrix(f, [s])[0])


def test_feature_names_are_unique_and_cover_the_matrix():
    assert len(set(FEATURE_NAMES)) == NUM_FEATURES
    m = feature_matrix(StepFeatures(2, 2, 20, 10), DEFAULT_CANDIDATES)
    assert m.shape == (len(DEFAULT_CANDIDATES), NUM_FEATURES)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0, "padded_batch_size": 0, "sum_context_len": 0, "max_context_len": 0},
        {"batch_size": 2, "padded_batch_size": 2, "sum_context_len": 10, "max_context_len": 11},
        {"batch_size": 4, "padded_batch_size": 3, "sum_context_len": 10, "max_context_len": 5},
        {"batch_size": 2, "padded_batch_size": 2, "sum_context_len": -1, "max_context_len": 0},
    ],
)
def test_invalid_step_features(kwargs):
    with pytest.raises(ValueError):
        StepFeatures(**kwargs)


def test_feature_rows_length_mismatch():
    with pytest.raises(ValueError, match="2 feature rows but 1 shapes"):
        feature_rows([StepFeatures(1, 1, 1, 1)] * 2, [NO_SPEC])
