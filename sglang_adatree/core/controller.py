"""One decode step, one object: the step controller every driver of adatree's loop uses.

A driver (the SGLang worker, a test, a simulation) calls two methods per decode step:

* ``begin(BatchView) -> StepTicket`` before the step: the batch's features, the policy's
  decision (or first a catch-up step, below), and whether the step skips the draft's extend;
* ``finish(ticket, StepOutcome)`` once the step's accept counts and measured time are known
  (one step late under SGLang's overlap scheduler). The ticket is the match: a completion is
  never paired with a step by its place in a queue. Tickets still open when a later one
  finishes never will (completions arrive in launch order): they are dropped and counted, and
  cannot lend their decision or timing to another step's record.

Between the two, nothing is shared with the driver but the ticket. ``finish`` teaches the policy
(cost model and acceptance estimates), keeps the measured step for refits
(``refit.MeasuredSteps``), and hands a ``StepReport`` to each sink the driver wired in (the
telemetry writer, the Prometheus series); the controller imports neither.

Operator control and new cost models arrive as ``ControlUpdate`` values through ``apply`` (any
thread), and take effect at the next ``begin``: a step boundary. The first analytic refit is the
controller's own (``_first_refit``); the later ones come from the control poller. A controller
given the deployment's step-time profile prices by it instead, never refits (``refit``) and
runs no warm-up: the policy decides from the first step.

Draft catch-up: with ``skip_idle_draft_extend`` a step without speculation skips the draft's
extend, so the draft of every request in that batch is one token behind and its next draft
input is a placeholder (a speculative step would emit exactly one token for it). The controller
remembers those requests; when the policy then decides to speculate over any of them, the step
runs as a ``catch-up`` (no speculation, with the draft's extend) and the decision is held for
the next step. The held decision runs there, without a new policy decision in between, if that
step continues the same batch (every context one token longer) and no control update came in
between; otherwise it is dropped (a pin must win at once, and a new batch gets its own
decision). A decision of the goodput rule gives way to a new one where the policy reads the
draft's confidence (``core.confidence``): the catch-up has just made it known, and a step the
draft is unsure of is one not to speculate on. Catch-up steps are not policy decisions and
teach no cost model.

Tensor parallelism: only rank 0 holds a controller; ``plan_on_every_rank`` broadcasts its
``StepPlan`` so every rank runs the same shape.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from sglang_adatree.core.acceptance import AcceptanceEstimator, AcceptedPathStats, accepted_counts
from sglang_adatree.core.confidence import FirstLayer
from sglang_adatree.core.cost_model import OnlineCostModel, StepTimeModel, starting_cost_model
from sglang_adatree.core.features import NO_GRAPHS, GraphPadding, StepFeatures
from sglang_adatree.core.policy import (
    Decision,
    DecisionSource,
    Pin,
    Policy,
    price_split,
    teaches_cost_model,
)
from sglang_adatree.core.refit import MeasuredSteps
from sglang_adatree.core.shapes import NO_SPEC, TreeShape

logger = logging.getLogger(__name__)

# Open tickets kept; a driver that launches more steps than this without finishing any has lost
# their outcomes (under overlap scheduling at most two are open).
MAX_OPEN_TICKETS = 64


@dataclass(frozen=True)
class BatchView:
    """What the controller needs to know about a decode batch."""

    request_ids: tuple[str, ...]  # [batch]
    context_lens: tuple[int, ...]  # [batch] prompt + output tokens so far
    # [batch] the draft's first layer for each request (``core.confidence.FirstLayer``): the
    # probabilities of the top-k tokens it will propose first, in descending order, from the
    # draft's extend before this step; the first is its confidence. None: not handed over. A
    # request whose draft is behind has none, whatever the engine holds for it.
    draft_confidence: tuple[FirstLayer, ...] | None = None

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.context_lens) or not self.request_ids:
            raise ValueError(
                f"a batch needs one context length per request and at least one request: {self}"
            )
        if self.draft_confidence is not None and (
            len(self.draft_confidence) != len(self.request_ids) or not all(self.draft_confidence)
        ):
            raise ValueError(f"a batch needs one draft's first layer per request: {self}")


@dataclass(frozen=True)
class StepPlan:
    """What every tensor-parallel rank runs for one step: rank 0's choice."""

    shape: TreeShape
    source: DecisionSource
    # Run the engine's placeholder instead of the draft's extend (a step without speculation
    # under ``skip_idle_draft_extend``).
    skips_draft_extend: bool


