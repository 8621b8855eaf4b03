"""Simulate a CPU deployment whose speed drifts; goodput of adatree's loop against static shapes.

The serving loop (``core.controller.StepController``, its policy, cost model, refits and
acceptance estimates, all as served) decides every step of a simulated run at concurrency 1:
requests of 64 tokens, step times from the per-shape medians this CPU measured for the bundled
pair (``STEP_MS``), acceptance drawn from fixed hazards (``HAZARDS``, about 1.5 emitted tokens a
step for the chain 1,1,2 and 1.9 for the tree 2,2,4, as measured on MT-bench), and a machine
speed that wanders (log speed an Ornstein-Uhlenbeck walk, ``--drift`` its stationary sigma)
under per-step noise (``--noise``). Each static shape runs through the same speed path, so the
best of them is the oracle static shape. Two cost models run side by side on the same seeds: the
one served (drift common to every shape) and the same without drift
(``cost_model.DRIFT_GAIN_RATIO = 0``). The report: tokens per second of step time, as a ratio to
the best static shape, median over seeds, and the share of steps on that shape.

Usage: ``.venv/bin/python scripts/bench_drift.py [--seeds 8] [--steps 3000] [--drift 0.2]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core import cost_model
from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.controller import BatchView, StepController, StepOutcome
from sglang_adatree.core.shapes import TreeShape

# The suite's path sampler draws the accepted paths.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import sample_path_stats

# Median step ms at batch 1 by shape, from the telemetry of `adatree bench --policies
# ar,static:2,2,4,adatree --prompts mtbench,gsm8k --loads c1` on this CPU
# (docs/notes/2026-12-02-cost-loop-drift-and-early-refit.md).
STEP_MS = {
    "0,1,1": 100.0, "1,1,2": 130.0, "2,1,3": 175.0, "2,2,4": 155.0, "3,1,4": 190.0,
    "3,2,6": 215.0, "3,4,8": 235.0, "4,2,8": 230.0, "4,4,12": 285.0, "5,1,6": 205.0,
    "5,4,8": 265.0, "6,4,16": 360.0,
}  # fmt: skip
# [depth, rank]: chance the rank-r child at depth d is accepted given its better siblings were
# not (the EAGLE head's depth-1 top-1 is about 0.55 on MT-bench, deeper steps a little better).
HAZARDS = np.array([[0.5 + 0.04 * d, 0.2, 0.1, 0.05] for d in range(8)])
REQUEST_TOKENS = 64
PROMPT_TOKENS = 120


def speed_path(steps: int, drift: float, rng: np.random.Generator) -> np.ndarray:
    """``[steps]`` machine slow-down factors: exp of an OU walk with stationary sigma ``drift``."""
    keep = 0.995
    x, out = 0.0, np.empty(steps)
    for t in range(steps):
        x = keep * x + drift * np.sqrt(1 - keep**2) * rng.normal()
        out[t] = np.exp(x)
    return out


def simulate(
    shape_of_step, steps: int, speed: np.ndarray, noise: float, seed: int
) -> tuple[float, dict[str, int]]:
    """Tokens per second of step time and steps per shape; ``shape_of_step(context) ->
    (shape, done(ms, num_children, accepted_rank))``."""
    rng = np.random.default_rng(seed)
    emitted_total, ms_total, produced = 0, 0.0, 0
    shares: dict[str, int] = {}
    for t in range(steps):
        shape, done = shape_of_step(PROMPT_TOKENS + produced)
        ms = STEP_MS[str(shape)] * speed[t] * float(np.exp(rng.normal(0.0, noise)))
        if shape.speculative:
            children, ranks = sample_path_stats(shape, 1, HAZARDS, rng)
            emitted = 1 + int((ranks >= 0).sum())
        else:
            children = ranks = None
            emitted = 1
        done(ms, children, ranks, emitted - 1)
        emitted_total += emitted
        ms_total += ms
        shares[str(shape)] = shares.get(str(shape), 0) + 1
        produced += emitted
        if produced >= REQUEST_TOKENS:
            produced = 0
    return emitted_total / (ms_total / 1000.0), shares


def static(shape: TreeShape):
    def step(context: int):
        return shape, lambda *_: None

    return step


def adaptive(config: AdaTreeConfig):
    controller = StepController(config)

    def step(context: int):
        ticket = controller.begin(BatchView(("request",), (context,)))

        def done(ms, children, ranks, accepted):
            paths = None
            if children is not None:
                paths = AcceptedPathStats(torch.from_numpy(children), torch.from_numpy(ranks))
            controller.finish(ticket, StepOutcome(ms, (accepted,), 0.0, paths))
            # The control poller's refit, on the step it would come at the earliest.
            update = controller.refit()
            if update is not None:
                controller.apply(update)

        return ticket.decision.shape, done

    return step, controller


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--drift", type=float, default=0.2, help="stationary sigma of log speed")
    parser.add_argument("--noise", type=float, default=0.1, help="per-step sigma of log time")
    args = parser.parse_args()
    shapes = [TreeShape.parse(s) for s in STEP_MS]
    config = AdaTreeConfig().replace(candidate_shapes=";".join(STEP_MS), record_steps=False)
    served_gain = cost_model.DRIFT_GAIN_RATIO
    ratios: dict[str, list[float]] = {"with drift": [], "without drift": []}
    on_best: dict[str, list[float]] = {"with drift": [], "without drift": []}
    best_names = []
    for seed in range(args.seeds):
        speed = speed_path(args.steps, args.drift, np.random.default_rng(1000 + seed))
        static_tps = {
            str(s): simulate(static(s), args.steps, speed, args.noise, seed)[0] for s in shapes
        }
        best = max(static_tps, key=static_tps.__getitem__)
        best_names.append(best)
        for name, gain in (("with drift", served_gain), ("without drift", 0.0)):
            cost_model.DRIFT_GAIN_RATIO = gain
            try:
                step, _ = adaptive(config)
                tps, shares = simulate(step, args.steps, speed, args.noise, seed)
            finally:
                cost_model.DRIFT_GAIN_RATIO = served_gain
            ratios[name].append(tps / static_tps[best])
            on_best[name].append(shares.get(best, 0) / args.steps)
            print(
                f"seed {seed}: best static {best} {static_tps[best]:.2f} tok/s; {name}: "
                f"{tps:.2f} tok/s ({tps / static_tps[best]:.3f}x), "
                f"{shares.get(best, 0) / args.steps:.0%} of steps on {best}",
                flush=True,
            )
    print(
        f"\n{args.seeds} seeds x {args.steps} steps, drift sigma {args.drift}, "
        f"noise sigma {args.noise}; best static shapes: {sorted(set(best_names))}"
    )
    for name in ratios:
        print(
            f"{name:14s} adatree / best static: median {statistics.median(ratios[name]):.3f} "
            f"(min {min(ratios[name]):.3f}, max {max(ratios[name]):.3f}); steps on the best "
            f"static shape: median {statistics.median(on_best[name]):.0%}"
        )


if __name__ == "__main__":
    main()
