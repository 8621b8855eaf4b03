"""A serving simulator: continuous batching as SGLang runs it, one shape per decode step.

Requests arrive (closed-loop clients, Poisson arrivals, bursts, or recorded arrival times), wait,
and join the running batch (at most ``max_batch_size``) through a prefill step of their own, as
SGLang schedules a prefill batch instead of a decode step while requests wait (speculative
decoding runs no mixed batches). A decode step runs every running request under one shape; each
request emits what its trace says for that shape at its position; a request that has emitted its
whole answer leaves the batch. Time advances by the profile's step time, scaled by the machine's
speed (an Ornstein-Uhlenbeck walk in log speed, ``drift`` its stationary sigma) and per-step
noise (``noise``, log-normal sigma, persisting ``noise_keep`` from one step to the next: a shared
CPU's slow and fast steps come in runs); both are seeded, so a run is a pure function of its
inputs. A prefill of ``P`` prompt tokens costs ``1 + P / PREFILL_TOKENS_PER_STEP`` steps
without speculation at that context (``_Machine.prefill_ms``).

``cold_step`` makes a speculative shape's first step in the run cost that many times its time,
as a served shape's first step can pay one-off costs (its tensors' sizes are new to the
forward's kernels and allocator: ``docs/notes/2026-12-07-cold-steps.md``); every policy pays
it, the references included, and learns from that step as from any other.

``tilt`` makes the serving machine split its time between shapes otherwise than the profile
does: each step's time over the step without speculation at the same batch is the profile's
ratio raised to ``exp(tilt)`` (a positive tilt makes every tree dearer against no speculation, a
negative one cheaper). A machine whose memory bandwidth comes and goes moves that ratio: a
served CPU run measured the step without speculation 2.6 times faster than its profile said
half an hour before and the tree 3,4,8 only 1.7 times
(``docs/notes/2026-12-06-the-runner-up.md``). A policy that starts from the profile then
starts from a stale ratio, which a speed common to every shape cannot carry.

The policy under test is driven the way the SGLang worker drives it: through
``core.controller.StepController`` (adatree and the re-implemented baselines, catch-up steps,
refits as the control poller would hand them over), fed the noisy measured step time and the
accepted paths of every step. References no real system can run:

* ``static:S,K,N`` and ``ar`` run one shape throughout (``ar`` never drafts);
* the **oracle static** shape is the best static shape of the scenario in hindsight;
* the **per-step oracle** picks, each step, the shape whose true emitted tokens most exceed what
  its true step time (speed included, noise not) earns at the run's rate, knowing every
  request's trace (``oracle_chooser``; ``runner`` finds the rate).

A step without speculation that runs the draft's extend (a catch-up step, or any such step with
``skip_idle_draft_extend`` off) costs the step without speculation plus half the difference
between the one-token chain and no speculation, the profile's best estimate of one draft extend
when it has no figure of its own (``notes["catch_up_ms"]``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.confidence import FirstLayer
from sglang_adatree.core.controller import BatchView, StepController, StepOutcome
from sglang_adatree.core.cost_model import StepTimeModel
from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.policy import Decision, DecisionSource, Policy
from sglang_adatree.core.shapes import NO_SPEC, TreeShape
from sglang_adatree.core.step_profile import StepTimeProfile
from sglang_adatree.lab.traces import RequestTrace, TraceSet

CHAIN_1 = TreeShape(1, 1, 2)
# Rounds of the hindsight fit's alternating ratios (``hindsight_abs_error``); its error moves
# by under 0.001 tokens after a few.
HINDSIGHT_ROUNDS = 12

# A prefill's prompt tokens run as one batched forward, many tokens for about the price of one
# decode step: a prefill costs one step without speculation per this many prompt tokens, and
# one more (the bundled target's served TTFTs on a CPU are in that range, docs/lab.md).
PREFILL_TOKENS_PER_STEP = 64
# The machine's speed walks in log space on a fixed time grid: every policy of a scenario sees
# the same speed at the same simulated time, however many steps it takes to get there.
SPEED_TICK_S = 0.05
SPEED_KEEP = 0.995  # persistence per tick: a correlation time of about 10 s


@dataclass(frozen=True)
class Arrivals:
    """How requests arrive.

    * ``closed``: ``concurrency`` clients, each sending its next request when the last one
      finished;
    * ``poisson``: open-loop arrivals at ``rate_per_s``;
    * ``bursts``: phases of ``(seconds, concurrency)`` in turn, closed-loop within a phase
      (concurrency 0: idle), repeated until every request is sent;
    * ``recorded``: the given arrival times (seconds from the start), one per request.
    """

    kind: str
    concurrency: int = 1
    rate_per_s: float = 0.0
    bursts: tuple[tuple[float, int], ...] = ()
    times: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("closed", "poisson", "bursts", "recorded"):
            raise ValueError(f"unknown arrival kind {self.kind!r}")
        if self.kind == "closed" and self.concurrency < 1:
            raise ValueError("closed-loop arrivals need concurrency >= 1")
        if self.kind == "poisson" and self.rate_per_s <= 0:
            raise ValueError("Poisson arrivals need a positive rate")
        if self.kind == "bursts" and not any(c > 0 for _, c in self.bursts):
            raise ValueError("bursts need at least one phase with clients")

    def describe(self) -> str:
        if self.kind == "closed":
            return f"concurrency {self.concurrency}"
        if self.kind == "poisson":
            return f"Poisson {self.rate_per_s:g} req/s"
        if self.kind == "bursts":
            return "bursts " + ", ".join(f"{c} for {s:g}s" for s, c in self.bursts)
        return f"{len(self.times)} recorded arrivals"


@dataclass(frozen=True)
class SimConfig:
    """One simulated run's conditions, apart from the traces, the profile and the policy."""

    arrivals: Arrivals
    num_requests: int
    max_batch_size: int = 256
    noise: float = 0.0  # sigma of per-step log-normal noise on step time
    # The log noise's correlation from one decode step to the next (an AR(1) of stationary sigma
    # ``noise``); 0: independent steps.
    noise_keep: float = 0.0
    drift: float = 0.0  # stationary sigma of the log speed walk
    # Each step's time over no speculation's is the profile's raised to exp(tilt) (module
    # docstring); 0: the profile's ratios.
    tilt: float = 0.0
    # A speculative shape's first step in the run (a cold step: its tensors' sizes are new to
    # the forward's kernels and allocator) costs this many times its time; 1: no one-off costs.
    cold_step: float = 1.0
    seed: int = 0
    shuffle: bool = True  # draw requests in a seeded shuffle; False keeps the set's order
    # Requests served one at a time before the measured ones, unmeasured: the loop's state
    # warms up as a benchmark's warm-up requests warm a server.
    warmup_requests: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not isinstance(self.max_batch_size, int):
            raise ValueError(f"need >= 1 request and an integer batch limit: {self}")
        if self.max_batch_size < 1 or self.noise < 0 or self.drift < 0:
            raise ValueError(f"batch limit >= 1, noise and drift >= 0: {self}")
        if not 0.0 <= self.noise_keep < 1.0:
            raise ValueError(f"noise_keep must be in [0, 1): {self}")
        if not self.cold_step > 0.0:
            raise ValueError(f"cold_step must be > 0: {self}")


