"""Named scenarios over the four serving conditions the AdaTree thesis names: load, request
characteristics, models and GPUs.

A scenario names its trace source (which pair, which prompts, exact or parametric), its
step-time profile (this CPU measured, a GPU analytic or measured, a deployment's telemetry) and
its load. Trace sources:

* ``eagle-smollm2:SET`` / ``draft-smollm2:SET``: exact traces of the bundled target with the
  bundled EAGLE head / standalone draft on a prompt set (``mtbench``, ``gsm8k``, ``humaneval``,
  ``transition``, or a JSONL file), built once by ``lab.tracegen`` and cached;
* ``eagle2-llama8b:SET`` / ``eagle3-llama8b:SET``: parametric traces of a Llama-3.1-8B target
  with an EAGLE-2 / EAGLE-3 head, from acceptance hazards set to the published acceptance
  lengths (``PARAMETRIC_PAIRS``); ``SET`` picks the request classes (``chat``, ``code``,
  ``transition``).

Profiles: ``cpu-2core`` (measured on this project's 2-core development CPU with the bundled
pair, ``lab/data/``), ``h100-sxm`` / ``h200-sxm`` / ``a100-sxm-80gb`` / ``l4`` (``lab.hardware``:
analytic unless a measured GPU profile is in ``lab/data/``), ``db:URL`` (``lab.measured``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, TreeShape
from sglang_adatree.lab.simulator import Arrivals, SimConfig

DATA_DIR = Path(__file__).resolve().parent / "data"


def _hazards(top: float, ranks: tuple[float, ...], decay: float, depth: int = 16) -> np.ndarray:
    """``[depth, len(ranks) + 1]``: the top-ranked child's hazard ``top`` at depth 1, falling by
    ``decay`` per depth, and later siblings' hazards ``ranks`` (relative to the top one)."""
    rows = []
    for d in range(depth):
        h0 = max(0.05, top - decay * d)
        rows.append([h0, *(h0 * r for r in ranks)])
    return np.asarray(rows)


@dataclass(frozen=True)
class ParametricPair:
    """A draft / target pair known from published figures, as acceptance hazards per class."""

    name: str
    description: str
    classes: dict[str, np.ndarray] = field(repr=False)


# Hazards set so that the trees adatree chooses from reach the published acceptance lengths:
# EAGLE-3 with Llama-3.1-8B about 6 tokens a step on MT-bench in SGLang (a chain of 6 reaches
# about 4.8 here, the largest trees about 5.5), EAGLE-2 about 4 (a chain of 6 about 3.4);
# code and reasoning prompts accept more than open chat, creative text less.
PARAMETRIC_PAIRS: dict[str, ParametricPair] = {
    "eagle3-llama8b": ParametricPair(
        "eagle3-llama8b",
        "Llama-3.1-8B with an EAGLE-3 head (parametric, from published acceptance lengths)",
        {
            "chat": _hazards(0.86, (0.45, 0.3, 0.2), 0.01),
            "code": _hazards(0.92, (0.5, 0.3, 0.2), 0.005),
            "creative": _hazards(0.7, (0.4, 0.25, 0.15), 0.02),
        },
    ),
    "eagle2-llama8b": ParametricPair(
        "eagle2-llama8b",
        "Llama-3.1-8B with an EAGLE-2 head (parametric, from published acceptance lengths)",
        {
            "chat": _hazards(0.78, (0.4, 0.25, 0.15), 0.015),
            "code": _hazards(0.85, (0.45, 0.3, 0.2), 0.01),
            "creative": _hazards(0.6, (0.35, 0.2, 0.1), 0.02),
        },
    ),
}
# Request classes of each parametric prompt set; ``transition`` alternates phases.
PARAMETRIC_SETS: dict[str, tuple[str, ...]] = {
    "chat": ("chat",),
    "code": ("code",),
    "mixed": ("chat", "code", "creative"),
    "transition": ("code", "creative"),
}
TRANSITION_PHASE = 8  # requests per phase of a transition workload


@dataclass(frozen=True)
class Scenario:
    """One serving condition to replay every policy under."""

    name: str
    condition: str  # the thesis's condition it varies: load, requests, models or gpus
    traces: str  # a trace source (module docstring)
    profile: str  # a profile name (module docstring)
    sim: SimConfig
    answer_tokens: int = 128  # answer length of exact traces (max new tokens)
    candidates: tuple[TreeShape, ...] = DEFAULT_CANDIDATES

    def describe(self) -> str:
        tilt = f", tilt {self.sim.tilt:g}" if self.sim.tilt else ""
        cold = f", cold steps x{self.sim.cold_step:g}" if self.sim.cold_step != 1.0 else ""
        return (
            f"{self.traces} on {self.profile}, {self.sim.arrivals.describe()}, "
            f"{self.sim.num_requests} requests{tilt}{cold}"
        )


def _closed(c: int, n: int, **kw: float) -> SimConfig:
    return SimConfig(Arrivals("closed", concurrency=c), num_requests=n, **kw)  # type: ignore[arg-type]


NOISE = {"noise": 0.03, "drift": 0.05}  # a GPU's step-to-step jitter and slow clock drift
CPU_NOISE = {"noise": 0.15, "noise_keep": 0.6, "drift": 0.08}  # a shared CPU's (docs/lab.md)


