"""Bucket sums: the one row format every overview tier produces, and how buckets become points.

A tier (raw steps, a SQL ``GROUP BY``, the in-process granules, the per-minute roll-ups) yields
rows of sums per ``(bucket start, shape)``. Sums are exact under merging, so rows from different
sources and finer buckets fold into coarser buckets without error; means come last:

* goodput = emitted tokens / summed step time (tokens per second), as ``step_rollups`` defines
  it, so a bucket's goodput is the batch's rate over the bucket, not a mean of rates;
* acceptance length, batch size and step time = their sums / number of steps;
* the bucket's shape = the shape chosen for the most steps in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import ColumnElement, Integer, cast, func

# Column order of a sums row as the SQL queries select it (after the bucket start and shape).
SUM_COLUMNS = (
    "num_steps",
    "sum_batch_size",
    "max_batch_size",
    "sum_step_ms",
    "sum_accept_len",
    "emitted_tokens",
)


def shape_label(steps: int, topk: int, num_draft_tokens: int) -> str:
    """``'S,K,N'``, the form ``TreeShape.parse`` reads (recorded rows are not re-validated)."""
    return f"{steps},{topk},{num_draft_tokens}"


def bucket_index(column: Any, width: float, dialect: str) -> ColumnElement[Any]:
    """``floor(column / width)`` as an integer on SQLite and PostgreSQL.

    SQLite's ``CAST(x AS INTEGER)`` truncates, which is the floor for the positive unix times
    used here, and needs no math extension; PostgreSQL's cast rounds, so it gets ``floor``.
    """
    if dialect == "sqlite":
        return cast(column / width, Integer)
    return func.floor(column / width)


@dataclass(frozen=True)
class BucketSums:
    """Sums per ``(bucket start, shape)``; every array has one entry per row."""

    start: np.ndarray  # [rows] float64, unix seconds of the bucket's start (a step's own time)
    shape: np.ndarray  # [rows, 3] int64 (steps, topk, num_draft_tokens)
    num_steps: np.ndarray  # [rows] float64
    sum_batch_size: np.ndarray  # [rows] float64
    max_batch_size: np.ndarray  # [rows] float64
    sum_step_ms: np.ndarray  # [rows] float64, measured
    sum_accept_len: np.ndarray  # [rows] float64, measured acceptance length
    emitted_tokens: np.ndarray  # [rows] float64

    def __post_init__(self) -> None:
        rows = self.start.shape[0]
        assert self.shape.shape == (rows, 3), f"shape must be [rows, 3], got {self.shape.shape}"
        for name in SUM_COLUMNS:
            assert getattr(self, name).shape == (rows,), f"{name} must be [{rows}]"

    def __len__(self) -> int:
        return int(self.start.shape[0])

    @classmethod
    def empty(cls) -> BucketSums:
        return cls.from_rows([], width=1.0)

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Any]], width: float | None) -> BucketSums:
        """Rows ``(bucket, steps, topk, num_draft_tokens, *SUM_COLUMNS)``; ``bucket`` is an
        index of ``width`` seconds, or a unix time when ``width`` is None (one step per row)."""
        # Plain tuples first: numpy probes a SQLAlchemy Row for array attributes, and each
        # probe raises inside SQLAlchemy (ten times slower than the query).
        table = np.array(list(map(tuple, rows)), dtype=np.float64)
        table = table.reshape(len(rows), 4 + len(SUM_COLUMNS))
        start = table[:, 0] if width is None else table[:, 0] * width
        sums = {name: table[:, 4 + i] for i, name in enumerate(SUM_COLUMNS)}
        return cls(start=start, shape=table[:, 1:4].astype(np.int64), **sums)

    def select(self, keep: np.ndarray) -> BucketSums:
        """The rows where the boolean ``keep`` ``[rows]`` is true."""
        return BucketSums(
            start=self.start[keep],
            shape=self.shape[keep],
            **{name: getattr(self, name)[keep] for name in SUM_COLUMNS},
        )


def concat(parts: Iterable[BucketSums]) -> BucketSums:
    parts = [p for p in parts if len(p)]
    if not parts:
        return BucketSums.empty()
    return BucketSums(
        start=np.concatenate([p.start for p in parts]),
        shape=np.concatenate([p.shape for p in parts]),
        **{name: np.concatenate([getattr(p, name) for p in parts]) for name in SUM_COLUMNS},
    )


def combine(sums: BucketSums) -> BucketSums:
    """Merge rows with the same bucket start and shape (sums add, the maximum is kept)."""
    if not len(sums):
        return sums
    keys = np.column_stack([sums.start, sums.shape.astype(np.float64)])  # [rows, 4]
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    n = unique.shape[0]
    out = {
        name: np.bincount(inverse, weights=getattr(sums, name), minlength=n)
        for name in SUM_COLUMNS
        if name != "max_batch_size"
    }
    max_bs = np.zeros(n)
    np.maximum.at(max_bs, inverse, sums.max_batch_size)
    return BucketSums(
        start=unique[:, 0], shape=unique[:, 1:].astype(np.int64), max_batch_size=max_bs, **out
    )


@dataclass(frozen=True)
class Points:
    """One point per bucket, in time order; the series the overview plots."""

    time: np.ndarray  # [points] unix seconds of the bucket start
    num_steps: np.ndarray  # [points]
    goodput: np.ndarray  # [points] emitted tokens per second of step time
    accept_len: np.ndarray  # [points] mean acceptance length
    batch_size: np.ndarray  # [points] mean batch size
    step_ms: np.ndarray  # [points] mean measured step time
    shape: tuple[str, ...]  # [points] the shape chosen for the most steps

    def __len__(self) -> int:
        return int(self.time.shape[0])


def fold(sums: BucketSums, width: float | None) -> Points:
    """Points of ``width``-second buckets aligned to multiples of ``width`` (None: one point
    per distinct start, for rows that already are the buckets)."""
    if not len(sums):
        e = np.zeros(0)
        return Points(e, e, e, e, e, e, ())
    key = sums.start if width is None else np.floor(sums.start / width) * width  # [rows]
    times, bucket = np.unique(key, return_inverse=True)
    bucket = bucket.reshape(-1)
    n = times.shape[0]

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(bucket, weights=values, minlength=n)  # [points]

    num = total(sums.num_steps)
    step_ms = total(sums.sum_step_ms)
    # Most chosen shape per bucket: steps per (bucket, shape), then the largest per bucket.
    pairs = np.column_stack([bucket, sums.shape])  # [rows, 4] int64
    unique_pairs, pair_of_row = np.unique(pairs, axis=0, return_inverse=True)
    pair_steps = np.bincount(pair_of_row.reshape(-1), weights=sums.num_steps)
    order = np.lexsort((-pair_steps, unique_pairs[:, 0]))  # by bucket, most steps first
    _, first = np.unique(unique_pairs[order, 0], return_index=True)
    winners = unique_pairs[order[first], 1:]  # [points, 3], bucket order
    return Points(
        time=times,
        num_steps=num,
        goodput=total(sums.emitted_tokens) / np.maximum(step_ms, 1e-9) * 1000.0,
        accept_len=total(sums.sum_accept_len) / num,
        batch_size=total(sums.sum_batch_size) / num,
        step_ms=step_ms / num,
        shape=tuple(shape_label(*map(int, w)) for w in winners),
    )


def shape_shares(sums: BucketSums) -> dict[str, float]:
    """Share of steps per shape over all rows, largest first."""
    total = float(sums.num_steps.sum())
    if total <= 0:
        return {}
    unique, inverse = np.unique(sums.shape, axis=0, return_inverse=True)
    steps = np.bincount(inverse.reshape(-1), weights=sums.num_steps)
    order = np.argsort(-steps, kind="stable")
    return {shape_label(*map(int, unique[i])): float(steps[i] / total) for i in order}