@dataclass(frozen=True)
class EstimateErrors:
    """What a step controller predicted for the steps it ran, against what they did, over a
    run's measured requests.

    Emitted tokens are per request: a step's prediction (``Decision.predicted_emitted``) against
    each request's emitted tokens, averaged over request-steps. ``chosen``: the speculative steps
    the policy chose on its estimates (``MODEL`` or ``FALLBACK``). It runs the shape whose
    estimate is highest, and an estimate that happens to be high is chosen more often than one
    that happens to be low, so these steps emit less than predicted even when every estimate is
    right on average (the winner's curse); a bias here is what pushes a policy into shapes, or
    into speculation, that do not pay. ``explored``: exploring steps, which run a shape whose
    estimate lost, so the curse runs the other way. ``declined``: the steps the policy served
    without speculation on its estimates, with the speculative shape it predicted best there:
    its predicted emitted tokens against what the traces say it would have emitted (for
    adatree's policy only; the lab alone knows the second). Nothing runs that shape, so nothing
    corrects an estimate that reads low there, nor its price against no speculation, which the
    declined steps' times say nothing about: ``declined_time_bias``. Step times: the relative
    error of every step whose time teaches the cost model (not catch-up steps).

    The acceptance error per step (``candidate_abs_error``) is not judged on the steps a policy
    chose to run, whose selection favours the estimates that read high: on every step of the
    run, every speculative candidate's prediction for each request (``Policy.request_emitted``,
    with what the decision read of the request and of its draft's confidence) against what the
    traces say that request would emit under it, the mean of ``|predicted - emitted|`` over
    request-steps and candidates. ``shape_abs_error`` is the same for the shape's estimate
    alone, one value for every request and step, as the policy predicted before it kept
    anything per request or per step. ``hindsight_abs_error`` is the same for the prediction
    fitted to these very steps after the run, per candidate, from the two things the policy
    reads of a step before it: its request and the tenth of its draft's confidence (where the
    traces carry it). An estimate learnt online from the same two things has less to go on, so it
    says how far the error can fall with them before the draw of each step is all that is left.
    """

    chosen_steps: int
    chosen_predicted: float  # mean predicted emitted tokens per request on chosen steps
    chosen_emitted: float  # mean emitted tokens per request on them
    explored_steps: int
    explored_predicted: float
    explored_emitted: float
    declined_steps: int
    declined_predicted: float  # the best speculative shape's predicted emitted tokens there
    declined_would_emit: float  # what its trace says it would have emitted there
    # Mean over the declined steps of that shape's predicted step time over no speculation's,
    # divided by the same ratio of their true step times.
    declined_time_ratio: float
    emitted_abs_error: float  # mean |predicted - emitted| per request, every speculative step
    step_ms_rel_error: float  # mean |predicted - measured| / measured step time
    # Mean |predicted - emitted| per request and speculative candidate, on every step: the
    # policy's prediction, the shape's estimate alone, the fit in hindsight.
    candidate_abs_error: float = math.nan
    shape_abs_error: float = math.nan
    hindsight_abs_error: float = math.nan

    @property
    def chosen_bias(self) -> float:
        """How far the chosen steps' predictions ran above what they emitted (0.05: 5% high)."""
        return _over(self.chosen_predicted, self.chosen_emitted)

    @property
    def explored_bias(self) -> float:
        """The same for the exploring steps."""
        return _over(self.explored_predicted, self.explored_emitted)

    @property
    def declined_bias(self) -> float:
        """The same for the best speculative shape on the declined steps (-0.1: 10% low)."""
        return _over(self.declined_predicted, self.declined_would_emit)

    @property
    def declined_time_bias(self) -> float:
        """How much dearer than no speculation the best speculative shape was priced on the
        declined steps than it truly was (0.05: 5% too dear)."""
        return self.declined_time_ratio - 1.0


