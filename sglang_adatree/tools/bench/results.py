"""From timed requests to benchmark rows, and from rows to the comparisons the issue asks for.

A row is one (policy, workload, load) point. Its fields, in the project's vocabulary:

* ``goodput_tok_s``: output tokens of the point / wall time from its first request to its last
  response (the median over rounds when the point was repeated);
* ``ttft_ms_*``, ``tpot_ms_*``, ``latency_ms_p50``: per-request percentiles over all rounds;
* ``accept_len_mean``: acceptance length as SGLang reports it, output tokens / verify steps over
  all requests (1.0 without speculation); ``accept_len_steps`` the same from the telemetry
  steps (adatree-served policies only);
* ``speedup_vs_ar``: goodput over ``ar``'s goodput at the same point;
* ``shapes``: steps per shape the policy ran (telemetry), or the one static shape.

Comparisons (``compare``): the oracle static shape of a point is the best static row there;
the best single static shape is the static configuration with the highest geometric-mean
goodput over all points.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sglang_adatree.tools.bench.client import PointResult
from sglang_adatree.tools.bench.steps import StepSummary

ROW_FIELDS = (
    "policy",
    "workload",
    "load",
    "num_requests",
    "output_tokens",
    "goodput_tok_s",
    "ttft_ms_p50",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "accept_len_mean",
    "speedup_vs_ar",
    "errors",
)


@dataclass(frozen=True)
class BenchRow:
    """One (policy, workload, load) point; see the module docstring for the fields."""

    policy: str
    label: str
    workload: str
    load: str
    num_requests: int
    output_tokens: int
    goodput_tok_s: float
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None
    tpot_ms_p99: float | None
    latency_ms_p50: float | None
    accept_len_mean: float
    accept_len_steps: float | None
    speedup_vs_ar: float | None
    errors: int
    duration_s: float
    machine_load_1m: float  # the host's 1-minute load average while the point ran
    rounds: int
    goodput_tok_s_rounds: tuple[float, ...]
    shapes: dict[str, int]  # shape -> decode steps (static: its shape, steps unknown = 0)
    decision_sources: dict[str, int]
    num_steps: int
    batch_size_mean: float | None
    accept_len_by_phase: dict[str, float] = field(default_factory=dict)
    # Measured per shape from the telemetry (steps, step_ms_p50, accept_len, tok_s), and the
    # best of them: the physical bound of the point (steps.StepSummary.bound).
    shape_goodput: dict[str, dict[str, float]] = field(default_factory=dict)
    bound_shape: str | None = None
    bound_tok_s: float | None = None
    step_tok_s: float | None = None  # what the policy's own choices delivered, same measure

    @property
    def point(self) -> tuple[str, str]:
        return (self.workload, self.load)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["goodput_tok_s_rounds"] = list(self.goodput_tok_s_rounds)
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def accept_length(tokens: int, verify_steps: int) -> float:
    """SGLang's acceptance length: output tokens / verify steps; 1.0 without verify steps."""
    return tokens / verify_steps if verify_steps > 0 else 1.0


def make_row(
    policy: str,
    label: str,
    workload: str,
    load: str,
    points: Sequence[PointResult],
    steps: StepSummary,
    static_shape: str | None = None,
    machine_load_1m: float = float("nan"),
) -> BenchRow:
    """The row of one point from its rounds' requests and telemetry steps."""
    assert points, "a row needs at least one round"
    requests = [r for p in points for r in p.requests]
    ok = [r for r in requests if r.error is None]
    goodputs = []
    for p in points:
        tokens = sum(r.output_tokens for r in p.requests if r.error is None)
        goodputs.append(tokens / max(p.finished_at - p.started_at, 1e-9))
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [t for t in (r.tpot_ms for r in ok) if t is not None]
    by_phase: dict[str, list[int]] = {}
    for r in ok:
        if r.phase:
            totals = by_phase.setdefault(r.phase, [0, 0])
            totals[0] += r.output_tokens
            totals[1] += r.spec_verify_ct
    shapes = steps.shape_counts if steps.num_steps else ({static_shape: 0} if static_shape else {})
    return BenchRow(
        policy=policy,
        label=label,
        workload=workload,
        load=load,
        num_requests=len(requests) // len(points),
        output_tokens=sum(r.output_tokens for r in ok) // len(points),
        goodput_tok_s=statistics.median(goodputs),
        ttft_ms_p50=percentile(ttft, 50),
        ttft_ms_p99=percentile(ttft, 99),
        tpot_ms_p50=percentile(tpot, 50),
        tpot_ms_p99=percentile(tpot, 99),
        latency_ms_p50=percentile([r.latency_ms for r in ok], 50),
        accept_len_mean=accept_length(
            sum(r.output_tokens for r in ok), sum(r.spec_verify_ct for r in ok)
        ),
        accept_len_steps=steps.accept_len,
        speedup_vs_ar=None,
        errors=len(requests) - len(ok),
        duration_s=statistics.median(p.finished_at - p.started_at for p in points),
        machine_load_1m=machine_load_1m,
        rounds=len(points),
        goodput_tok_s_rounds=tuple(goodputs),
        shapes=dict(shapes),
        decision_sources=dict(steps.source_counts),
        num_steps=steps.num_steps,
        batch_size_mean=steps.batch_size_mean,
        accept_len_by_phase={k: accept_length(t, v) for k, (t, v) in by_phase.items()},
        shape_goodput={
            g.shape: {
                "steps": g.num_steps,
                "step_ms_p50": g.step_ms_p50,
                "accept_len": g.accept_len,
                "tok_s": g.tok_s,
            }
            for g in steps.by_shape
        },
        bound_shape=steps.bound.shape if steps.bound else None,
        bound_tok_s=steps.bound.tok_s if steps.bound else None,
        step_tok_s=steps.step_tok_s,
    )


