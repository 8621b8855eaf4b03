"""How well the policy predicted: step time and acceptance length, predicted against measured,
per policy version.

The predictions are the ones each step was decided with (the cost model's step time after the
online residual correction, and the acceptance estimator's expected acceptance length); steps
that carry none are skipped, and so are the steps no cost model learns
from (``telemetry.learning``: catch-up steps, steps without a measured time). Errors are relative:
``|predicted - measured| / measured``; a policy version's error is the mean over its steps
(MAPE), its bias ``mean(predicted / measured) - 1``. Beside them, how the machine priced
steps against the step-time model when they were decided (``cost_model.PriceSplit``: its speed,
and what speculation costs here against the model's view of it).

Like the shapes page, a long range is cut to its newest ``MAX_SCAN_ROWS`` steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from sglang_adatree.admin.queries.runs import TimeRange, newest_rows
from sglang_adatree.admin.queries.sums import bucket_index
from sglang_adatree.admin.queries.timeseries import MAX_POINTS, bucket_width
from sqlalchemy import Connection, func, select

from sglang_adatree.telemetry.learning import learnable
from sglang_adatree.telemetry.models import Step

MAX_SCAN_ROWS = 50_000
NO_VERSION = "fallback"  # label of steps decided without a trained policy version


def version_label(version: int | None) -> str:
    return NO_VERSION if version is None else f"v{version}"


@dataclass(frozen=True)
class VersionError:
    """Prediction error of one policy version over the steps it decided."""

    version: str
    num_steps: int
    step_time_mape: float
    step_time_bias: float
    accept_len_mae: float | None  # tokens per request; None when no acceptance was predicted


@dataclass(frozen=True)
class CostSample:
    """At most ``MAX_POINTS`` steps with predictions, evenly spread over the range."""

    time: np.ndarray  # [points] unix seconds
    version: tuple[str, ...]  # [points]
    predicted_ms: np.ndarray  # [points]
    measured_ms: np.ndarray  # [points]
    predicted_accept_len: np.ndarray  # [points], NaN where none was predicted
    measured_accept_len: np.ndarray  # [points]
    # How the machine priced steps against the step-time model (``cost_model.PriceSplit``,
    # log units), NaN where the step recorded none
    price_drift: np.ndarray  # [points]
    price_tilt: np.ndarray  # [points]
    price_offset: np.ndarray  # [points]


@dataclass(frozen=True)
class ErrorSeries:
    """Step-time MAPE per bucket for one version."""

    version: str
    time: np.ndarray  # [points] bucket start, unix seconds
    mape: np.ndarray  # [points]


@dataclass(frozen=True)
class CostReport:
    time_range: TimeRange
    truncated: bool
    bucket_s: float
    versions: tuple[VersionError, ...]
    sample: CostSample
    error_over_time: tuple[ErrorSeries, ...]

    def to_json(self) -> dict[str, Any]:
        s = self.sample
        return {
            "range": self.time_range.to_json(),
            "truncated": self.truncated,
            "bucket_s": self.bucket_s,
            "versions": [asdict(v) for v in self.versions],
            "sample": {
                "time": s.time.tolist(),
                "version": list(s.version),
                "predicted_ms": s.predicted_ms.tolist(),
                "measured_ms": s.measured_ms.tolist(),
                "predicted_accept_len": _nullable(s.predicted_accept_len),
                "measured_accept_len": s.measured_accept_len.tolist(),
                "price_drift": _nullable(s.price_drift),
                "price_tilt": _nullable(s.price_tilt),
                "price_offset": _nullable(s.price_offset),
            },
            "error_over_time": [
                {"version": e.version, "time": e.time.tolist(), "mape": e.mape.tolist()}
                for e in self.error_over_time
            ],
        }


def cost_report(
    conn: Connection, run_id: int, tr: TimeRange, max_rows: int = MAX_SCAN_ROWS
) -> CostReport:
    """Predicted against measured for ``run_id`` over ``tr`` (see the module docstring)."""
    window = newest_rows(conn, run_id, tr, max_rows)
    in_window = (
        Step.run_id == run_id,
        Step.wall_time >= window.start,
        Step.wall_time <= tr.end,
        Step.predicted_step_ms.is_not(None),
        learnable(),
    )
    ape = func.abs(Step.predicted_step_ms - Step.measured_step_ms) / Step.measured_step_ms
    per_version = conn.execute(
        select(
            Step.policy_version,
            func.count(),
            func.avg(ape),
            func.avg(Step.predicted_step_ms / Step.measured_step_ms),
            func.avg(func.abs(Step.predicted_accept_len - Step.measured_accept_len)),
        )
        .where(*in_window)
        .group_by(Step.policy_version)
        .order_by(Step.policy_version)
    ).all()
    versions = tuple(
        VersionError(
            version=version_label(v),
            num_steps=int(n),
            step_time_mape=float(mape),
            step_time_bias=float(ratio) - 1.0,
            accept_len_mae=None if mae is None else float(mae),
        )
        for v, n, mape, ratio, mae in per_version
    )
    width = bucket_width(tr.end - window.start, MAX_POINTS)
    bucket = bucket_index(Step.wall_time, width, conn.dialect.name)
    over_time = conn.execute(
        select(Step.policy_version, bucket, func.avg(ape))
        .where(*in_window)
        .group_by(Step.policy_version, bucket)
        .order_by(Step.policy_version, bucket)
    ).all()
    series: dict[str, tuple[list[float], list[float]]] = {}
    for v, b, mape in over_time:
        times, values = series.setdefault(version_label(v), ([], []))
        times.append(float(b) * width)
        values.append(float(mape))
    rows = sum(v.num_steps for v in versions)
    stride = max(1, -(-rows // MAX_POINTS))  # ceil: at most MAX_POINTS sampled steps
    sample = conn.execute(
        select(
            Step.wall_time,
            Step.policy_version,
            Step.predicted_step_ms,
            Step.measured_step_ms,
            Step.predicted_accept_len,
            Step.measured_accept_len,
            Step.price_drift,
            Step.price_tilt,
            Step.price_offset,
        )
        .where(*in_window, Step.step_index % stride == 0)
        .order_by(Step.wall_time)
    ).all()
    return CostReport(
        time_range=window,
        truncated=window.start > tr.start,
        bucket_s=width,
        versions=versions,
        sample=_sample(sample),
        error_over_time=tuple(
            ErrorSeries(name, np.asarray(t), np.asarray(m)) for name, (t, m) in series.items()
        ),
    )


def _sample(rows: list[Any]) -> CostSample:
    table = np.asarray(
        [
            [np.nan if v is None else v for i, v in enumerate(row) if i != 1]  # not the version
            for row in rows
        ],
        dtype=np.float64,
    ).reshape(len(rows), 8)
    return CostSample(
        time=table[:, 0],
        version=tuple(version_label(r[1]) for r in rows),
        predicted_ms=table[:, 1],
        measured_ms=table[:, 2],
        predicted_accept_len=table[:, 3],
        measured_accept_len=table[:, 4],
        price_drift=table[:, 5],
        price_tilt=table[:, 6],
        price_offset=table[:, 7],
    )


def _nullable(values: np.ndarray) -> list[float | None]:
    """``values`` as a JSON list, ``None`` where NaN."""
    return [None if np.isnan(v) else v for v in values.tolist()]