def _over(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0 if measured > 0 else math.nan


class _EstimateTally:
    """Sums behind ``EstimateErrors``."""

    def __init__(self) -> None:
        # Per kind of step: steps, request-steps, sum of predictions, sum of emitted tokens.
        self.kinds = {k: [0, 0, 0.0, 0.0] for k in ("chosen", "explored", "declined")}
        self.abs_error = [0, 0.0]  # request-steps, sum of |predicted - emitted|
        self.step_error = [0, 0.0]  # steps, sum of relative step-time errors
        self.declined_time = 0.0  # sum over declined steps of predicted / true time ratios
        # Request-candidate pairs, sums of |predicted - emitted| for the policy's prediction
        # and for the shape's estimate alone.
        self.candidate_error = [0, 0.0, 0.0]
        self.would: list[np.ndarray] = []  # per step, [batch, speculative candidates]
        self.keys: list[tuple[str, int]] = []  # per request-step: its request, confidence bin

    def add(self, decision: Decision, emitted: Sequence[int], measured_ms: float) -> None:
        """A step run as ``decision`` said: each request's emitted tokens and its time."""
        if decision.source.teaches_cost_model and measured_ms > 0:
            self.step_error[0] += 1
            self.step_error[1] += abs(decision.predicted_ms - measured_ms) / measured_ms
        if not decision.shape.speculative:
            return
        predicted = decision.predicted_emitted
        self.abs_error[0] += len(emitted)
        self.abs_error[1] += sum(abs(predicted - e) for e in emitted)
        kind = _KINDS.get(decision.source)
        if kind is not None:
            self._count(kind, predicted, emitted)

    def add_declined(self, predicted: float, would_emit: Sequence[int], time_ratio: float) -> None:
        """A step served without speculation on the estimates: the best speculative shape's
        prediction there, what each request would have emitted under it, and its predicted
        price against no speculation over the true one."""
        self._count("declined", predicted, would_emit)
        self.declined_time += time_ratio

    def add_candidates(
        self,
        predicted: np.ndarray,
        shape_only: np.ndarray,
        would: np.ndarray,
        keys: Sequence[tuple[str, int]],
    ) -> None:
        """One step's ``[batch, speculative candidates]`` predicted emitted tokens, the shape's
        estimates alone, and what the traces say each request would emit under each; ``keys``
        ``[batch]`` each request's id and the bin of its draft's confidence (-1: unknown)."""
        self.candidate_error[0] += would.size
        self.candidate_error[1] += float(np.abs(predicted - would).sum())
        self.candidate_error[2] += float(np.abs(shape_only - would).sum())
        self.would.append(would)
        self.keys.extend(keys)

    def _count(self, kind: str, predicted: float, emitted: Sequence[int]) -> None:
        sums = self.kinds[kind]
        sums[0] += 1
        sums[1] += len(emitted)
        sums[2] += predicted * len(emitted)
        sums[3] += sum(emitted)

    def result(self) -> EstimateErrors:
        def mean(total: float, n: int) -> float:
            return total / n if n else math.nan

        chosen, explored, declined = (self.kinds[k] for k in ("chosen", "explored", "declined"))
        return EstimateErrors(
            chosen_steps=int(chosen[0]),
            chosen_predicted=mean(chosen[2], chosen[1]),
            chosen_emitted=mean(chosen[3], chosen[1]),
            explored_steps=int(explored[0]),
            explored_predicted=mean(explored[2], explored[1]),
            explored_emitted=mean(explored[3], explored[1]),
            declined_steps=int(declined[0]),
            declined_predicted=mean(declined[2], declined[1]),
            declined_would_emit=mean(declined[3], declined[1]),
            declined_time_ratio=mean(self.declined_time, declined[0]),
            emitted_abs_error=mean(self.abs_error[1], self.abs_error[0]),
            step_ms_rel_error=mean(self.step_error[1], self.step_error[0]),
            candidate_abs_error=mean(self.candidate_error[1], self.candidate_error[0]),
            shape_abs_error=mean(self.candidate_error[2], self.candidate_error[0]),
            hindsight_abs_error=hindsight_abs_error(
                np.concatenate(self.would) if self.would else np.zeros((0, 0)), self.keys
            ),
        )


def hindsight_abs_error(would: np.ndarray, keys: Sequence[tuple[str, int]]) -> float:
    """Mean ``|predicted - emitted|`` over ``would`` ``[request-steps, candidates]`` of the
    prediction fitted to it in hindsight: per candidate, ``1 + m * f_r * c_b`` with ``m`` its
    mean accepted draft tokens, ``f_r`` a factor per request and ``c_b`` one per confidence
    bin (``keys`` ``[request-steps]``), fitted by alternating ratios (each factor the ratio of
    what its steps accepted to what the other factor expects of them). NaN: nothing to fit."""
    if would.size == 0:
        return math.nan
    _, request = np.unique([k[0] for k in keys], return_inverse=True)  # [request-steps]
    _, level = np.unique([k[1] for k in keys], return_inverse=True)  # [request-steps]
    accepted = would.astype(float) - 1.0  # [request-steps, candidates]
    m = accepted.mean(axis=0)  # [candidates]
    f = np.ones((request.max() + 1, would.shape[1]))  # [requests, candidates]
    c = np.ones((level.max() + 1, would.shape[1]))  # [bins, candidates]

    def ratio(groups: np.ndarray, size: int, expected: np.ndarray) -> np.ndarray:
        num = np.zeros((size, would.shape[1]))
        den = np.zeros((size, would.shape[1]))
        np.add.at(num, groups, accepted)
        np.add.at(den, groups, expected)
        return np.divide(num, den, out=np.ones_like(num), where=den > 0)

    for _ in range(HINDSIGHT_ROUNDS):
        c = ratio(level, len(c), m * f[request])
        f = ratio(request, len(f), m * c[level])
    predicted = 1.0 + m * f[request] * c[level]
    return float(np.abs(predicted - would).mean())


_KINDS = {
    DecisionSource.MODEL: "chosen",
    DecisionSource.FALLBACK: "chosen",
    DecisionSource.EXPLORE: "explored",
    DecisionSource.PROBE: "explored",
}


@dataclass(frozen=True)
class RunResult:
    """What one policy did in one run."""

    policy: str
    goodput_tok_s: float  # output tokens over the makespan
    tpot_ms_p50: float
    tpot_ms_p99: float
    accept_len_mean: float  # emitted tokens per request per decode step
    steps: int  # decode steps
    shape_shares: dict[str, float]  # share of decode steps per shape
    makespan_s: float
    output_tokens: int
    decode_s: float  # time spent in decode steps (the makespan less prefills and idling)
    decode_tokens: int  # tokens the decode steps emitted (the first of each is the prefill's)
    # The decode steps in order: time (s) and shape, for the charts.
    timeline: tuple[tuple[float, str], ...] = field(default=(), repr=False)
    # A step controller's predictions against its steps; None for the references.
    estimates: EstimateErrors | None = None


@dataclass
class _Request:
    id: str
    trace: RequestTrace
    arrival_s: float
    position: int = 0  # output tokens so far
    first_token_s: float = 0.0


class _Machine:
    """The true step time: the profile, the machine's slow speed walk and per-step noise."""

    def __init__(self, profile: StepTimeProfile, cfg: SimConfig) -> None:
        self.profile = profile
        self.noise = cfg.noise
        self.noise_keep = cfg.noise_keep
        self.log_noise = 0.0  # the last decode step's
        self.drift = cfg.drift
        self.tilt_power = math.exp(cfg.tilt)  # 1: the profile's ratios
        self.noise_rng = np.random.default_rng(cfg.seed + 7919)
        self.speed_rng = np.random.default_rng(cfg.seed + 104729)
        self.log_speeds = [0.0]  # on the SPEED_TICK_S grid from time 0
        self.now = 0.0

    def at(self, now: float) -> None:
        """Move the machine's clock to ``now`` (simulated seconds)."""
        self.now = now
        if self.drift <= 0:
            return
        tick = int(now / SPEED_TICK_S)
        scale = self.drift * math.sqrt(1 - SPEED_KEEP**2)
        while len(self.log_speeds) <= tick:
            eps = float(self.speed_rng.normal())
            self.log_speeds.append(SPEED_KEEP * self.log_speeds[-1] + scale * eps)

    @property
    def speed(self) -> float:
        if self.drift <= 0:
            return 1.0
        return math.exp(self.log_speeds[int(self.now / SPEED_TICK_S)])

    def true_ms(self, features: StepFeatures, shape: TreeShape) -> float:
        return self._tilted(features, self.profile.step_ms(features, shape)) * self.speed

    def _tilted(self, features: StepFeatures, ms: float) -> float:
        """``ms``, a step's time by the profile, with its ratio to no speculation's tilted."""
        if self.tilt_power == 1.0:
            return ms
        plain = self.profile.step_ms(features, NO_SPEC)
        return plain * (ms / plain) ** self.tilt_power

    def catch_up_ms(self, features: StepFeatures) -> float:
        plain = self.profile.step_ms(features, NO_SPEC)
        notes = getattr(self.profile, "notes", {}) or {}
        if "catch_up_ms" in notes:
            extra = float(notes["catch_up_ms"])
        else:
            try:
                extra = max(0.0, self.profile.step_ms(features, CHAIN_1) - plain) / 2.0
            except KeyError:
                extra = 0.1 * plain
        return self._tilted(features, plain + extra) * self.speed

    def measured(self, true_ms: float) -> float:
        if self.noise <= 0:
            return true_ms
        keep = self.noise_keep
        fresh = float(self.noise_rng.normal(0.0, self.noise))
        self.log_noise = keep * self.log_noise + math.sqrt(1.0 - keep * keep) * fresh
        return true_ms * math.exp(self.log_noise)

    def prefill_ms(self, prompt_tokens: int) -> float:
        """A prefill over ``prompt_tokens``: one step without speculation per
        ``PREFILL_TOKENS_PER_STEP`` prompt tokens, and one more."""
        one = self.profile.step_ms(StepFeatures(1, 1, max(1, prompt_tokens), 1), NO_SPEC)
        return one * (1.0 + prompt_tokens / PREFILL_TOKENS_PER_STEP) * self.speed


# A chooser sees the running requests and the features, returns the shape, whether the step is a
# catch-up (costed as such), and a callback that takes the measured time and per-request
# emitted tokens once the step ran.
Chooser = Callable[
    [list[_Request], StepFeatures], tuple[TreeShape, bool, Callable[[float, list[int]], None]]
]


def _noop(ms: float, emitted: list[int]) -> None:
    return None


def static_chooser(shape: TreeShape) -> Chooser:
    def choose(batch: list[_Request], features: StepFeatures):
        return shape, False, _noop

    return choose


def oracle_chooser(
    traces: TraceSet, machine: _Machine, shapes: Sequence[TreeShape], rate: float = 0.0
) -> Chooser:
    """Each step the shape with the most true emitted tokens per ms of true step time; with
    ``rate`` (tokens per ms, what the run's decode steps earn) the shape whose tokens most
    exceed what its time would earn at that rate.

    The first is greedy: a step that emits more tokens at a lower rate than the best step's,
    but above the run's, shortens the run, and the greedy chooser never takes it. The second is
    Dinkelbach's step for a ratio: it takes the step that adds the most tokens beyond what its
    time costs at the run's rate (``runner`` iterates to that rate)."""
    columns = [traces.column(s) if s.speculative else -1 for s in shapes]

    def choose(batch: list[_Request], features: StepFeatures):
        best, best_score = shapes[0], -math.inf
        for shape, j in zip(shapes, columns, strict=True):
            if j < 0:
                tokens = len(batch)
            else:
                tokens = sum(int(r.trace.emitted[r.position, j]) for r in batch)
            ms = machine.true_ms(features, shape)
            score = tokens - rate * ms if rate > 0 else tokens / ms
            if score > best_score:
                best, best_score = shape, score
        return best, False, _noop

    return choose


def hands_first_layer(traces: TraceSet) -> bool:
    """Whether ``traces`` hand the step controller the draft's first layer at each position, as
    the engine does on a CPU (``core.confidence``): exact traces keep it. Parametric traces draw
    each position's acceptance apart from any draft probabilities (their draft's expectation is
    one value per request class, which would tell the class): none there."""
    return traces.kind == "exact" and all(r.first_layer is not None for r in traces.requests)


class ControllerChooser:
    """The serving loop under test, driven as the SGLang worker drives it."""

    def __init__(
        self,
        controller: StepController,
        traces: TraceSet,
        clock: Callable[[], float],
        true_ms: Callable[[StepFeatures, TreeShape], float],
    ) -> None:
        self.controller = controller
        self.traces = traces
        self.clock = clock
        # The machine's true step time, for pricing the declined steps' best speculative shape.
        self.true_ms = true_ms
        self.before_begin: Callable[[list[_Request]], None] | None = None
        # False: a catch-up step costs what a step without speculation costs (the loss
        # decomposition's switching variant).
        self.charge_catch_up = True
        self.refits = True  # hand the controller its refits, as the control poller would
        self.estimates = _EstimateTally()
        self._first_layer = hands_first_layer(traces)
        # adatree's policy's speculative candidates, and their columns in the traces.
        policy = controller.policy
        self._speculative = (
            [i for i, s in enumerate(policy.candidates) if s.speculative]
            if isinstance(policy, Policy)
            else []
        )
        self._speculative_columns = [traces.column(policy.candidates[i]) for i in self._speculative]

    def __call__(self, batch: list[_Request], features: StepFeatures):
        if self.before_begin is not None:
            self.before_begin(batch)
        view = BatchView(
            tuple(r.id for r in batch),
            tuple(r.trace.prompt_len + r.position for r in batch),
            tuple(tuple(r.trace.first_layer[r.position].tolist()) for r in batch)
            if self._first_layer
            else None,
        )
        ticket = self.controller.begin(view)
        shape = ticket.decision.shape
        if not shape.speculative and _KINDS.get(ticket.decision.source) == "chosen":
            self._declined(batch, ticket.features, view.request_ids, ticket.confidence)
        self._candidates(batch, view.request_ids, ticket.confidence)
        # A step without speculation that runs the draft's extend (a catch-up, or any such step
        # where the extend is not skipped) costs what a catch-up costs.
        catch_up = self.charge_catch_up and not shape.speculative and not ticket.skips_draft_extend
        column = self.traces.column(shape) if shape.speculative else -1
        positions = [r.position for r in batch]
        traces = [r.trace for r in batch]

        def done(ms: float, emitted: list[int]) -> None:
            paths = None
            if shape.speculative:
                steps = shape.steps
                pairs = list(zip(traces, positions, strict=True))
                paths = AcceptedPathStats(
                    np.stack([t.num_children[p, column, :steps] for t, p in pairs]),  # [B, S]
                    np.stack([t.accepted_rank[p, column, :steps] for t, p in pairs]),
                )
            self.estimates.add(ticket.decision, emitted, ms)
            accepted = tuple(e - 1 for e in emitted)
            self.controller.finish(ticket, StepOutcome(ms, accepted, self.clock(), paths))
            update = self.controller.refit() if self.refits else None
            if update is not None:
                self.controller.apply(update)

        return shape, catch_up, done

    def _candidates(
        self,
        batch: list[_Request],
        request_ids: Sequence[str],
        confidence: Sequence[FirstLayer | None] | None,
    ) -> None:
        """Tally every speculative candidate's prediction for each request of this step, as
        the decision read it, against what the traces say the request would emit under it."""
        policy = self.controller.policy
        which = self._speculative
        if not which or not isinstance(policy, Policy):
            return
        would = np.stack(
            [r.trace.emitted[r.position, self._speculative_columns] for r in batch]
        )  # [batch, speculative candidates]
        predicted = policy.request_emitted(request_ids, confidence)[:, which]
        shape_only = policy.request_emitted(request_ids, per_request=False)[:, which]
        # Each request and the bin of its draft's confidence, as the policy's bins cut it.
        keys = []
        for rid, r in zip(request_ids, batch, strict=True):
            q = float(r.trace.first_layer[r.position, 0]) if self._first_layer else None
            keys.append((rid, -1 if q is None else policy.confidence.bin(q)))
        self.estimates.add_candidates(predicted, shape_only, would, keys)

    def _declined(
        self,
        batch: list[_Request],
        features: StepFeatures,
        request_ids: Sequence[str],
        confidence: Sequence[FirstLayer | None] | None,
    ) -> None:
        """Tally the speculative shape the policy predicted best on a step it serves without
        speculation (from the draft confidence the decision read), against what the traces say
        that shape would emit there."""
        policy = self.controller.policy
        if not isinstance(policy, Policy):
            return
        times, emitted = policy.predictions(features, request_ids, confidence)  # [candidates]
        goodput = np.where([s.speculative for s in policy.candidates], emitted / times, -np.inf)
        if not np.isfinite(goodput).any():
            return
        best = int(np.argmax(goodput))
        shape = policy.candidates[best]
        column = self.traces.column(shape)
        would = [int(r.trace.emitted[r.position, column]) for r in batch]
        # The step ran no speculation, so no speculation is a candidate.
        plain = policy.candidates.index(NO_SPEC)
        true = self.true_ms(features, shape) / self.true_ms(features, NO_SPEC)
        time_ratio = float(times[best] / times[plain]) / true
        self.estimates.add_declined(float(emitted[best]), would, time_ratio)


@dataclass
class _Tally:
    """What a phase of a run counts."""

    start_s: float
    finished: list[tuple[float, float, int]] = field(default_factory=list)  # first, end, tokens
    emitted: int = 0
    request_steps: int = 0
    steps: int = 0
    decode_s: float = 0.0
    shapes: collections.Counter[str] = field(default_factory=collections.Counter)
    timeline: list[tuple[float, str]] = field(default_factory=list)


def simulate(
    traces: TraceSet,
    profile: StepTimeProfile,
    cfg: SimConfig,
    make_chooser: Callable[[_Machine, Callable[[], float]], Chooser],
    policy_name: str,
    keep_timeline: bool = False,
) -> RunResult:
    """One run of ``cfg`` with the chooser ``make_chooser(machine, clock)`` builds; the first
    ``cfg.warmup_requests`` requests run one at a time before it, unmeasured."""
    machine = _Machine(profile, cfg)
    now = [0.0]
    chooser = make_chooser(machine, lambda: now[0])
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(traces.requests)) if cfg.shuffle else range(len(traces.requests))
    drawn = [
        traces.requests[int(order[i % len(order)])]
        for i in range(cfg.warmup_requests + cfg.num_requests)
    ]
    serial = [0]
    padding = _padding(profile)
    begun: set[TreeShape] = set()  # the speculative shapes run so far: the rest are cold

    def serve(requests: list[RequestTrace], arrivals: _ArrivalSchedule, tally: _Tally) -> None:
        pending = collections.deque(requests)
        waiting: collections.deque[_Request] = collections.deque()
        running: list[_Request] = []
        origin = tally.start_s

        def admit(at: float) -> None:
            for t in arrivals.due(at - origin):
                if not pending:
                    return
                waiting.append(_Request(f"r{serial[0]}", pending.popleft(), origin + t))
                serial[0] += 1

        while pending or waiting or running:
            admit(now[0])
            if not running and not waiting:
                next_t = arrivals.next_time(now[0] - origin)
                if next_t is None or not pending:
                    break
                # An idle machine waits; a bursts phase with clients starts a hair later.
                later = origin + next_t
                now[0] = later if later > now[0] else now[0] + 1e-3
                continue
            if waiting and len(running) < cfg.max_batch_size:
                joining = []
                while waiting and len(running) + len(joining) < cfg.max_batch_size:
                    joining.append(waiting.popleft())
                machine.at(now[0])
                now[0] += machine.prefill_ms(sum(r.trace.prompt_len for r in joining)) / 1000.0
                for r in joining:
                    r.position = 1
                    r.first_token_s = now[0]
                    if r.trace.answer_len <= 1:
                        tally.finished.append((now[0], now[0], 1))
                        arrivals.finished(now[0] - origin)
                    else:
                        running.append(r)
                continue
            features = StepFeatures.from_context_lens(
                [r.trace.prompt_len + r.position for r in running], padding
            )
            machine.at(now[0])
            shape, catch_up, done = chooser(running, features)
            true_ms = (
                machine.catch_up_ms(features) if catch_up else machine.true_ms(features, shape)
            )
            if shape.speculative and shape not in begun:
                begun.add(shape)
                true_ms *= cfg.cold_step
            measured_ms = machine.measured(true_ms)
            now[0] += measured_ms / 1000.0
            if shape.speculative:
                j = traces.column(shape)
                emitted = [int(r.trace.emitted[r.position, j]) for r in running]
            else:
                emitted = [1] * len(running)
            done(measured_ms, emitted)
            tally.decode_s += measured_ms / 1000.0
            tally.steps += 1
            tally.shapes[str(shape)] += 1
            if keep_timeline:
                tally.timeline.append((now[0] - origin, str(shape)))
            tally.emitted += sum(emitted)
            tally.request_steps += len(running)
            still = []
            for r, e in zip(running, emitted, strict=True):
                r.position += e
                if r.position >= r.trace.answer_len:
                    tally.finished.append((r.first_token_s, now[0], r.trace.answer_len))
                    arrivals.finished(now[0] - origin)
                else:
                    still.append(r)
            running = still

    if cfg.warmup_requests:
        serve(
            drawn[: cfg.warmup_requests],
            _ArrivalSchedule(Arrivals("closed", concurrency=1), rng),
            _Tally(0.0),
        )
    controlled = isinstance(chooser, ControllerChooser)
    if controlled:
        chooser.estimates = _EstimateTally()  # the measured requests' steps only
    tally = _Tally(now[0])
    serve(drawn[cfg.warmup_requests :], _ArrivalSchedule(cfg.arrivals, rng), tally)
    finished = tally.finished
    tpot = [(end - first) * 1000.0 / (n - 1) for first, end, n in finished if n > 1 and end > first]
    output_tokens = sum(n for _, _, n in finished)
    makespan = now[0] - tally.start_s
    steps = tally.steps
    return RunResult(
        policy=policy_name,
        goodput_tok_s=output_tokens / makespan if makespan > 0 else 0.0,
        tpot_ms_p50=float(np.percentile(tpot, 50)) if tpot else 0.0,
        tpot_ms_p99=float(np.percentile(tpot, 99)) if tpot else 0.0,
        accept_len_mean=tally.emitted / tally.request_steps if tally.request_steps else 0.0,
        steps=steps,
        shape_shares={s: n / steps for s, n in sorted(tally.shapes.items())} if steps else {},
        makespan_s=makespan,
        output_tokens=output_tokens,
        decode_s=tally.decode_s,
        decode_tokens=tally.emitted,
        timeline=tuple(tally.timeline),
        estimates=chooser.estimates.result() if controlled else None,
    )


