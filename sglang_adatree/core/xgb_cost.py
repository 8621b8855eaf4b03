"""The trained step-time model: XGBoost over the feature vector, and its versioned artifact.

Decision trees capture what a linear model cannot: the steps that CUDA-graph padding and
matmul tiling put into step time. The model regresses ``log(ms)`` (errors are relative, the
policy compares ratios) with the core ``xgboost.train`` / ``Booster`` API.

An artifact is plain bytes so a database row can hold it::

    MAGIC (b"ADATREE-XGB\\n") | uint32 little-endian JSON length | JSON metadata | booster UBJSON

The JSON carries the artifact format version, the feature names in column order (loading
refuses a mismatch with ``features.FEATURE_NAMES``), the training rows, the hyper-parameters
and the validation metrics measured on a held-out split.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import xgboost as xgb

from sglang_adatree.core.cost_model import MIN_STEP_MS, mape
from sglang_adatree.core.features import FEATURE_NAMES, NUM_FEATURES

ARTIFACT_MAGIC = b"ADATREE-XGB\n"
ARTIFACT_FORMAT = 1

DEFAULT_PARAMS: Mapping[str, Any] = {
    "objective": "reg:squarederror",
    "max_depth": 6,
    "eta": 0.1,
    "subsample": 0.9,
    "min_child_weight": 2,
    # Fine bins so splits can sit on padding boundaries (multiples of 64 tokens, capture sizes).
    "max_bin": 1024,
    "tree_method": "hist",
}
DEFAULT_ROUNDS = 300


class ArtifactError(ValueError):
    """Bytes that are not a cost-model artifact this version can load."""


@dataclass(frozen=True)
class ValidationMetrics:
    """Accuracy on the held-out split; percentage errors are fractions (0.05 = 5%)."""

    holdout_rows: int
    mape: float
    p90_ape: float
    mae_ms: float


@dataclass(frozen=True)
class ArtifactInfo:
    """Everything about a trained model except the trees."""

    feature_names: tuple[str, ...]
    training_rows: int
    num_rounds: int
    params: Mapping[str, Any]
    metrics: ValidationMetrics
    format_version: int = ARTIFACT_FORMAT


class XGBoostStepTime:
    """A trained booster with its metadata; a ``StepTimeModel``."""

    def __init__(self, booster: xgb.Booster, info: ArtifactInfo, nthread: int = 1) -> None:
        self.booster = booster
        self.info = info
        # One thread by default: the model shares the host with the decode loop.
        self.booster.set_param({"nthread": nthread})

    def predict_matrix(self, x: np.ndarray) -> np.ndarray:
        """``[rows]`` step times in ms for feature rows ``x`` ``[rows, NUM_FEATURES]``."""
        assert x.ndim == 2 and x.shape[1] == NUM_FEATURES, f"bad feature matrix {x.shape}"
        log_ms = self.booster.inplace_predict(np.ascontiguousarray(x, dtype=np.float32))
        return np.maximum(np.exp(np.asarray(log_ms, dtype=np.float64)), MIN_STEP_MS)

    def to_bytes(self) -> bytes:
        meta = asdict(self.info)
        meta["feature_names"] = list(self.info.feature_names)
        meta["params"] = dict(self.info.params)
        blob = json.dumps(meta, sort_keys=True).encode()
        raw = bytes(self.booster.save_raw("ubj"))
        return ARTIFACT_MAGIC + struct.pack("<I", len(blob)) + blob + raw

    @classmethod
    def from_bytes(cls, data: bytes, nthread: int = 1) -> XGBoostStepTime:
        head = len(ARTIFACT_MAGIC)
        if data[:head] != ARTIFACT_MAGIC or len(data) < head + 4:
            raise ArtifactError("not an adatree XGBoost artifact (bad magic)")
        (size,) = struct.unpack("<I", data[head : head + 4])
        try:
            meta = json.loads(data[head + 4 : head + 4 + size])
        except ValueError as exc:
            raise ArtifactError(f"artifact metadata is not JSON: {exc}") from None
        if meta.get("format_version") != ARTIFACT_FORMAT:
            raise ArtifactError(
                f"artifact format {meta.get('format_version')!r}, this version reads "
                f"{ARTIFACT_FORMAT}"
            )
        names = tuple(meta["feature_names"])
        if names != FEATURE_NAMES:
            raise ArtifactError(
                f"artifact features {names} differ from this version's {FEATURE_NAMES}; retrain"
            )
        booster = xgb.Booster()
        booster.load_model(bytearray(data[head + 4 + size :]))
        info = ArtifactInfo(
            feature_names=names,
            training_rows=int(meta["training_rows"]),
            num_rounds=int(meta["num_rounds"]),
            params=dict(meta["params"]),
            metrics=ValidationMetrics(**meta["metrics"]),
        )
        return cls(booster, info, nthread=nthread)


def fit_xgboost(
    x: np.ndarray,
    measured_ms: np.ndarray,
    *,
    params: Mapping[str, Any] | None = None,
    num_rounds: int = DEFAULT_ROUNDS,
    holdout_fraction: float = 0.2,
    seed: int = 0,
    nthread: int = 1,
) -> XGBoostStepTime:
    """Fit on a random ``1 - holdout_fraction`` of the rows; measure on the rest.

    The returned model is the one trained without the held-out rows, so its metrics are
    honest. ``x`` is ``[rows, NUM_FEATURES]``, ``measured_ms`` ``[rows]``.
    """
    y = np.asarray(measured_ms, dtype=np.float64)
    assert x.ndim == 2 and x.shape[1] == NUM_FEATURES, f"bad feature matrix {x.shape}"
    assert y.shape == (x.shape[0],) and np.all(y > 0), "one positive step time per row"
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    order = np.random.default_rng(seed).permutation(x.shape[0])
    n_hold = max(1, round(holdout_fraction * x.shape[0]))
    hold, train = order[:n_hold], order[n_hold:]
    if train.size == 0:
        raise ValueError(f"{x.shape[0]} rows leave nothing to train on")
    merged = {**DEFAULT_PARAMS, **(params or {}), "seed": seed, "nthread": nthread}
    dtrain = xgb.DMatrix(x[train], label=np.log(y[train]), feature_names=list(FEATURE_NAMES))
    booster = xgb.train(merged, dtrain, num_boost_round=num_rounds)
    # Feature names served their purpose in training; inplace_predict on plain arrays is faster.
    booster.feature_names = None
    metrics = _validate(booster, x[hold], y[hold])
    info = ArtifactInfo(
        feature_names=FEATURE_NAMES,
        training_rows=int(train.size),
        num_rounds=num_rounds,
        params=merged,
        metrics=metrics,
    )
    return XGBoostStepTime(booster, info, nthread=nthread)


def _validate(booster: xgb.Booster, x: np.ndarray, y: np.ndarray) -> ValidationMetrics:
    predicted = np.exp(booster.inplace_predict(np.ascontiguousarray(x, dtype=np.float32)))
    ape = np.abs(predicted - y) / y
    return ValidationMetrics(
        holdout_rows=int(y.size),
        mape=mape(predicted, y),
        p90_ape=float(np.quantile(ape, 0.9)),
        mae_ms=float(np.mean(np.abs(predicted - y))),
    )
