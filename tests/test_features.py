import numpy as np
import pytest

from sglang_adatree.features import (
    COLUMN,
    DEFAULT_CUDA_GRAPH_BS,
    FEATURE_NAMES,
    NUM_FEATURES,
    StepFeatures,
    feature_matrix,
    feature_rows,
    padded_batch_size,
    spec_cuda_graph_batch_sizes,
)
from sglang_adatree.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape


def row_dict(row: np.ndarray) -> dict[str, float]:
    return {name: float(row[i]) for i, name in enumerate(FEATURE_NAMES)}


def test_worked_example_from_the_docstring():
    f = StepFeatures.from_context_lens([100, 200, 700])
    row = row_dict(feature_matrix(f, [TreeShape(3, 2, 6)])[0])
    assert row == {
        "batch_size": 3,
        "padded_batch_size": 3,
        "steps": 3,
        "topk": 2,
        "num_draft_tokens": 6,
        "speculative": 1,
        "verified_tokens": 18,
        "padded_verified_tokens": 18,
        "draft_tokens": 18,
        "sum_context_len": 1000,
        "max_context_len": 700,
        "prefill_tokens": 0,
        "attention_tokens": 6000,
    }


def test_no_speculation_row():
    f = StepFeatures(batch_size=9, sum_context_len=900, max_context_len=300, prefill_tokens=64)
    row = row_dict(feature_matrix(f, [NO_SPEC])[0])
    assert row["speculative"] == 0 and row["draft_tokens"] == 0 and row["steps"] == 0
    assert row["verified_tokens"] == 9
    assert row["padded_batch_size"] == 10  # 9 pads to the capture size 10
    assert row["padded_verified_tokens"] == 10
    assert row["prefill_tokens"] == 64


def test_capture_sizes_match_sglang_speculative_list():
    # generate_decode_cuda_graph_batch_sizes, speculative branch, max_bs 256 (H100 / H200).
    expected = (
        list(range(1, 9))
        + list(range(10, 33, 2))
        + list(range(40, 65, 4))
        + list(range(72, 257, 8))
    )
    assert list(DEFAULT_CUDA_GRAPH_BS) == expected
    assert spec_cuda_graph_batch_sizes(300)[-3:] == (272, 288, 300)


@pytest.mark.parametrize(
    ("batch_size", "padded"),
    [(1, 1), (8, 8), (9, 10), (31, 32), (33, 40), (63, 64), (65, 72), (256, 256), (257, 257)],
)
def test_padded_batch_size(batch_size, padded):
    assert padded_batch_size(batch_size) == padded


def test_padding_is_the_smallest_capture_size_not_below():
    for b in range(1, 300):
        p = padded_batch_size(b)
        bigger = [s for s in DEFAULT_CUDA_GRAPH_BS if s >= b]
        assert p == (min(bigger) if bigger else b)
        # The vectorised path agrees with the scalar one.
        f = StepFeatures(b, b * 10, 10)
        assert feature_matrix(f, [NO_SPEC])[0, COLUMN["padded_batch_size"]] == p


def test_feature_rows_match_feature_matrix():
    rng = np.random.default_rng(0)
    feats = [
        StepFeatures.from_context_lens(rng.integers(1, 4000, size=int(b)), int(p))
        for b, p in zip(rng.integers(1, 300, size=20), rng.integers(0, 2000, size=20), strict=True)
    ]
    shapes = [DEFAULT_CANDIDATES[i % len(DEFAULT_CANDIDATES)] for i in range(20)]
    rows = feature_rows(feats, shapes)
    assert rows.shape == (20, NUM_FEATURES)
    for i, (f, s) in enumerate(zip(feats, shapes, strict=True)):
        np.testing.assert_array_equal(rows[i], feature_matrix(f, [s])[0])


def test_feature_names_are_unique_and_cover_the_matrix():
    assert len(set(FEATURE_NAMES)) == NUM_FEATURES
    m = feature_matrix(StepFeatures(2, 20, 10), DEFAULT_CANDIDATES)
    assert m.shape == (len(DEFAULT_CANDIDATES), NUM_FEATURES)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0, "sum_context_len": 0, "max_context_len": 0},
        {"batch_size": 2, "sum_context_len": 10, "max_context_len": 11},
        {"batch_size": 2, "sum_context_len": 10, "max_context_len": 5, "prefill_tokens": -1},
    ],
)
def test_invalid_step_features(kwargs):
    with pytest.raises(ValueError):
        StepFeatures(**kwargs)


def test_feature_rows_length_mismatch():
    with pytest.raises(ValueError, match="2 feature rows but 1 shapes"):
        feature_rows([StepFeatures(1, 1, 1)] * 2, [NO_SPEC])
