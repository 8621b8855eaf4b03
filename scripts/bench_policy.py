"""Time Policy.decide with 16 candidate shapes and a fitted XGBoost cost model, and the step
controller's host work per decode step as a server runs it.

Fits XGBoost on a synthetic step-time surface (the suite's ``tests/synthetic.py``), tabulates it
over the default grid, checks the table against direct predictions, then runs a drifting batch
(its requests' ids passed, as the step controller passes them) through decide/observe and times
decide alone.

Then the step controller (``StepController.begin`` and ``finish``, no sinks) at concurrency 1,
one request at a time with growing context, under the served configurations: the default
candidates priced by the analytic model refitted online, priced by the bundled CPU profile (a
server with ``step_time_profile``), and pinned to no speculation. With ``--sweep-mb N`` each
call is preceded by a read of N MB, as a server's forward reads the target's weights between
two calls: the controller then runs with its code and data out of the caches, as it does in a
server, where it takes several times its warm time. The last line is exactly::

    policy decision: p50=<us> us p99=<us> us candidates=16

Usage: ``.venv/bin/python scripts/bench_policy.py [--steps 20000] [--rows 4000] [--sweep-mb 0]``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from sglang_adatree.config import AdaTreeConfig, load_config
from sglang_adatree.core.acceptance import AcceptanceEstimator, AcceptedPathStats
from sglang_adatree.core.controller import BatchView, ControlUpdate, StepController, StepOutcome
from sglang_adatree.core.cost_model import OnlineCostModel, mape
from sglang_adatree.core.cost_table import CostTable, table_error
from sglang_adatree.core.features import StepFeatures, feature_rows
from sglang_adatree.core.policy import Pin, Policy
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape
from sglang_adatree.core.step_profile import load_profile_step_time
from sglang_adatree.core.xgb_cost import fit_xgboost

# The suite's synthetic surface and samplers are this benchmark's data.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import GPU_PADDING, SyntheticSurface, sample_path_stats, sample_steps

EXTRA_SHAPES = (TreeShape(4, 1, 5), TreeShape(2, 4, 6), TreeShape(5, 2, 10), TreeShape(7, 4, 24))
LAB_CPU_PROFILE = Path(__file__).resolve().parents[1] / "sglang_adatree/lab/data/cpu-2core.json"
HAZARDS = np.tile(0.75 * 0.45 ** np.arange(16), (16, 1))  # [depth, rank]


def drifting_batches(n: int, rng: np.random.Generator) -> list[StepFeatures]:
    """Batch size and contexts wander like a serving run's (random walk, requests finish)."""
    out, b, mean = [], 32, 600.0
    for _ in range(n):
        b = int(np.clip(b + rng.integers(-2, 3), 1, 256))
        mean = float(np.clip(mean * np.exp(rng.normal(0, 0.02)), 64, 16384))
        total = int(b * mean)
        out.append(StepFeatures(b, GPU_PADDING.padded(b), total, min(total, int(mean * 2.5))))
    return out


def served_controllers() -> list[tuple[str, StepController]]:
    """The step controllers of a served run: refitted, priced by a profile, pinned to none."""
    config = load_config(env={})
    profile = load_profile_step_time(LAB_CPU_PROFILE, config.candidate_shapes)
    pinned = StepController(config, profile=profile)
    pinned.apply(ControlUpdate(pins=(Pin(NO_SPEC),)))
    return [
        ("analytic model refitted", StepController(config)),
        ("priced by the CPU profile", StepController(config, profile=profile)),
        ("pinned to no speculation", pinned),
    ]


