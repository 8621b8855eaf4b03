"""Which shapes were chosen against batch size and acceptance length, and acceptance by tree
depth and by sibling rank.

* Usage: steps per (shape, batch-size bin) and per (shape, acceptance-length bin); the pages
  show each column as shares, so a column reads "at this batch size the policy ran ...".
* Acceptance by depth: for each shape and depth ``d``, accepted draft tokens at depth ``d`` per
  request that drafted that deep (the chance a request's accepted path reaches depth ``d``).
* Acceptance by rank: accepted draft tokens that were the ``r``-th ranked sibling, as a share
  of all accepted draft tokens.
* Runner-ups: for each shape that ran, the candidates priced next best on its steps
  (``telemetry.estimates``).

The database groups the steps (by shape, batch size and acceptance bin; by shape and the
per-depth and per-rank count texts), and a long range is cut to its newest ``MAX_SCAN_ROWS``
steps to bound that work; roll-up minutes in the range are added from ``step_rollups``, with
their mean batch size and acceptance length standing in for per-step values. Roll-up minutes
keep no runner-up: the runner-ups are the range's steps' only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sglang_adatree.admin.queries.runs import TimeRange, newest_rows
from sglang_adatree.admin.queries.sums import bucket_index, shape_label
from sqlalchemy import Connection, func, select

from sglang_adatree.telemetry.estimates import RunnerUp, estimates, shape_key
from sglang_adatree.telemetry.models import Step, StepRollup
from sglang_adatree.telemetry.records import decode_counts

MAX_SCAN_ROWS = 50_000
# Upper edges of the batch-size bins (powers of two): 1, 2, 3-4, 5-8, ...
BATCH_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ACCEPT_BIN = 0.25  # width of the acceptance-length bins


def batch_bin(batch_size: float) -> str:
    """The label of the power-of-two bin holding ``batch_size``."""
    low = 1
    for high in BATCH_BINS:
        if batch_size <= high:
            return str(high) if low == high else f"{low}-{high}"
        low = high + 1
    return f">{BATCH_BINS[-1]}"


def accept_bin(accept_len: float) -> str:
    low = math.floor(accept_len / ACCEPT_BIN) * ACCEPT_BIN
    return f"{low:.2f}-{low + ACCEPT_BIN:.2f}"


@dataclass(frozen=True)
class ShapeUsage:
    """Steps per shape and bin, and acceptance by depth and rank, over one range of a run."""

    time_range: TimeRange  # what was read (cut to the newest rows, see ``truncated``)
    truncated: bool
    num_steps: int
    shapes: tuple[str, ...]  # sorted by (steps, topk, num_draft_tokens)
    batch_bins: tuple[str, ...]
    by_batch: dict[str, dict[str, int]]  # shape -> batch bin -> steps
    accept_bins: tuple[str, ...]
    by_accept: dict[str, dict[str, int]]  # shape -> acceptance bin -> steps
    depth_rate: dict[str, list[float]]  # shape -> [P(accepted path reaches depth d), d = 1..]
    rank_share: list[float]  # [share of accepted draft tokens at sibling rank r, r = 1..]
    # (shape, runner-up) pairs: shapes in ``shapes`` order, each one's runner-ups most seen first
    runner_ups: tuple[RunnerUp, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "range": self.time_range.to_json(),
            "truncated": self.truncated,
            "num_steps": self.num_steps,
            "shapes": list(self.shapes),
            "batch_bins": list(self.batch_bins),
            "by_batch_size": self.by_batch,
            "accept_bins": list(self.accept_bins),
            "by_accept_len": self.by_accept,
            "acceptance_by_depth": self.depth_rate,
            "acceptance_by_rank": self.rank_share,
            "runner_ups": [r.to_json() for r in self.runner_ups],
        }


class _Tally:
    def __init__(self) -> None:
        self.num_steps = 0
        self.by_batch: dict[str, dict[str, int]] = {}
        self.by_accept: dict[str, dict[str, int]] = {}
        self.depth_accepted: dict[str, list[int]] = {}  # shape -> accepted tokens per depth
        self.depth_requests: dict[str, int] = {}  # shape -> requests that drafted
        self.rank_accepted: list[int] = []

    def add_usage(self, shape: str, n: int, batch: float, accept: float) -> None:
        """``n`` steps of ``shape`` at this (mean) batch size and acceptance length."""
        self.num_steps += n
        for cells, key in ((self.by_batch, batch_bin(batch)), (self.by_accept, accept_bin(accept))):
            cell = cells.setdefault(shape, {})
            cell[key] = cell.get(key, 0) + n

    def add_acceptance(self, shape: str, requests: int, depth: str, rank: str, times: int) -> None:
        """Per-depth and per-rank counts (text, as stored) seen ``times`` times; ``requests``
        is the summed batch size of those steps."""
        counts = decode_counts(depth)
        if counts:
            _add(self.depth_accepted.setdefault(shape, []), counts, times)
            self.depth_requests[shape] = self.depth_requests.get(shape, 0) + requests
        _add(self.rank_accepted, decode_counts(rank), times)


def _add(into: list[int], counts: tuple[int, ...], times: int) -> None:
    for i, c in enumerate(counts):
        if i < len(into):
            into[i] += c * times
        else:
            into.append(c * times)


def shape_usage(
    conn: Connection, run_id: int, tr: TimeRange, max_rows: int = MAX_SCAN_ROWS
) -> ShapeUsage:
    """Shape usage and acceptance of ``run_id`` over ``tr`` (see the module docstring)."""
    window = newest_rows(conn, run_id, tr, max_rows)
    tally = _Tally()
    in_window = (Step.run_id == run_id, Step.wall_time >= window.start, Step.wall_time <= tr.end)
    shape = (Step.steps, Step.topk, Step.num_draft_tokens)
    # The database groups; Python sees one row per distinct value, not one per step.
    accept = bucket_index(Step.measured_accept_len, ACCEPT_BIN, conn.dialect.name)
    usage = conn.execute(
        select(*shape, Step.batch_size, accept, func.count())
        .where(*in_window)
        .group_by(*shape, Step.batch_size, accept)
    )
    for s, k, n, bs, acc, count in usage:
        tally.add_usage(shape_label(s, k, n), count, bs, (acc + 0.5) * ACCEPT_BIN)
    paths = conn.execute(
        select(
            *shape,
            Step.accepted_by_depth,
            Step.accepted_by_rank,
            func.count(),
            func.sum(Step.batch_size),
        )
        .where(*in_window)
        .group_by(*shape, Step.accepted_by_depth, Step.accepted_by_rank)
    )
    for s, k, n, depth, rank, count, requests in paths:
        tally.add_acceptance(shape_label(s, k, n), requests, depth, rank, count)
    rollups = conn.execute(
        select(
            StepRollup.steps,
            StepRollup.topk,
            StepRollup.num_draft_tokens,
            StepRollup.num_steps,
            StepRollup.sum_batch_size,
            StepRollup.sum_measured_accept_len,
            StepRollup.accepted_by_depth,
            StepRollup.accepted_by_rank,
        ).where(
            StepRollup.run_id == run_id,
            StepRollup.minute > window.start - 60.0,
            StepRollup.minute <= tr.end,
        )
    )
    for s, k, n, num, sum_bs, sum_acc, depth, rank in rollups:
        if num > 0:
            label = shape_label(s, k, n)
            tally.add_usage(label, num, sum_bs / num, sum_acc / num)
            tally.add_acceptance(label, sum_bs, depth, rank, 1)
    pairs = estimates(conn, *in_window).runner_ups
    return _usage(window, window.start > tr.start, tally, pairs)


def _usage(
    window: TimeRange, truncated: bool, t: _Tally, pairs: tuple[RunnerUp, ...]
) -> ShapeUsage:
    shapes = tuple(sorted(t.by_batch, key=shape_key))
    batch_order = [batch_bin(b) for b in BATCH_BINS] + [f">{BATCH_BINS[-1]}"]
    used_batch = {b for cells in t.by_batch.values() for b in cells}
    used_accept = {b for cells in t.by_accept.values() for b in cells}
    depth_rate = {
        shape: [a / t.depth_requests[shape] for a in accepted]
        for shape, accepted in sorted(t.depth_accepted.items(), key=lambda kv: shape_key(kv[0]))
        if t.depth_requests.get(shape)
    }
    total_accepted = sum(t.rank_accepted)
    return ShapeUsage(
        time_range=window,
        truncated=truncated,
        num_steps=t.num_steps,
        shapes=shapes,
        batch_bins=tuple(b for b in batch_order if b in used_batch),
        by_batch=t.by_batch,
        accept_bins=tuple(sorted(used_accept, key=lambda b: float(b.split("-")[0]))),
        by_accept=t.by_accept,
        depth_rate=depth_rate,
        rank_share=[a / total_accepted for a in t.rank_accepted] if total_accepted else [],
        runner_ups=pairs,
    )