@dataclass(frozen=True)
class StepTicket:
    """One launched decode step, from ``begin`` to ``finish``."""

    id: int  # increasing per controller; also the step's index in telemetry
    decision: Decision
    features: StepFeatures
    request_ids: tuple[str, ...]  # [batch]
    skips_draft_extend: bool
    # [batch] the draft's first layers the decision read (None where unknown); None: none known.
    confidence: tuple[FirstLayer | None, ...] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def plan(self) -> StepPlan:
        return StepPlan(self.decision.shape, self.decision.source, self.skips_draft_extend)


@dataclass(frozen=True)
class StepOutcome:
    """What one finished step produced, as the driver measured it."""

    measured_ms: float  # step time
    accepted_per_request: tuple[int, ...]  # [batch] accepted draft tokens (bonus not included)
    wall_time: float  # when the step finished, unix seconds (simulated time in a simulation)
    paths: AcceptedPathStats | None = None  # speculative steps: the accepted paths


@dataclass(frozen=True)
class StepReport:
    """One finished step as the sinks receive it."""

    ticket: StepTicket
    outcome: StepOutcome
    policy_version: int | None  # the cost model's version when the step finished
    learned: bool  # whether the step taught the cost model
    emitted_tokens: int  # batch total: accepted + one bonus per request
    accepted_tokens: int  # batch total
    drafted_tokens: int  # draft tokens verified, batch total
    offered_by_depth: tuple[int, ...] = ()  # children on the accepted path, per depth
    accepted_by_depth: tuple[int, ...] = ()
    accepted_by_rank: tuple[int, ...] = ()

    @property
    def accept_len(self) -> float:
        """Acceptance length: emitted tokens per request."""
        return self.emitted_tokens / self.ticket.batch_size

    @property
    def goodput(self) -> float:
        """Emitted tokens per second of measured step time."""
        ms = self.outcome.measured_ms
        return self.emitted_tokens / (ms / 1000.0) if ms > 0 else 0.0


class StepSink(Protocol):
    """Where finished steps go (telemetry, metrics); called on the driver's thread."""

    def step_finished(self, report: StepReport) -> None: ...

    def steps_unfinished(self, count: int) -> None: ...


class ModelSource(StrEnum):
    """Where a replacing cost model came from."""

    POLICY = "policy"  # a trained policy version an operator (or retrain) activated
    REFIT = "refit"  # the analytic model refitted on this server's measured steps
    PROFILE = "profile"  # the deployment's step-time profile, corrected by the measured steps


@dataclass(frozen=True)
class ControlUpdate:
    """A change handed to the controller, applied at the next step boundary."""

    pins: tuple[Pin, ...] | None = None  # None: keep the current pins
    cost_model: OnlineCostModel | None = None  # None: keep the current one
    policy_version: int | None = None  # the version ``cost_model`` comes from
    model_source: ModelSource | None = None


