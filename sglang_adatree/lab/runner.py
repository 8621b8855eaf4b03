"""Every policy through one scenario, scored against the oracles; where adatree loses, why.

Policies: ``ar`` (never drafts), every ``static:S,K,N`` of the candidate set, ``adatree``,
``turbospec`` and ``sglang-adaptive`` (the step controller with that decision rule), and two
references: ``oracle-static`` (the best static shape in hindsight) and ``per-step-oracle``.

The loss decomposition replaces adatree's estimates with the truth one at a time, cumulatively,
and charges each step's gain in goodput to what it replaced:

1. acceptance: the acceptance estimator answers with the batch's true mean emitted tokens per
   shape rather than the estimate: each request's own emitted tokens per step over its answer
   decoded under that shape (``RequestTrace.walked_emitted``);
2. step time: the cost model answers with the profile's true step time (the machine's speed
   included, the per-step noise not), and is no longer refitted;
3. exploration: no warm-up and no exploring steps;
4. switching: no hysteresis (``min_gain`` 0) and catch-up steps cost what a step without
   speculation costs.

What is left to the per-step oracle after all four ("rest") is what only it knows: how lucky the
position at hand is for each request (a draft that gets this token right or not), and batch
effects no per-step estimate removes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.cost_model import StepTimeModel
from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.shapes import NO_SPEC, TreeShape
from sglang_adatree.core.step_profile import StepTimeProfile
from sglang_adatree.lab.simulator import (
    ControllerChooser,
    RunResult,
    SimConfig,
    controller_chooser_factory,
    oracle_chooser,
    simulate,
    static_chooser,
)
from sglang_adatree.lab.traces import TraceSet

CONTROLLER_POLICIES = ("adatree", "turbospec", "sglang-adaptive")
DECOMPOSITION = ("acceptance", "step-time", "exploration", "switching")
# Dinkelbach's iterations converge in a few; each is one more run of the scenario.
ORACLE_ITERATIONS = 3


@dataclass(frozen=True)
class ScenarioResult:
    """Every policy's run of one scenario, and the references."""

    runs: dict[str, RunResult]  # by policy name
    oracle_static: str  # the static shape that did best here
    decomposition: dict[str, float]  # loss share per cause, as goodput ratios to the oracle

    def ratio(self, policy: str, reference: str) -> float:
        ref = self.runs[reference].goodput_tok_s
        return self.runs[policy].goodput_tok_s / ref if ref > 0 else math.nan


class _TruthAcceptance:
    """What an acceptance estimator could know at best without seeing the future: each
    request's own emitted tokens per step under each shape over its answer (not the luck of the
    position at hand, which only the per-step oracle knows), averaged over the batch."""

    def __init__(self, traces: TraceSet) -> None:
        self.traces = traces
        self.batch: list[Any] = []
        # request id -> [shapes of the set] mean emitted over the answer's decode steps
        self._means: dict[str, np.ndarray] = {}
        self._columns: dict[TreeShape, int] = {}

    def _mean(self, trace: Any) -> np.ndarray:
        means = self._means.get(trace.request_id)
        if means is None:
            means = self._means[trace.request_id] = trace.walked_emitted()
        return means

    def expected_emitted_many(self, shapes: Sequence[TreeShape]) -> np.ndarray:
        means = np.mean([self._mean(r.trace) for r in self.batch], axis=0)  # [set's shapes]
        out = np.ones(len(shapes))
        for i, shape in enumerate(shapes):
            if shape.speculative:
                out[i] = means[self._columns.setdefault(shape, self.traces.column(shape))]
        return out

    def expected_emitted(self, shape: TreeShape) -> float:
        return float(self.expected_emitted_many((shape,))[0])

    def observe(self, *args: Any, **kwargs: Any) -> None:
        return None


class _TruthStepTime:
    """The profile's step time at the machine's current speed, as a cost model answers."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine

    def predict_ms_many(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> np.ndarray:
        return np.array(self.predict_ms_list(features, shapes))

    def predict_ms_list(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> list[float]:
        return [self.machine.true_ms(features, s) for s in shapes]

    def predict_ms(self, features: StepFeatures, shape: TreeShape) -> float:
        return self.machine.true_ms(features, shape)

    def observe(self, *args: Any, **kwargs: Any) -> None:
        return None


def _variant(
    config: AdaTreeConfig,
    traces: TraceSet,
    replaced: Sequence[str],
    profiled: StepTimeModel | None = None,
) -> Callable[[Any, Callable[[], float]], Any]:
    """A chooser factory for adatree with the estimates in ``replaced`` set to the truth."""
    if "exploration" in replaced:
        config = config.replace(warmup_steps=0, explore_fraction=0.0)
    if "switching" in replaced:
        config = config.replace(min_gain=0.0)

    def configure(chooser: ControllerChooser, machine: Any) -> None:
        policy = chooser.controller.policy
        if "acceptance" in replaced:
            truth = _TruthAcceptance(traces)
            policy.acceptance = truth

            def see(batch: list[Any]) -> None:
                truth.batch = batch

            chooser.before_begin = see
        if "step-time" in replaced:
            policy.cost_model = _TruthStepTime(machine)
            chooser.refits = False
            chooser.controller.runs_first_refit = False
        if "switching" in replaced:
            chooser.charge_catch_up = False

    return controller_chooser_factory(config, traces, configure, profiled)


def _decode_rate(run: RunResult) -> float:
    """Tokens per ms of the run's decode steps."""
    return run.decode_tokens / (run.decode_s * 1000.0) if run.decode_s > 0 else 0.0