def _padding(profile: StepTimeProfile) -> Any:
    from sglang_adatree.core.features import NO_GRAPHS

    return getattr(profile, "padding", NO_GRAPHS)


class _ArrivalSchedule:
    """Arrival times for ``Arrivals``, generated as the run goes (closed loops need finishes)."""

    def __init__(self, arrivals: Arrivals, rng: np.random.Generator) -> None:
        self.spec = arrivals
        self.rng = rng
        self.next_poisson = 0.0
        self.recorded = sorted(arrivals.times)
        # Closed loop: when each idle client sends its next request.
        self.free_clients = [0.0] * arrivals.concurrency if arrivals.kind == "closed" else []
        self.in_flight = 0  # requests sent and not finished (bursts cap it by the phase)
        self.period = sum(s for s, _ in arrivals.bursts)

    def finished(self, t: float) -> None:
        self.in_flight -= 1
        if self.spec.kind == "closed":
            self.free_clients.append(t)

    def due(self, now: float) -> list[float]:
        """Arrival times at or before ``now`` not handed out yet."""
        out: list[float] = []
        kind = self.spec.kind
        if kind == "closed":
            self.free_clients.sort()
            while self.free_clients and self.free_clients[0] <= now:
                out.append(self.free_clients.pop(0))
        elif kind == "poisson":
            while self.next_poisson <= now:
                out.append(self.next_poisson)
                self.next_poisson += float(self.rng.exponential(1.0 / self.spec.rate_per_s))
        elif kind == "recorded":
            while self.recorded and self.recorded[0] <= now:
                out.append(self.recorded.pop(0))
        else:
            clients = self._clients(now)
            while self.in_flight + len(out) < clients:
                out.append(now)
        self.in_flight += len(out)
        return out

    def next_time(self, now: float) -> float | None:
        """When the next request arrives, for an idle system at ``now``."""
        kind = self.spec.kind
        if kind == "closed":
            return min(self.free_clients) if self.free_clients else None
        if kind == "poisson":
            return self.next_poisson
        if kind == "recorded":
            return self.recorded[0] if self.recorded else None
        start = now - (now % self.period)  # the current round of phases
        for _ in range(2):
            for seconds, clients in self.spec.bursts:
                if clients > 0 and start + seconds > now:
                    return max(start, now)
                start += seconds
        return None

    def _clients(self, t: float) -> int:
        offset = t % self.period
        for seconds, clients in self.spec.bursts:
            if offset < seconds:
                return clients
            offset -= seconds
        return self.spec.bursts[-1][1]


def controller_chooser_factory(
    config: AdaTreeConfig,
    traces: TraceSet,
    configure: Callable[[ControllerChooser, _Machine], None] | None = None,
    profile: StepTimeModel | None = None,
) -> Callable[[_Machine, Callable[[], float]], Chooser]:
    """A ``make_chooser`` that builds a fresh controller for ``config``, priced by the
    deployment's step-time ``profile`` when one is given (``StepController``); ``configure``
    may replace its estimates (the decomposition's truth variants)."""

    def make(machine: _Machine, clock: Callable[[], float]) -> Chooser:
        padding = _padding(machine.profile)
        controller = StepController(config, padding=padding, profile=profile)
        chooser = ControllerChooser(controller, traces, clock, machine.true_ms)
        if configure is not None:
            configure(chooser, machine)
        return chooser

    return make