def with_speedups(rows: Iterable[BenchRow]) -> list[BenchRow]:
    """``speedup_vs_ar`` filled in wherever ``ar`` ran the same point."""
    rows = list(rows)
    ar = {r.point: r.goodput_tok_s for r in rows if r.policy == "ar"}
    out = []
    for r in rows:
        base = ar.get(r.point)
        speedup = r.goodput_tok_s / base if base else None
        out.append(replace(r, speedup_vs_ar=speedup))
    return out


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    if not values or any(v <= 0 for v in values):
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass(frozen=True)
class Goal:
    """One claim of the issue, whether this run met it, and the figures behind the verdict."""

    text: str
    met: bool | None  # None: the run lacks the rows to decide
    detail: str


@dataclass(frozen=True)
class Comparison:
    """Per point: oracle static and adaptive policies' ratios; overall: the goals."""

    points: tuple[tuple[str, str], ...]
    oracle: dict[tuple[str, str], tuple[str, float]]  # point -> (static policy, goodput)
    best_single_static: str | None
    ratios: dict[str, dict[tuple[str, str], dict[str, float]]]  # policy -> point -> name -> x
    goals: tuple[Goal, ...]


def compare(rows: Sequence[BenchRow], subject: str = "adatree") -> Comparison:
    """The issue's comparisons of ``subject`` (and every other policy) against the baselines."""
    points = tuple(sorted({r.point for r in rows}))
    table = {(r.policy, r.point): r.goodput_tok_s for r in rows}
    policies = list(dict.fromkeys(r.policy for r in rows))
    statics = [p for p in policies if p.startswith("static:")]
    oracle: dict[tuple[str, str], tuple[str, float]] = {}
    for point in points:
        here = [(table[(p, point)], p) for p in statics if (p, point) in table]
        if here:
            goodput, name = max(here)
            oracle[point] = (name, goodput)
    complete = [p for p in statics if all((p, pt) in table for pt in points)]
    best_single = max(
        complete, key=lambda p: geomean(table[(p, pt)] for pt in points), default=None
    )
    ratios: dict[str, dict[tuple[str, str], dict[str, float]]] = {}
    for policy in policies:
        per_point: dict[tuple[str, str], dict[str, float]] = {}
        for point in points:
            mine = table.get((policy, point))
            if mine is None:
                continue
            refs = {"oracle": oracle[point][1] if point in oracle else None}
            refs["best_single_static"] = table.get((best_single, point)) if best_single else None
            for other in ("ar", "sglang-adaptive", "turbospec"):
                refs[other] = table.get((other, point))
            per_point[point] = {k: mine / v for k, v in refs.items() if v}
        ratios[policy] = per_point
    goals = _goals(subject, points, ratios, best_single)
    return Comparison(points, oracle, best_single, ratios, goals)


def _goals(
    subject: str,
    points: Sequence[tuple[str, str]],
    ratios: dict[str, dict[tuple[str, str], dict[str, float]]],
    best_single: str | None,
) -> tuple[Goal, ...]:
    mine = ratios.get(subject, {})

    def per_point(ref: str) -> list[float] | None:
        values = [mine[pt][ref] for pt in points if pt in mine and ref in mine[pt]]
        return values if values and len(values) == len(points) else None

    goals = []
    oracle = per_point("oracle")
    goals.append(
        Goal(
            f"{subject} >= 0.95x the oracle static shape at every point",
            None if oracle is None else min(oracle) >= 0.95,
            "no static rows" if oracle is None else f"worst point {min(oracle):.3f}x",
        )
    )
    single = per_point("best_single_static")
    gm = geomean(single) if single else float("nan")
    goals.append(
        Goal(
            f"{subject} >= 1.10x the best single static shape (geometric mean)",
            None if single is None else gm >= 1.10,
            "no static rows" if single is None else f"{gm:.3f}x vs {best_single}",
        )
    )
    ar = per_point("ar")
    goals.append(
        Goal(
            f"{subject} >= 1.0x ar at every point",
            None if ar is None else min(ar) >= 1.0,
            "no ar rows" if ar is None else f"worst point {min(ar):.3f}x",
        )
    )
    for other in ("sglang-adaptive", "turbospec"):
        values = per_point(other)
        gm = geomean(values) if values else float("nan")
        goals.append(
            Goal(
                f"{subject} ahead of {other} (geometric mean)",
                None if values is None else gm > 1.0,
                f"no {other} rows" if values is None else f"{gm:.3f}x",
            )
        )
    return tuple(goals)