def cache_sweep(megabytes: int) -> Callable[[], None]:
    """A read of ``megabytes`` MB (nothing for 0): what a forward does to the caches."""
    if megabytes <= 0:
        return lambda: None
    buffer = np.ones(megabytes * 2**20 // 8)  # [words]

    def sweep() -> None:
        buffer.sum()

    return sweep


def time_controller(
    controller: StepController,
    steps: int,
    rng: np.random.Generator,
    sweep: Callable[[], None],
) -> tuple[np.ndarray, np.ndarray]:
    """``[steps]`` microseconds of ``begin`` and of ``finish``, each after ``sweep``, the
    warm-up's steps left out."""
    begin_us, finish_us = np.empty(steps), np.empty(steps)
    context = 300
    for i in range(steps):
        sweep()
        start = time.perf_counter_ns()
        ticket = controller.begin(BatchView(("r0",), (context,)))
        begin_us[i] = (time.perf_counter_ns() - start) / 1000.0
        shape, paths, accepted = ticket.decision.shape, None, 0
        if shape.speculative:
            stats = sample_path_stats(shape, 1, HAZARDS, rng)
            paths = AcceptedPathStats(*(torch.from_numpy(a) for a in stats))
            accepted = int((stats[1] >= 0).sum())
        outcome = StepOutcome(60.0 + rng.normal(0.0, 3.0), (accepted,), time.time(), paths)
        sweep()
        start = time.perf_counter_ns()
        controller.finish(ticket, outcome)
        finish_us[i] = (time.perf_counter_ns() - start) / 1000.0
        context = 300 if context > 2000 else context + accepted + 1  # a new request
    skip = min(steps // 2, 100)
    return begin_us[skip:], finish_us[skip:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument(
        "--sweep-mb",
        type=int,
        default=0,
        help="MB read before each controller call, to evict the caches as a forward does "
        "(0: none, the controller's warm time)",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shapes = tuple(sorted(DEFAULT_CANDIDATES + EXTRA_SHAPES))
    config = AdaTreeConfig(candidate_shapes=shapes)
    surface = SyntheticSurface()

    features, picked = sample_steps(args.rows, shapes, rng)
    x = feature_rows(features, picked)
    t0 = time.perf_counter()
    model = fit_xgboost(x, surface.step_ms(x, rng))
    m = model.info.metrics
    print(
        f"xgboost fit: {args.rows} rows in {time.perf_counter() - t0:.1f} s, "
        f"held-out MAPE {m.mape:.2%}, p90 {m.p90_ape:.2%}"
    )

    t0 = time.perf_counter()
    table = CostTable.build(model, config.candidate_shapes, padding=GPU_PADDING)
    print(f"table: {table.values.size} predictions in {time.perf_counter() - t0:.1f} s")
    probe, _ = sample_steps(500, shapes, np.random.default_rng(1))
    mean_err, p99_err = table_error(model, table, probe)
    print(f"table vs direct prediction: mean {mean_err:.2%}, p99 {p99_err:.2%} relative error")
    x_probe = feature_rows([f for f in probe for _ in shapes], list(shapes) * len(probe))
    truth = surface.step_ms(x_probe)
    looked_up = np.concatenate([table.lookup(f) for f in probe])
    print(
        f"vs the noiseless surface: direct MAPE {mape(model.predict_matrix(x_probe), truth):.2%}, "
        f"table MAPE {mape(looked_up, truth):.2%}"
    )

    policy = Policy(
        config,
        OnlineCostModel(model, config.residual_decay, table),
        AcceptanceEstimator.from_config(config),
        policy_version=1,
    )
    batches = drifting_batches(args.steps, rng)
    times_ns = np.empty(len(batches), dtype=np.int64)
    observe_ns = np.empty(len(batches), dtype=np.int64)
    sources: dict[str, int] = {}
    for i, f in enumerate(batches):
        ids = [f"r{(i // 64 + j) % 4096}" for j in range(f.batch_size)]  # requests come and go
        start = time.perf_counter_ns()
        decision = policy.decide(f, ids)
        times_ns[i] = time.perf_counter_ns() - start
        sources[decision.source] = sources.get(decision.source, 0) + 1
        measured_ms = float(surface.step_ms(feature_rows([f], [decision.shape]), rng)[0])
        stats = None
        if decision.shape.speculative:
            paths = sample_path_stats(decision.shape, f.batch_size, HAZARDS, rng)
            stats = AcceptedPathStats(*(torch.from_numpy(a) for a in paths))
        start = time.perf_counter_ns()
        policy.observe(f, decision.shape, measured_ms, stats, ids)
        observe_ns[i] = time.perf_counter_ns() - start
    print("decision sources:", ", ".join(f"{k}={v}" for k, v in sorted(sources.items())))
    sweep = cache_sweep(args.sweep_mb)
    swept = f", after a {args.sweep_mb} MB read" if args.sweep_mb > 0 else ""
    for label, controller in served_controllers():
        begin_us, finish_us = time_controller(controller, args.steps, rng, sweep)
        print(
            f"step controller, {label}{swept}: begin p50={np.percentile(begin_us, 50):.1f} us, "
            f"finish p50={np.percentile(finish_us, 50):.1f} us, "
            f"both p99={np.percentile(begin_us + finish_us, 99):.1f} us"
        )
    o50, o99 = np.percentile(observe_ns / 1000.0, [50, 99])
    print(f"policy observe: p50={o50:.1f} us p99={o99:.1f} us")
    p50, p99 = np.percentile(times_ns / 1000.0, [50, 99])
    print(f"policy decision: p50={p50:.1f} us p99={p99:.1f} us candidates={len(shapes)}")


if __name__ == "__main__":
    main()