class DecisionRule(Protocol):
    """What the controller needs of a policy (``policy.Policy``, ``baselines``)."""

    cost_model: Any
    pins: tuple[Pin, ...]
    policy_version: int | None
    reads_confidence: bool  # whether ``decide`` reads the draft's confidence

    def decide(
        self,
        features: StepFeatures,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> Decision: ...

    def observe(
        self,
        features: StepFeatures,
        shape: TreeShape,
        measured_ms: float,
        stats: AcceptedPathStats | None = None,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> None: ...

    def set_pins(self, pins: Sequence[Pin]) -> None: ...

    def set_cost_model(self, cost_model: Any, policy_version: int | None) -> None: ...


def make_policy(
    config: Any, cost_model: OnlineCostModel, acceptance: AcceptanceEstimator
) -> DecisionRule:
    """The decision rule named by ``config.policy``: adatree's, or a re-implemented baseline
    (which the benchmark runs through this same loop, telemetry included)."""
    if config.policy == "adatree":
        return Policy(config, cost_model, acceptance)
    from sglang_adatree.core.baselines import BASELINE_POLICIES

    return BASELINE_POLICIES[config.policy](config, cost_model, acceptance)


@dataclass
class _Held:
    decision: Decision
    context_lens: list[int]  # sorted, of the catch-up step


@dataclass
class _Counters:
    finished: int = 0
    unfinished: int = 0  # tickets dropped without an outcome
    late: int = 0  # outcomes for tickets already dropped or finished
    accept_len_ema: float | None = None
    last: Decision | None = None
    open: collections.OrderedDict[int, StepTicket] = field(default_factory=collections.OrderedDict)


class StepController:
    """The adaptive loop of one serving rank 0; see the module docstring."""

    def __init__(
        self,
        config: Any,
        *,
        padding: GraphPadding = NO_GRAPHS,
        max_batch_size: int = 256,
        sinks: Sequence[StepSink] = (),
        profile: StepTimeModel | None = None,
    ) -> None:
        self.config = config
        self.candidate_shapes: tuple[TreeShape, ...] = tuple(config.candidate_shapes)
        self.padding = padding
        # The deployment's step-time profile (``step_profile.ProfileStepTime``), or None: the
        # analytic model, refitted on this server's steps.
        self.profile = profile
        self.policy = make_policy(
            # The warm-up measures what the profile already priced: at start-up it would only
            # run slow shapes (docs/notes/2026-12-04-no-warm-up-under-a-profile.md).
            config if profile is None else config.replace(warmup_steps=0),
            starting_cost_model(config.residual_decay, profile),
            AcceptanceEstimator.from_config(config),
        )
        self.measured = MeasuredSteps(
            self.candidate_shapes, config.residual_decay, padding, max_batch_size
        )
        self.sinks: list[StepSink] = list(sinks)
        self._updates: collections.deque[ControlUpdate] = collections.deque()
        self._next_id = 0
        self._held: _Held | None = None
        self._draft_behind: frozenset[str] = frozenset()
        self._counters = _Counters()
        # False: every refit waits for a caller of ``refit`` (a driver whose cost model must
        # not be replaced, as the lab's with the true step times). A profile is never refitted.
        self.runs_first_refit = profile is None

    # -- the decode loop ------------------------------------------------------------------

    def begin(self, view: BatchView) -> StepTicket:
        """Decide the step for ``view``'s batch and open its ticket."""
        held, self._held = self._held, None
        if self._apply_updates():
            held = None
        features = StepFeatures.from_context_lens(view.context_lens, self.padding)
        lens = sorted(view.context_lens)
        confidence = self._confidence(view)
        if (
            held is not None
            and lens == [n + 1 for n in held.context_lens]
            and not self._decides_again(held.decision, confidence)
        ):
            decision = held.decision
        else:
            decision = self.policy.decide(features, view.request_ids, confidence)
        if decision.shape.speculative and not self._draft_behind.isdisjoint(view.request_ids):
            self._held = _Held(decision, lens)
            # Any policy's cost model, baselines' included, prices the step as no speculation.
            predicted_ms = self.policy.cost_model.predict_ms(features, NO_SPEC)
            # The policy's own choice is the runner-up: the shape the catch-up stands in for.
            decision = Decision(
                NO_SPEC,
                DecisionSource.CATCH_UP,
                predicted_ms,
                1.0,
                decision.shape,
                decision.predicted_ms,
                decision.predicted_emitted,
                decision.split,
            )
        skips = (
            self.config.skip_idle_draft_extend
            and not decision.shape.speculative
            and decision.source is not DecisionSource.CATCH_UP
        )
        # Only this batch's requests can be behind after this step: a request that leaves the
        # batch finishes, or comes back through a prefill, which runs the draft's extend.
        self._draft_behind = frozenset(view.request_ids) if skips else frozenset()
        ticket = StepTicket(self._next_id, decision, features, view.request_ids, skips, confidence)
        self._next_id += 1
        counters = self._counters
        counters.open[ticket.id] = ticket
        counters.last = decision
        if len(counters.open) > MAX_OPEN_TICKETS:
            counters.open.popitem(last=False)
            self._unfinished(1)
        return ticket

    def finish(self, ticket: StepTicket, outcome: StepOutcome) -> StepReport | None:
        """Learn from and report one finished step; None for a ticket no longer open."""
        counters = self._counters
        if counters.open.pop(ticket.id, None) is None:
            counters.late += 1
            logger.debug("adatree: outcome for step %d, which is no longer open", ticket.id)
            return None
        earlier = [i for i in counters.open if i < ticket.id]
        for i in earlier:
            del counters.open[i]
        if earlier:
            self._unfinished(len(earlier))
        batch = ticket.batch_size
        if len(outcome.accepted_per_request) != batch:
            raise ValueError(
                f"step {ticket.id} ran {batch} requests but its outcome has "
                f"{len(outcome.accepted_per_request)} accept counts"
            )
        decision = ticket.decision
        shape = decision.shape
        learned = teaches_cost_model(decision.source, outcome.measured_ms)
        paths = None
        if shape.speculative and outcome.paths is not None:
            paths = outcome.paths.as_lists()
        if learned:
            self.policy.observe(
                ticket.features,
                shape,
                outcome.measured_ms,
                paths,
                ticket.request_ids,
                ticket.confidence,
            )
            self.measured.add(ticket.features, shape, outcome.measured_ms)
            if self.runs_first_refit and not self.measured.fitted and self.policy_version is None:
                self._first_refit()
        accepted = int(sum(outcome.accepted_per_request))
        offered: tuple[int, ...] = ()
        by_depth: tuple[int, ...] = ()
        by_rank: tuple[int, ...] = ()
        if paths is not None:
            offered, by_depth, by_rank = accepted_counts(paths, shape.topk)
        report = StepReport(
            ticket=ticket,
            outcome=outcome,
            policy_version=self.policy.policy_version,
            learned=learned,
            emitted_tokens=accepted + batch,
            accepted_tokens=accepted,
            drafted_tokens=batch * (shape.num_draft_tokens - 1),
            offered_by_depth=offered,
            accepted_by_depth=by_depth,
            accepted_by_rank=by_rank,
        )
        counters.finished += 1
        ema = counters.accept_len_ema
        counters.accept_len_ema = (
            report.accept_len if ema is None else 0.9 * ema + 0.1 * report.accept_len
        )
        for sink in self.sinks:
            sink.step_finished(report)
        return report

    # -- control ----------------------------------------------------------------------------

    def apply(self, update: ControlUpdate) -> None:
        """Hand over a change (from any thread); it applies at the next step boundary."""
        if update.pins is not None:
            for pin in update.pins:
                if pin.shape not in self.candidate_shapes:
                    raise ValueError(f"pinned shape {pin.shape} is not a candidate shape")
        self._updates.append(update)

    def refit(self, force: bool = False) -> ControlUpdate | None:
        """The analytic model refitted on the measured steps, as an update, when due
        (``refit.MeasuredSteps``); the caller applies it.

        With a profile there is nothing to refit: a fit of this server's own steps would price
        each shape it seldom runs by its few steps, where the profile measured it. ``force``
        (the rollback from a trained version) then hands back the profile, with the measured
        steps' corrections replayed."""
        if self.profile is not None:
            if not force:
                return None
            return ControlUpdate(
                cost_model=self.measured.replayed(self.profile), model_source=ModelSource.PROFILE
            )
        cost_model = self.measured.refit(force)
        if cost_model is None:
            return None
        return ControlUpdate(cost_model=cost_model, model_source=ModelSource.REFIT)

    def tabulate(self, step_time: StepTimeModel, policy_version: int) -> ControlUpdate:
        """A trained policy version, tabulated and corrected by the measured steps, as an
        update (seconds for an XGBoost model: call it off the decode loop)."""
        return ControlUpdate(
            cost_model=self.measured.tabulate(step_time),
            policy_version=policy_version,
            model_source=ModelSource.POLICY,
        )

    @property
    def pins(self) -> tuple[Pin, ...]:
        return self.policy.pins

    @property
    def updates_pending(self) -> bool:
        """Whether a handed-over update still waits for the next step boundary."""
        return bool(self._updates)

    @property
    def policy_version(self) -> int | None:
        return self.policy.policy_version

    def server_state(self) -> dict[str, Any]:
        """What ``GET /server_info`` shows under ``internal_states``."""
        c = self._counters
        d = c.last
        return {
            "adatree_shape": None if d is None else str(d.shape),
            "adatree_decision_source": None if d is None else str(d.source),
            "adatree_policy_version": self.policy.policy_version,
            "adatree_recent_accept_length": c.accept_len_ema,
            "adatree_steps": c.finished,
            "adatree_unfinished_steps": c.unfinished,
            "adatree_pins": [str(p.shape) for p in self.policy.pins],
            "adatree_candidate_shapes": [str(s) for s in self.candidate_shapes],
            "adatree_step_noise": self.step_noise,
            "adatree_price_split": self.price_split,
            "adatree_draft_confidence": self.draft_confidence,
        }

    @property
    def draft_confidence(self) -> list[dict[str, float]] | None:
        """Per bin of the draft's confidence (``core.confidence``): its upper edge, the factor
        on expected accepted draft tokens learnt there, and the weight of its verify steps;
        None under a policy that does not read the confidence (the baselines)."""
        table = getattr(self.policy, "confidence", None)
        if table is None:
            return None
        return [{"below": hi, "factor": f, "steps": w} for hi, f, w in table.table()]

    @property
    def step_noise(self) -> float | None:
        """How far one step's time strays (a fraction), as the cost model has estimated it;
        None until it has, or under a cost model without a residual correction."""
        cost_model = self.policy.cost_model
        if not isinstance(cost_model, OnlineCostModel):
            return None
        return cost_model.residual.step_noise

    @property
    def price_split(self) -> dict[str, float] | None:
        """How the machine prices steps against the step-time model (``PriceSplit``: ``drift``,
        ``tilt``, ``offset``, log units), as the cost model stands; None under one without a
        residual correction."""
        split = price_split(self.policy.cost_model)
        return None if split is None else dataclasses.asdict(split)

    # -- internals --------------------------------------------------------------------------
    def _decides_again(
        self, held: Decision, confidence: tuple[FirstLayer | None, ...] | None
    ) -> bool:
        """Whether a decision held behind a catch-up gives way to a new one: the catch-up has
        made the drafts' confidence known, and a policy that reads it would decide the step
        otherwise if the draft is unsure of it. Only a decision of the goodput rule: a pin, the
        warm-up, an exploring step or a probe runs its shape for what it measures."""
        return (
            confidence is not None
            and self.policy.reads_confidence
            and held.source in (DecisionSource.FALLBACK, DecisionSource.MODEL)
        )

    def _confidence(self, view: BatchView) -> tuple[FirstLayer | None, ...] | None:
        """``[batch]`` the drafts' first layers of ``view``'s requests as a decision may read them:
        None for a request whose draft is behind (the engine holds a placeholder for it)."""
        given = view.draft_confidence
        if given is None:
            return None
        behind = self._draft_behind
        if behind.isdisjoint(view.request_ids):
            return tuple(given)
        out = tuple(
            None if r in behind else q for r, q in zip(view.request_ids, given, strict=True)
        )
        return None if all(q is None for q in out) else out

    def _apply_updates(self) -> bool:
        applied = False
        while self._updates:
            update = self._updates.popleft()
            applied = True
            if update.pins is not None and update.pins != self.policy.pins:
                logger.info("adatree: pins now %s", [str(p.shape) for p in update.pins] or "none")
                self.policy.set_pins(update.pins)
            if update.cost_model is not None:
                self.policy.set_cost_model(update.cost_model, update.policy_version)
                logger.info(
                    "adatree: cost model from %s (policy version %s)",
                    update.model_source,
                    update.policy_version,
                )
        return applied

    def _first_refit(self) -> None:
        """The first refit, here on the decode loop as soon as it is due, not at the control
        poller's next poll: until it, the policy prices the steps with the default model (a
        GPU's costs, a tenth of a CPU's), and on a CPU a poll interval is ten decode steps that
        run whichever shapes those prices favour. A fit of a few dozen steps takes about a
        millisecond; later refits, of thousands, stay with the poller."""
        update = self.refit()
        if update is not None:
            self.apply(update)

    def _unfinished(self, count: int) -> None:
        self._counters.unfinished += count
        logger.debug("adatree: %d launched steps never finished", count)
        for sink in self.sinks:
            sink.steps_unfinished(count)


def plan_on_every_rank(
    controller: StepController | None, view: BatchView, group: Any
) -> tuple[StepPlan, StepTicket | None]:
    """Rank 0's plan for this step on every rank of ``group`` (SGLang's ``GroupCoordinator``:
    ``world_size`` and ``broadcast_object``), and rank 0's ticket.

    Only rank 0 holds a controller (the others pass None): its decision is the one every rank
    runs. One small object over the CPU group per step.
    """
    ticket = controller.begin(view) if controller is not None else None
    plan = ticket.plan if ticket is not None else None
    if group.world_size > 1:
        plan = group.broadcast_object(plan, src=0)
    if plan is None:
        raise RuntimeError("no step plan: rank 0 must hold the step controller")
    return plan, ticket
