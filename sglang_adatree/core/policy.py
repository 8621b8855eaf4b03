"""decide(): the draft-tree shape with the best predicted goodput for this decode step.

Goodput of a candidate shape = ``batch_size * expected emitted tokens per request / predicted
step time``. Each step, in order of precedence:

1. pin: an operator's pinned shape for this batch size wins outright (``DecisionSource.PIN``).
   Pins are checked in the order given (the store lists them newest first); the first that
   covers the batch size wins.
2. warm-up: the first decisions cycle through the candidates in shape order so every shape
   gets measured (``WARMUP``), for ``warmup_steps`` requests' decode steps (a step of a batch of
   B counts B) and at least one round of the candidates (or ``warmup_steps`` steps, the fewer).
   A step of a large batch measures a shape's acceptance on every request at once, and running a
   slow shape costs the whole batch: counted in steps, a warm-up long enough at batch size 1
   would run the largest trees through batches of 16-64 for as many steps, where one round
   already measures each shape on hundreds of requests. A server priced by the deployment's
   step-time profile runs no warm-up (``controller.StepController``).
3. exploration: on a deterministic ``explore_fraction`` of steps (a phase drawn from
   ``explore_seed``, then evenly spaced by the step counter) another shape runs
   (``EXPLORE``): a shape the decision turns on (a stale estimate of a near tie is what keeps
   the policy on the wrong side of it: one low estimate of the shape that would win is never
   re-measured while the other runs), chosen by its predicted goodput with its price lowered by
   ``explore_optimism`` standard deviations of how far it may be off against the chosen
   shape's: the runner-up while every price is known, a shape left unrun for a while once its
   price may be off (``_explored``). Only candidates whose predicted goodput is within
   ``explore_max_loss`` (relative) of the best are eligible, so an exploring step costs at
   most that share of a step: measured on a CPU, unbounded exploration spent 2% of the steps
   on trees two to four times slower than plain decoding, 3-5% of the throughput. A shape
   predicted that far off would have to be mispredicted by as much to win.

   An exploring step taken where no speculation was chosen (from a decline) is also bounded by
   what such steps have measurably lost (``_explores_from``): its predicted loss comes from the
   estimates that declined, and a request declined for being hard has an estimate drifting
   back up (``RequestAcceptance.age``). Where speculation never pays, as with the standalone
   draft on a CPU, those steps lost a quarter of no speculation's goodput against about a
   tenth predicted, each behind a catch-up step. Their measured loss against no speculation's
   predicted price is kept as a moving mean; while it exceeds ``explore_decline_budget`` they
   run on the budget over that loss of their scheduled steps (evenly, by a credit), and on
   every one while it is within the budget.
4. otherwise the goodput argmax (``MODEL`` when a trained policy version is active,
   ``FALLBACK`` for the analytic model). Speculative shapes must beat no speculation by
   ``no_spec_margin``; the current shape is kept unless the best beats it by ``min_gain``
   (hysteresis: a decision does not flap on its estimates' noise). A decision to stop
   speculating that rests on the draft's confidence in this step's token alone, where the
   requests' own acceptance would speculate (a dip), is charged the catch-up step it puts
   before the next speculative step (``price_catch_up``, ``_dip_shape``): the next token is
   another, which the draft is likelier to be sure of, and resuming there runs a catch-up
   step first, two steps without speculation where the decision priced one. A shallow dip
   then speculates, a deep one still declines.

   A new batch, one none of whose requests ran in the step before (at concurrency 1, every
   request), speculates for its first ``new_batch_steps`` steps unless speculating is predicted
   to lose more than ``new_batch_max_loss`` against no speculation: neither the margin nor a
   current choice of no speculation holds it back; the hysteresis between speculative shapes
   still does. A request's acceptance differs from the next one's far more than the shapes a
   decision turns on differ, and only its speculative steps measure it (``RequestAcceptance``):
   a new request served without speculation from its first step would be judged for its whole
   answer by the requests before it. So it starts speculating, and the margin and the hysteresis
   decide from its own steps when to stop. One step is not enough to decide that: a short chain
   emits a single token on about half its steps whatever the request, and one such step moves
   the request's factor far enough to flip a predicted gain of several percent. And a new
   request's estimate is the requests' before it, learnt only from their speculative steps:
   after a stretch of hard requests it can sit just below paying, and if only a predicted gain
   started a request speculating, a server at concurrency 1 would stop measuring, and serve the
   easy requests after them without speculation too (until exploration measured them). A bounded
   predicted loss on a few steps a request keeps it measuring, at the price of those steps where
   speculation does not pay: off by default, since where speculation barely pays the served
   probes cost more than they found (``docs/results.md``). What a probe is worth depends on
   how far the new requests may sit from the estimate, which the requests before them measure
   (``RequestAcceptance.spread``): with ``new_batch_probe`` a new batch speculates at a
   predicted loss (``PROBE``) when the gain of deciding the rest of its requests' steps on
   what its first steps measure outweighs that loss (``_probe_shape``). Where requests accept
   alike, or speculation is far from paying, it does not probe. Leaving no speculation costs a
   catch-up step only for requests it served; a new batch's drafts are up to date after their
   prefill. Carried across requests, the margin and the hysteresis together would keep a server
   at concurrency 1 without speculation until a predicted gain of about 8%: a deployment where
   speculation gains 5-10% would seldom speculate again once it stopped.

Every step, whatever its source, reads each shape's expected emitted tokens capped at those of
every shape that dominates it (``_in_order``): the estimates never rank a chain above the tree
that holds it. A batch's expectation scales them by its requests' own acceptance factors
(``RequestAcceptance``). For requests whose draft's first layer (its top-k probabilities at
the next token) is known, each shape's estimate is scaled by the factor of the draft's
confidence (``core.confidence``), and with ``draft_first_layer`` each shape's tree is priced
with each first-layer branch weighed by the draft's own chance of its first token
(``_rows``: a tree's second-ranked tokens carry a step the draft is unsure of, a chain's do
not): then each request's expectation is capped at what the shape can emit before the batch's
mean is taken.

The step controller adds one source of its own, ``CATCH_UP`` (``controller.StepController``): a
step without speculation that brings the draft up to date before a speculative decision runs.

Ties go to the earlier shape in the candidate order. Nothing reads the clock or unseeded
randomness: given the same features and the same observation history, every tensor-parallel
rank decides the same shape, provided each rank is fed the same measured step times (measure
on one rank and broadcast).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist

import numpy as np

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.acceptance import (
    AcceptanceEstimator,
    AcceptedPathStats,
    RequestAcceptance,
    host_lists,
)
from sglang_adatree.core.confidence import ConfidenceAcceptance, FirstLayer, confidence_of
from sglang_adatree.core.cost_model import CostModel, PriceSplit
from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.shapes import TreeShape


class DecisionSource(StrEnum):
    """Why a step ran its shape; the values are the telemetry column's and the charts' words."""

    PIN = "pin"
    MODEL = "model"
    FALLBACK = "fallback"
    EXPLORE = "explore"
    # A new batch's step that speculates although speculating is predicted to lose: what it
    # measures of the batch's requests is worth the loss (``Policy._probe_shape``).
    PROBE = "probe"
    WARMUP = "warmup"
    # A step without speculation that runs the draft's extend, so that the speculative decision
    # after it drafts from a caught-up draft (``controller.StepController``).
    CATCH_UP = "catch-up"

    @property
    def teaches_cost_model(self) -> bool:
        """Whether a step of this source measures the price of its shape. A catch-up step costs
        no speculation plus the draft's extend: taught as no speculation's price, it would
        make plain decoding look dearer."""
        return self is not DecisionSource.CATCH_UP


# Sources whose steps no cost model learns from: the online refit, retrain and the
# dashboard's cost page all leave them out (``telemetry.learning``).
UNPRICED_SOURCES: tuple[DecisionSource, ...] = tuple(
    s for s in DecisionSource if not s.teaches_cost_model
)


def teaches_cost_model(source: DecisionSource | str, measured_ms: float | None) -> bool:
    """Whether a finished step may teach a cost model: a source that prices its shape and a
    measured step time."""
    if not isinstance(source, DecisionSource):
        source = DecisionSource(source)
    return source.teaches_cost_model and measured_ms is not None and measured_ms > 0


@dataclass(frozen=True)
class Decision:
    """The shape for one decode step, why it was chosen, and what the policy expected."""

    shape: TreeShape
    source: DecisionSource
    predicted_ms: float  # step time
    predicted_emitted: float  # emitted tokens per request
    # The runner-up: of the other candidates, the one with the highest predicted goodput
    # (emitted tokens over step time), with what was predicted for it. It is what the
    # telemetry needs to tell a rival that was underrated from one that was not close; None
    # where the rule priced no other shape.
    runner_up: TreeShape | None = None
    runner_up_ms: float | None = None
    runner_up_emitted: float | None = None
    # How the machine priced steps against the step-time model when the step was decided
    # (the cost model's residual correction); None under a cost model without one.
    split: PriceSplit | None = None


def price_split(cost_model: object) -> PriceSplit | None:
    """``cost_model``'s ``PriceSplit`` as it stands; None for one without a residual
    correction (the lab's true step times)."""
    split = getattr(cost_model, "split", None)
    return None if split is None else split()


@dataclass(frozen=True)
class Pin:
    """Run ``shape`` for batches of ``min_batch_size .. max_batch_size`` (None: unbounded)."""

    shape: TreeShape
    min_batch_size: int | None = None
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        lo, hi = self.min_batch_size, self.max_batch_size
        if (lo is not None and lo < 1) or (hi is not None and hi < 1):
            raise ValueError(f"pin batch sizes must be >= 1: {self}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"pin min_batch_size {lo} > max_batch_size {hi}")

    def covers(self, batch_size: int) -> bool:
        lo, hi = self.min_batch_size, self.max_batch_size
        return (lo is None or batch_size >= lo) and (hi is None or batch_size <= hi)


_STANDARD_NORMAL = NormalDist()
# Weight of the newest exploring step from a decline in the moving mean of their loss.
DECLINE_EXPLORE_WEIGHT = 0.2


@dataclass(frozen=True)
class _DeclineExplore:
    """An exploring step decided from a decline, awaiting its outcome."""

    request_ids: tuple[str, ...]
    shape: TreeShape
    plain_ms: float  # no speculation's predicted time for the step


class Policy:
    """Chooses a shape per decode step; see the module docstring."""

    def __init__(
        self,
        config: AdaTreeConfig,
        cost_model: CostModel,
        acceptance: AcceptanceEstimator,
        policy_version: int | None = None,
    ) -> None:
        self.config = config
        self.candidates: tuple[TreeShape, ...] = tuple(config.candidate_shapes)
        self._index = {s: i for i, s in enumerate(self.candidates)}
        self.cost_model = cost_model
        self.acceptance = acceptance
        self.policy_version = policy_version
        self.pins: tuple[Pin, ...] = ()
        self.step = 0
        self.current: TreeShape | None = None
        # A decision's per-candidate values are plain lists, not arrays: in a CPU server it
        # runs in caches the forward has just swept, where the interpreter's loop runs warm
        # and each array operation costs tens of microseconds (``core.cost_model``).
        self.measured = [0] * len(self.candidates)  # steps observed
        # Dividing speculative goodput by (1 + margin) makes no speculation win unless beaten.
        self._margin = [
            1.0 / (1.0 + config.no_spec_margin) if s.speculative else 1.0 for s in self.candidates
        ]
        # A new batch's speculative goodput counts 1 / (1 - max loss): speculation is run
        # unless predicted to lose more than that.
        self._probe = [
            1.0 / (1.0 - config.new_batch_max_loss) if s.speculative else 1.0
            for s in self.candidates
        ]
        self._warmup_steps = 0  # steps the warm-up has run (pinned steps are not among them)
        self._warmup_request_steps = 0  # requests' decode steps the warm-up has run
        self._warmup_end = -1  # the first step after the warm-up; -1 while it lasts
        self._explore_phase = random.Random(config.explore_seed).random()
        # Exploring steps from a decline (``_explores_from``): the one awaiting its outcome,
        # the moving mean of their measured loss against no speculation (None before the
        # first), and the credit that spaces them out.
        self._decline_explore: _DeclineExplore | None = None
        self.decline_explore_loss: float | None = None
        self._decline_explore_credit = 1.0
        # Under the draft's first layer a step can expect a tenth of a token: each factor is
        # then a ratio of sums (``RequestAcceptance``).
        first_layer = bool(config.draft_first_layer)
        self.requests = RequestAcceptance(
            config.request_prior_steps, config.request_keep, ratio_of_sums=first_layer
        )
        self.confidence = ConfidenceAcceptance(ratio_of_sums=first_layer)
        # Per candidate: the most a step can emit; the speculative candidates, and the others.
        self._max_emitted = [s.steps + 1.0 for s in self.candidates]
        self._speculative = [i for i, s in enumerate(self.candidates) if s.speculative]
        self._plain = [i for i, s in enumerate(self.candidates) if not s.speculative]
        # [candidates, candidates]: whether the column's shape dominates the row's.
        self._dominated_by = np.array(
            [[a.dominates(b) for a in self.candidates] for b in self.candidates], dtype=bool
        )
        self._ordered: tuple[np.ndarray, list[float]] | None = None  # (estimates, ordered)
        self._last_batch: frozenset[str] = frozenset()  # the requests of the step before
        self._new_batch_left = 0  # steps still decided as a new batch's (``new_batch_steps``)
        # (estimator revision, [candidates] the shapes' correction factors): ``_corrections``.
        self._kept_corrections: tuple[int, np.ndarray] = (-1, np.ones(len(self.candidates)))
        self._max_emitted_array = np.array(self._max_emitted)  # [candidates]

    @property
    def reads_confidence(self) -> bool:
        """Whether decisions read the draft's confidence (``draft_confidence``)."""
        return bool(self.config.draft_confidence)

    def set_pins(self, pins: Sequence[Pin]) -> None:
        """Replace the pins, in precedence order; each pinned shape must be a candidate (its
        runtime state is built at start-up)."""
        for pin in pins:
            if pin.shape not in self._index:
                raise ValueError(f"pinned shape {pin.shape} is not a candidate shape")
        self.pins = tuple(pins)

    def set_cost_model(self, cost_model: CostModel, policy_version: int | None) -> None:
        """Swap in a newly activated policy version (None: back to the analytic fallback)."""
        self.cost_model = cost_model
        self.policy_version = policy_version

    def decide(
        self,
        features: StepFeatures,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> Decision:
        """The shape for this step over the requests ``request_ids`` (their acceptance so far
        scales the estimate; none given: the estimator's alone), whose drafts' first layers
        (their top-k probabilities at the next token, ``core.confidence``) are ``confidence``
        ``[batch]`` (None where unknown)."""
        step = self.step
        self.step += 1
        # Without request ids a batch cannot be told new: it is decided as a continuing one.
        if request_ids and self._last_batch.isdisjoint(request_ids):
            self._new_batch_left = self.config.new_batch_steps
        if request_ids and self._last_batch:
            self.requests.close(self._last_batch.difference(request_ids))
        probe_steps = self._new_batch_left
        new_batch = bool(request_ids) and self._new_batch_left > 0
        self._new_batch_left = max(self._new_batch_left - 1, 0)
        self._last_batch = frozenset(request_ids)
        times, emitted = self._predicted(features, request_ids, confidence)
        for pin in self.pins:
            if pin.covers(features.batch_size):
                return self._decision(pin.shape, DecisionSource.PIN, times, emitted)
        warming = self._warming(step, features.batch_size)
        if warming is not None:
            return self._decision(warming, DecisionSource.WARMUP, times, emitted)
        # Goodput up to the batch size, which is common to all candidates.
        weights = self._probe if new_batch else self._margin
        score = [e * w / t for e, w, t in zip(emitted, weights, times, strict=True)]
        current = None
        if self.current is not None and (self.current.speculative or not new_batch):
            current = self._index.get(self.current)
        best = self._held(score, current)
        source = DecisionSource.FALLBACK if self.policy_version is None else DecisionSource.MODEL
        # A dip's decline is charged its catch-up (``_dip_shape``) where it skips the draft's
        # extend, and only when leaving speculation: once declined, the catch-up is owed.
        if (
            self.config.price_catch_up
            and self.config.skip_idle_draft_extend
            and not self.candidates[best].speculative
            and current is not None
            and self.candidates[current].speculative
        ):
            dip = self._dip_shape(request_ids, confidence, times, weights, score, best, current)
            if dip is not None:
                best = dip
        if new_batch and self.config.new_batch_probe and not self.candidates[best].speculative:
            probe = self._probe_shape(score, emitted, len(request_ids), probe_steps)
            if probe is not None:
                best, source = self._index[probe], DecisionSource.PROBE
        if self._explores(step - self._warmup_end) and self._explores_from(best):
            explored = self._explored(features, times, emitted, best)
            if explored.speculative and not self.candidates[best].speculative:
                self._decline_explore = _DeclineExplore(tuple(request_ids), explored, times[best])
            return self._decision(explored, DecisionSource.EXPLORE, times, emitted)
        self.current = self.candidates[best]
        return self._decision(self.current, source, times, emitted)

    def _held(self, score: list[float], current: int | None) -> int:
        """The candidate with the best ``score`` ``[candidates]`` (the first of equals), or
        ``current`` unless the best beats it by ``min_gain`` (the hysteresis)."""
        best = score.index(max(score))
        if current is not None and score[best] <= score[current] * (1.0 + self.config.min_gain):
            return current
        return best

    def _dip_shape(
        self,
        request_ids: Sequence[str],
        confidence: Sequence[FirstLayer | None] | None,
        times: list[float],
        weights: list[float],
        score: list[float],
        declined: int,
        current: int,
    ) -> int | None:
        """The speculative candidate a dip runs, None where declining pays. A dip: the decision
        to stop speculating (``declined``, from the speculative ``current``) rests on the
        draft's confidence in this step's token alone, while the requests' own acceptance, the
        confidence left out, would speculate. Declining then puts a catch-up step before the
        next speculative step: one token for about a step without speculation's time, where
        the speculation it delays would emit at its own rate. That step's time beyond its
        token's worth at that rate is charged to the decline."""
        if self._confidence_factors(request_ids, confidence) is None:
            return None  # the decision did not read the confidence
        emitted = self._batch_emitted(request_ids)  # the confidence left out
        plain = [e * w / t for e, w, t in zip(emitted, weights, times, strict=True)]
        resumed = self._held(plain, current)
        if not self.candidates[resumed].speculative:
            return None
        catch_up = max(times[declined] - times[resumed] / emitted[resumed], 0.0)
        best = max(self._speculative, key=score.__getitem__)
        charged = score[declined] * times[declined] / (times[declined] + catch_up)
        return best if score[best] > charged else None

    def _probe_shape(
        self, score: list[float], emitted: list[float], batch: int, steps: int
    ) -> TreeShape | None:
        """The speculative shape a new batch of ``batch`` requests runs although speculating is
        predicted to lose, when what its next ``steps`` steps would tell about its requests is
        worth that loss over the rest of its requests' steps; None when it is not.

        The batch's mean factor differs from the estimator's by the spread between requests
        (``RequestAcceptance.spread``), divided by the batch size (``b``). ``steps`` verify
        steps resolve the part of it their noise leaves: the spread of its posterior mean,
        ``b / sqrt(b + within / (batch * steps))``. Goodput against no speculation moves
        with the factor by ``slope``, so the gain of deciding the rest of the requests' steps
        knowing it is an option on a normal variable (the expected positive part of the gain);
        the probe pays when that, over the steps a request has left, outweighs the predicted
        loss of the probing steps. With no spread it never probes: a batch then speculates only
        if speculating is predicted to pay."""
        spread = self.requests.spread()
        if spread is None or spread.between <= 0.0 or steps <= 0:
            return None
        if not self._speculative:
            return None
        j = max(self._speculative, key=score.__getitem__)  # the first of equals
        plain = max(score[i] for i in self._plain)
        gain = score[j] / plain - 1.0  # < 0 here: predicted to lose
        between = spread.between / batch
        resolved = between / math.sqrt(between + spread.within / (batch * steps))
        slope = (1.0 + gain) * (emitted[j] - 1.0) / emitted[j]
        sd = slope * resolved
        if sd <= 0.0:
            return None
        z = gain / sd
        # E[max(0, gain + sd * Z)] for a standard normal Z.
        option = gain * _STANDARD_NORMAL.cdf(z) + sd * _STANDARD_NORMAL.pdf(z)
        rest = max(spread.steps - steps, 0.0)
        return self.candidates[j] if steps * gain + rest * option > 0.0 else None

    def predictions(
        self,
        features: StepFeatures,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """What ``decide`` reads for this batch: ``[candidates]`` predicted step times (ms) and
        ``[candidates]`` expected emitted tokens per request, in candidate order."""
        times, emitted = self._predicted(features, request_ids, confidence)
        return np.array(times), np.array(emitted)

    def _predicted(
        self,
        features: StepFeatures,
        request_ids: Sequence[str],
        confidence: Sequence[FirstLayer | None] | None,
    ) -> tuple[list[float], list[float]]:
        """``predictions`` as lists, as ``decide`` reads them."""
        times = self.cost_model.predict_ms_list(features, self.candidates)
        return times, self._batch_emitted(request_ids, confidence)

    def _confidence_factors(
        self, request_ids: Sequence[str], confidence: Sequence[FirstLayer | None] | None
    ) -> list[float] | None:
        """``[batch]`` the confidence factors of the batch's requests; None when none is known
        or the policy does not read them (``draft_confidence``)."""
        if not self.reads_confidence or confidence is None or not request_ids:
            return None
        if len(confidence) != len(request_ids):
            raise ValueError(f"{len(confidence)} confidences for {len(request_ids)} requests")
        if all(q is None for q in confidence):
            return None
        return self.confidence.factors([confidence_of(q) for q in confidence])

    def observe(
        self,
        features: StepFeatures,
        shape: TreeShape,
        measured_ms: float,
        stats: AcceptedPathStats | None = None,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> None:
        """Feed back one verified step: its measured time and, if it speculated, its paths (one
        row per request of ``request_ids``, whose drafts' first layers were ``confidence``)."""
        self.cost_model.observe(features, shape, measured_ms)
        accepted = None  # [batch] accepted draft tokens per request, for a speculative step
        if stats is not None and shape.speculative:
            accepted = [sum(rank >= 0 for rank in row) for row in host_lists(stats.accepted_rank)]
        if self._decline_explore is not None:
            self._learn_decline_explore(shape, measured_ms, request_ids, accepted)
        if stats is not None and shape.speculative:
            # The requests' level before this step, their confidence included: the shape is
            # judged against it.
            levels = self._levels(request_ids)  # [batch]
            scaled = self._confidence_factors(request_ids, confidence)  # [batch] or None
            each = (
                levels if scaled is None else [f * c for f, c in zip(levels, scaled, strict=True)]
            )
            factor = sum(each) / len(each) if each else 1.0  # as RequestAcceptance.batch_factor
            if request_ids:
                assert accepted is not None
                if scaled is None:
                    expected = self.acceptance.expected_emitted(shape) - 1.0
                    self.requests.observe(request_ids, accepted, expected)
                else:
                    assert confidence is not None
                    # Each request's expectation (under its draft's first layer with
                    # ``draft_first_layer``); each of the two factors is learnt against the
                    # other: a request's level net of its steps' confidence, a bin's net of its
                    # requests' levels.
                    if self.config.draft_first_layer:
                        j = self._index[shape]
                        emitted = self._in_order(
                            self.acceptance.expected_emitted_many(self.candidates)
                        )
                        each_expected = [row[j] - 1.0 for row in self._rows(confidence, emitted)]
                    else:
                        each_expected = [self.acceptance.expected_emitted(shape) - 1.0] * len(
                            request_ids
                        )
                    self.requests.observe(
                        request_ids,
                        accepted,
                        [x * c for x, c in zip(each_expected, scaled, strict=True)],
                    )
                    self.confidence.observe(
                        [confidence_of(q) for q in confidence],
                        accepted,
                        [x * f for x, f in zip(each_expected, levels, strict=True)],
                    )
            self.acceptance.observe(shape, stats.num_children, stats.accepted_rank, factor)
        elif request_ids:
            self.requests.age(request_ids)
        i = self._index.get(shape)
        if i is not None:
            self.measured[i] += 1

    def _batch_emitted(
        self, request_ids: Sequence[str], confidence: Sequence[FirstLayer | None] | None = None
    ) -> list[float]:
        """``[candidates]`` expected emitted tokens per request of this batch."""
        emitted = self._in_order(self.acceptance.expected_emitted_many(self.candidates))
        scaled = self._confidence_factors(request_ids, confidence)
        if scaled is not None:
            assert confidence is not None
            # Each request's own expectation under its draft's first layer, capped at what a
            # step of the shape can emit before the mean: a sure draft's factor would otherwise
            # lend an unsure one's request tokens past its cap.
            levels = [f * c for f, c in zip(self._levels(request_ids), scaled, strict=True)]
            rows = self._rows(confidence, emitted)  # [batch][candidates]
            n = len(levels)
            return [
                sum(
                    min(max(1.0 + g * (row[j] - 1.0), 1.0), most)
                    for g, row in zip(levels, rows, strict=True)
                )
                / n
                for j, most in enumerate(self._max_emitted)
            ]
        factor = self.requests.batch_factor(request_ids)
        if factor == 1.0:
            return emitted
        return [
            min(max(1.0 + factor * (e - 1.0), 1.0), most)
            for e, most in zip(emitted, self._max_emitted, strict=True)
        ]

    def request_emitted(
        self,
        request_ids: Sequence[str],
        confidence: Sequence[FirstLayer | None] | None = None,
        *,
        per_request: bool = True,
    ) -> np.ndarray:
        """``[batch, candidates]`` each request's expected emitted tokens under each candidate:
        ``1 + f_r * c(q_r) * (E_r - 1)`` capped at what a step of the shape can emit, the
        request's factor ``f_r``, its confidence factor ``c(q_r)`` and the shape's estimate
        under its draft's first layer ``E_r`` as ``decide`` reads them (``draft_confidence``,
        ``draft_first_layer``). ``per_request=False``: the shape's estimate ``E`` alone, the
        same for every request, as the policy predicted before it kept anything per request
        or per step (the lab's acceptance error measures the two against each other)."""
        emitted = self._in_order(self.acceptance.expected_emitted_many(self.candidates))
        if not per_request:
            return np.tile(np.asarray(emitted), (len(request_ids), 1))
        levels = self._levels(request_ids)  # [batch]
        scaled = self._confidence_factors(request_ids, confidence)  # [batch] or None
        expected = np.asarray(emitted)[None, :]  # [1, candidates]
        if scaled is not None:
            assert confidence is not None
            levels = [f * c for f, c in zip(levels, scaled, strict=True)]
            expected = np.asarray(self._rows(confidence, emitted))  # [batch, candidates]
        gains = np.asarray(levels)[:, None]  # [batch, 1]
        return np.clip(1.0 + gains * (expected - 1.0), 1.0, np.asarray(self._max_emitted))

    def _rows(
        self, confidence: Sequence[FirstLayer | None], emitted: list[float]
    ) -> list[list[float]]:
        """``[batch][candidates]`` each request's expected emitted tokens before its factors:
        under its draft's first layer where that is known (``1 + q @ W``,
        ``AcceptanceEstimator.first_layer_weights``, times the shape's correction factor,
        capped in order as ``_in_order`` does; a rank past what the engine handed over counts
        nothing; with ``draft_first_layer`` off, the first layer is not read), ``emitted`` (the
        shapes' estimates, ``[candidates]``) where not."""
        known = [q for q in confidence if q is not None]
        if not self.config.draft_first_layer or not known:
            return [emitted] * len(confidence)
        weights = self.acceptance.first_layer_weights(self.candidates)  # [ranks, candidates]
        width = weights.shape[0]
        layers = np.zeros((len(known), width))  # [known, ranks]
        for i, q in enumerate(known):
            n = min(len(q), width)
            layers[i, :n] = q[:n]
        rows = (1.0 + layers @ weights) * self._corrections()  # [known, candidates]
        rows = np.clip(rows, 1.0, self._max_emitted_array)
        ceiling = np.where(self._dominated_by[None, :, :], rows[:, None, :], np.inf).min(axis=2)
        computed = iter(np.minimum(rows, ceiling).tolist())
        return [emitted if q is None else next(computed) for q in confidence]

    def _corrections(self) -> np.ndarray:
        """``[candidates]`` each shape's correction factor (1 without speculation), kept until
        the estimator refreshes."""
        revision, kept = self._kept_corrections
        if revision != self.acceptance.revision:
            kept = np.array(
                [self.acceptance.correction(s) if s.speculative else 1.0 for s in self.candidates]
            )
            self._kept_corrections = (self.acceptance.revision, kept)
        return kept

    def _levels(self, request_ids: Sequence[str]) -> list[float]:
        """``[batch]`` each request's acceptance factor (``RequestAcceptance``)."""
        return [self.requests.factor(r) for r in request_ids]

    def _in_order(self, emitted: np.ndarray) -> list[float]:
        """``emitted`` ``[candidates]`` with each shape capped at the estimate of every shape
        that dominates it (``TreeShape.dominates``).

        Each shape's estimate carries its own correction factor, measured on that shape's own
        steps, so two estimates can cross: a chain read above the tree that holds it. The truth
        does not cross (the positional model never ranks them so, and in every trace set of
        the policy lab the dominating shape emits more on average), so a crossing is an error
        in one of the two. The policy runs the shape with the highest estimate, so the errors
        it acts on are the ones upwards, and a cheaper shape read above a shape that dominates
        it is one: the cap removes it. Lifting the dominating shape instead, or pooling the two
        by their evidence, gained less in the lab than the cap
        (``docs/notes/2026-12-05-estimates-in-order.md``).

        Domination is transitive, so one pass against the uncapped estimates is the fixed
        point. The estimator returns the same array until it refreshes, so the result is kept
        for it: read it, do not write to it."""
        ordered = self._ordered
        if ordered is not None and ordered[0] is emitted:
            return ordered[1]
        ceiling = np.where(self._dominated_by, emitted[None, :], np.inf).min(axis=1)
        capped = np.minimum(emitted, ceiling).tolist()  # [candidates]
        self._ordered = (emitted, capped)
        return capped

    def _warming(self, step: int, batch_size: int) -> TreeShape | None:
        """The warm-up's shape for ``step``, None once the warm-up is over: it lasts
        ``warmup_steps`` requests' decode steps (a step of a batch of B counts B), and at least
        one round of the candidates or ``warmup_steps`` steps, the fewer. Each candidate runs
        ``warmup_run_steps`` steps in a row."""
        if self._warmup_end >= 0:
            return None
        warmup, done = self.config.warmup_steps, self._warmup_steps
        run = self.config.warmup_run_steps
        if done < min(warmup, run * len(self.candidates)) or self._warmup_request_steps < warmup:
            self._warmup_steps += 1
            self._warmup_request_steps += batch_size
            return self.candidates[(done // run) % len(self.candidates)]
        self._warmup_end = step
        return None

    def _explores_from(self, chosen: int) -> bool:
        """Whether a scheduled exploring step runs where ``chosen`` was decided: always from a
        speculative shape; from a decline on the share ``explore_decline_budget`` over the
        measured loss of such steps of the schedule (all while that loss is within the
        budget), spaced evenly by a credit."""
        if self.candidates[chosen].speculative:
            return True
        loss, budget = self.decline_explore_loss, self.config.explore_decline_budget
        share = 1.0 if loss is None or loss <= budget else budget / loss
        credit = self._decline_explore_credit + share
        runs = credit >= 1.0
        self._decline_explore_credit = credit - 1.0 if runs else credit
        return runs

    def _learn_decline_explore(
        self,
        shape: TreeShape,
        measured_ms: float,
        request_ids: Sequence[str],
        accepted: list[int] | None,
    ) -> None:
        """An observed step of ``request_ids``: if it is the exploring step from a decline
        awaiting its outcome, its loss against no speculation's predicted price joins the
        moving mean. A different shape over the same requests means that step did not run (a
        held decision dropped): it is forgotten."""
        pending = self._decline_explore
        if pending is None or pending.request_ids != tuple(request_ids):
            return
        self._decline_explore = None
        if shape != pending.shape or not accepted or measured_ms <= 0.0:
            return
        # Tokens the step emitted over its batch, against one per request at no speculation's
        # price: each request's accepted draft tokens and one.
        batch = len(accepted)
        loss = 1.0 - ((sum(accepted) + batch) / measured_ms) / (batch / pending.plain_ms)
        old = self.decline_explore_loss
        self.decline_explore_loss = (
            loss if old is None else old + DECLINE_EXPLORE_WEIGHT * (loss - old)
        )

    def _explores(self, k: int) -> bool:
        """True on about ``explore_fraction`` of steps, evenly spaced after the seeded phase."""
        f = self.config.explore_fraction
        return f > 0 and math.floor(k * f + self._explore_phase) > math.floor(
            (k - 1) * f + self._explore_phase
        )

    def _explored(
        self, features: StepFeatures, times: list[float], emitted: list[float], chosen: int
    ) -> TreeShape:
        """The shape an exploring step runs instead of ``chosen``: of the candidates whose
        predicted goodput is within ``explore_max_loss`` of the best, the one whose goodput is
        highest with its price lowered by ``explore_optimism`` standard deviations of how far
        it may be off against the chosen shape's (``ResidualCorrection.relative_sd``);
        ``chosen`` itself when no other one is eligible.

        A shape's price relative to the chosen one is measured only where the two run close
        together: while one shape runs, its steps set the machine's speed. The policy leaves a
        shape when its price reads high, on a few slow steps of its own as well as on a real
        change, and nothing prices it again until it runs: on the second CPU the tree 2,2,4
        read 6-21% dear for hundreds of steps while other shapes ran
        (``docs/notes/2026-12-07-exploration-by-price-uncertainty.md``). So an exploring step
        goes to the near tie whose price may be furthest off in its favour: the runner-up
        while every price is known, a shape left unrun for a while once its part has walked
        (``PART_WALK``). A cost model without a residual correction (the lab's true step times)
        explores the runner-up."""
        goodput = [e / t for e, t in zip(emitted, times, strict=True)]  # [candidates]
        floor = (1.0 - self.config.explore_max_loss) * max(goodput)
        eligible = [i for i, g in enumerate(goodput) if g >= floor and i != chosen]
        if not eligible:
            return self.candidates[chosen]
        kappa = self.config.explore_optimism
        relative_sd = getattr(self.cost_model, "relative_sd", None)
        if kappa > 0.0 and relative_sd is not None:
            sds = relative_sd(features, self.candidates, self.candidates[chosen])
            goodput = [g * math.exp(kappa * sd) for g, sd in zip(goodput, sds, strict=True)]
        return self.candidates[max(eligible, key=goodput.__getitem__)]  # the first of equals

    def _decision(
        self, shape: TreeShape, source: DecisionSource, times: list[float], emitted: list[float]
    ) -> Decision:
        i = self._index[shape]
        goodput = [e / t for e, t in zip(emitted, times, strict=True)]  # [candidates]
        goodput[i] = -math.inf
        j = goodput.index(max(goodput))
        split = price_split(self.cost_model)
        if j == i:  # a single candidate
            return Decision(shape, source, times[i], emitted[i], split=split)
        return Decision(
            shape, source, times[i], emitted[i], self.candidates[j], times[j], emitted[j], split
        )
