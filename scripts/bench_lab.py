"""Time the policy lab: one scenario of about 10,000 decode steps per policy kind.

    .venv/bin/python scripts/bench_lab.py [--steps 10000] [--repeats 3]

Parametric traces and a hand-made GPU-like profile (what is timed is the simulator and the
policies, not the sources), at concurrency 1 and 16. Each line: the policy, its decode steps and
the median wall time of ``--repeats`` runs, single-threaded (the environment pins NumPy's and
torch's thread pools to one thread before they load).
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from sglang_adatree.config import AdaTreeConfig  # noqa: E402
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES  # noqa: E402
from sglang_adatree.core.step_profile import TableProfile  # noqa: E402
from sglang_adatree.lab.simulator import (  # noqa: E402
    Arrivals,
    SimConfig,
    controller_chooser_factory,
    oracle_chooser,
    simulate,
    static_chooser,
)
from sglang_adatree.lab.traces import parametric_traces  # noqa: E402

ANSWER = 256


def profile() -> TableProfile:
    shapes = DEFAULT_CANDIDATES
    batch, ctx = (1, 8, 64, 256), (256, 4096)
    ms = np.empty((len(shapes), len(batch), len(ctx)))
    for i, s in enumerate(shapes):
        for j, b in enumerate(batch):
            for k, c in enumerate(ctx):
                ms[i, j, k] = 8.0 + 0.02 * b * s.num_draft_tokens + 0.4 * s.steps + 2e-6 * b * c
    return TableProfile("bench", "analytic", "scripts/bench_lab.py", shapes, batch, ctx, ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="decode steps to aim for")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    hazards = {"chat": np.array([[0.8, 0.35, 0.2, 0.1]] * 8)}
    prof = profile()
    config = AdaTreeConfig(candidate_shapes=DEFAULT_CANDIDATES, record_steps=False)
    for concurrency in (1, 16):
        # About 2.5 tokens a request a step, answers of 3/4 ANSWER on average.
        requests = max(1, round(args.steps * 2.5 * concurrency / (0.75 * ANSWER)))
        traces = parametric_traces(
            "bench", "bench", DEFAULT_CANDIDATES, hazards, num_requests=min(requests, 256),
            answer_len=ANSWER,
        )  # fmt: skip
        sim = SimConfig(
            Arrivals("closed", concurrency=concurrency), requests, noise=0.03, drift=0.05
        )
        kinds = {
            "adatree": controller_chooser_factory(config, traces),
            "static:3,1,4": lambda m, c: static_chooser(DEFAULT_CANDIDATES[4]),
            "per-step-oracle": lambda m, c, t=traces: oracle_chooser(t, m, DEFAULT_CANDIDATES),
        }
        for name, make in kinds.items():
            times, steps = [], 0
            for _ in range(args.repeats):
                start = time.perf_counter()
                steps = simulate(traces, prof, sim, make, name).steps
                times.append(time.perf_counter() - start)
            print(
                f"c{concurrency:<3d} {name:16s} {steps:6d} steps  "
                f"{statistics.median(times):6.2f} s  ({statistics.median(times) / steps * 1e6:.0f}"
                f" us a step)",
                flush=True,
            )


if __name__ == "__main__":
    main()