def _per_step_oracle(
    traces: TraceSet,
    profile: StepTimeProfile,
    sim: SimConfig,
    candidates: Sequence[TreeShape],
    oracle_static: RunResult,
    keep_timeline: bool,
) -> RunResult:
    """The best of the greedy per-step oracle and Dinkelbach's iterations on the run's rate.

    The greedy chooser can trail a static shape (it never takes the bigger, slower step that
    the run's rate would pay for); each iteration chooses at the best decode rate seen so far,
    starting from the greedy run's and the oracle static shape's, until the goodput stops
    rising."""

    def run(rate: float) -> RunResult:
        return simulate(
            traces, profile, sim, lambda m, c: oracle_chooser(traces, m, candidates, rate),
            "per-step-oracle", keep_timeline=keep_timeline,
        )  # fmt: skip

    best = run(0.0)
    rate = max(_decode_rate(best), _decode_rate(oracle_static))
    for _ in range(ORACLE_ITERATIONS):
        tried = run(rate)
        if tried.goodput_tok_s <= best.goodput_tok_s:
            break
        best, rate = tried, _decode_rate(tried)
    return best


def decomposition_order(causes: Sequence[str]) -> tuple[str, ...]:
    """``causes`` as an order of the loss split; ValueError unless it names each of
    ``DECOMPOSITION`` once."""
    order = tuple(causes)
    if sorted(order) != sorted(DECOMPOSITION):
        raise ValueError(
            f"a decomposition order names each of {','.join(DECOMPOSITION)} once, "
            f"not {','.join(order) or 'none'}"
        )
    return order


def run_scenario(
    traces: TraceSet,
    profile: StepTimeProfile,
    sim: SimConfig,
    config: AdaTreeConfig,
    candidates: Sequence[TreeShape],
    policies: Sequence[str] = (),
    decompose: bool = True,
    timelines: Sequence[str] = ("adatree", "per-step-oracle"),
    profiled: StepTimeModel | None = None,
    decompose_order: Sequence[str] = DECOMPOSITION,
) -> ScenarioResult:
    """Run every policy (``policies`` empty: all of them) on one scenario; with ``profiled``
    (a deployment's step-time profile, ``step_profile.ProfileStepTime``) the policies that run
    the step controller start from it, as a server with ``step_time_profile`` does.

    ``decompose_order``: the causes in the order the decomposition replaces them, each of
    ``DECOMPOSITION`` once. A cause's share is what replacing it gains after the ones before
    it, so the order can move a share: where two estimates err together (a stale price and the
    acceptance of the shape it keeps the policy on), the first replaced takes the gain both
    would have."""
    order = decomposition_order(decompose_order)
    candidates = tuple(candidates)
    config = config.replace(candidate_shapes=candidates, record_steps=False)
    runs: dict[str, RunResult] = {}

    def run(name: str, make: Callable[[Any, Callable[[], float]], Any], cfg: SimConfig) -> None:
        runs[name] = simulate(traces, profile, cfg, make, name, keep_timeline=name in timelines)

    statics = [s for s in candidates if s.speculative]
    for shape in (NO_SPEC, *statics):
        name = "ar" if shape == NO_SPEC else f"static:{shape}"
        run(name, lambda m, c, shape=shape: static_chooser(shape), sim)
    best = max((f"static:{s}" for s in statics), key=lambda n: runs[n].goodput_tok_s)
    if runs["ar"].goodput_tok_s > runs[best].goodput_tok_s:
        best = "ar"
    runs["oracle-static"] = dataclasses.replace(runs[best], policy="oracle-static")
    runs["per-step-oracle"] = _per_step_oracle(
        traces, profile, sim, candidates, runs["oracle-static"], "per-step-oracle" in timelines
    )
    for name in CONTROLLER_POLICIES:
        if policies and name not in policies:
            continue
        make = controller_chooser_factory(config.replace(policy=name), traces, profile=profiled)
        run(name, make, sim)
    decomposition: dict[str, float] = {}
    if decompose and "adatree" in runs:
        oracle = runs["per-step-oracle"].goodput_tok_s
        previous = runs["adatree"].goodput_tok_s
        for i, cause in enumerate(order):
            variant = f"adatree+{'+'.join(order[: i + 1])}"
            run(variant, _variant(config, traces, order[: i + 1], profiled), sim)
            now = runs[variant].goodput_tok_s
            decomposition[cause] = (now - previous) / oracle if oracle > 0 else math.nan
            previous = now
        decomposition["rest"] = (oracle - previous) / oracle if oracle > 0 else math.nan
    return ScenarioResult(runs, best, decomposition)