def default_grid() -> tuple[Scenario, ...]:
    """The default grid: every condition varied around a common point."""
    e3 = "eagle3-llama8b:chat"
    grid = [
        # Load: one GPU, one pair, rising concurrency, open-loop rates and bursts.
        *(
            Scenario(f"load-h100-c{c}", "load", e3, "h100-sxm", _closed(c, max(32, 4 * c), **NOISE))
            for c in (1, 4, 16, 64)
        ),
        Scenario(
            "load-h100-poisson-4",
            "load",
            e3,
            "h100-sxm",
            SimConfig(Arrivals("poisson", rate_per_s=4.0), num_requests=96, **NOISE),
        ),
        Scenario(
            "load-h100-bursts",
            "load",
            e3,
            "h100-sxm",
            SimConfig(
                Arrivals("bursts", bursts=((20.0, 32), (20.0, 1))), num_requests=128, **NOISE
            ),
        ),
        # Request characteristics.
        Scenario("requests-h100-code-c4", "requests", "eagle3-llama8b:code", "h100-sxm",
                 _closed(4, 32, **NOISE)),
        Scenario("requests-h100-mixed-c4", "requests", "eagle3-llama8b:mixed", "h100-sxm",
                 _closed(4, 48, **NOISE)),
        Scenario("requests-h100-transition-c1", "requests", "eagle3-llama8b:transition", "h100-sxm",
                 SimConfig(Arrivals("closed", concurrency=1), num_requests=32, shuffle=False,
                           **NOISE)),
        # Models: the older head on the same GPU; the bundled pairs on this CPU.
        Scenario("models-h100-eagle2-c1", "models", "eagle2-llama8b:chat", "h100-sxm",
                 _closed(1, 32, **NOISE)),
        Scenario("models-h100-eagle2-c16", "models", "eagle2-llama8b:chat", "h100-sxm",
                 _closed(16, 64, **NOISE)),
        Scenario("models-cpu-eagle-mtbench-c1", "models", "eagle-smollm2:mtbench", "cpu-2core",
                 _closed(1, 24, **CPU_NOISE), answer_tokens=64),
        Scenario("models-cpu-eagle-gsm8k-c1", "models", "eagle-smollm2:gsm8k", "cpu-2core",
                 _closed(1, 24, **CPU_NOISE), answer_tokens=64),
        Scenario("models-cpu-eagle-mtbench-c4", "models", "eagle-smollm2:mtbench", "cpu-2core",
                 _closed(4, 32, **CPU_NOISE), answer_tokens=64),
        Scenario("models-cpu-eagle-transition-c1", "models", "eagle-smollm2:transition",
                 "cpu-2core", SimConfig(Arrivals("closed", concurrency=1), num_requests=24,
                                        shuffle=False, **CPU_NOISE), answer_tokens=64),
        Scenario("models-cpu-draft-mtbench-c1", "models", "draft-smollm2:mtbench", "cpu-2core",
                 _closed(1, 24, **CPU_NOISE), answer_tokens=64),
        # GPUs: the same pair and loads on every profile.
        *(
            Scenario(
                f"gpus-{gpu.split('-')[0]}-c{c}",
                "gpus",
                e3,
                gpu,
                _closed(c, max(32, 4 * c), **NOISE),
            )
            for gpu in ("h200-sxm", "a100-sxm-80gb", "l4")
            for c in (1, 32)
        ),
    ]  # fmt: skip
    return tuple(grid)


def smoke_grid() -> tuple[Scenario, ...]:
    """Small scenarios on parametric traces and analytic profiles: seconds, for CI."""
    return (
        Scenario("smoke-h100-c1", "load", "eagle3-llama8b:chat", "h100-sxm",
                 _closed(1, 4, **NOISE), answer_tokens=64),
        Scenario("smoke-h100-c8", "load", "eagle3-llama8b:mixed", "h100-sxm",
                 _closed(8, 16, **NOISE), answer_tokens=64),
    )  # fmt: skip


def validation_grid() -> tuple[Scenario, ...]:
    """Served runs replayed: ``adatree bench --policies ar,static:2,2,4,adatree --prompts SET
    --loads c1 --num-requests 8 --max-new-tokens 64`` on this CPU with the bundled head, each
    server warmed up first (as the bench warms them: about 160 decode steps)."""
    return tuple(
        Scenario(
            f"served-{prompts}-c1",
            "validation",
            f"eagle-smollm2:{prompts}",
            "cpu-2core",
            SimConfig(
                Arrivals("closed", concurrency=1), num_requests=8, shuffle=False,
                warmup_requests=6, **CPU_NOISE,
            ),
            answer_tokens=64,
        )
        for prompts in ("mtbench", "gsm8k", "transition")
    )  # fmt: skip


GRIDS = {"default": default_grid, "smoke": smoke_grid, "validation": validation_grid}


def all_scenarios() -> dict[str, Scenario]:
    """Every named scenario, grids together, by name."""
    out: dict[str, Scenario] = {}
    for make in GRIDS.values():
        for s in make():
            out[s.name] = s
    return out
