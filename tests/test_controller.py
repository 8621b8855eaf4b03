"""The step controller without SGLang: tickets, lost completions, catch-up, control updates,
refits, and the sinks it reports to."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.controller import (
    MAX_OPEN_TICKETS,
    BatchView,
    ControlUpdate,
    StepController,
    StepOutcome,
    StepReport,
    make_policy,
)
from sglang_adatree.core.policy import DecisionSource, Pin
from sglang_adatree.core.refit import FIRST_REFIT_ROWS, MIN_REFIT_ROWS, REFIT_EVERY_ROWS
from sglang_adatree.core.shapes import NO_SPEC, TreeShape

CHAIN = TreeShape(3, 1, 4)
TREE = TreeShape(2, 2, 4)


def config(**kw) -> AdaTreeConfig:
    values = dict(
        candidate_shapes="0;3,1,4;2,2,4",
        warmup_steps=0,
        explore_fraction=0.0,
        record_steps=False,
    )
    values.update(kw)
    return AdaTreeConfig().replace(**values)


class ListSink:
    """Keeps what the controller reports."""

    def __init__(self) -> None:
        self.reports: list[StepReport] = []
        self.unfinished = 0

    def step_finished(self, report: StepReport) -> None:
        self.reports.append(report)

    def steps_unfinished(self, count: int) -> None:
        self.unfinished += count


def paths(batch: int, shape: TreeShape, accepted: int) -> AcceptedPathStats | None:
    """Every request accepts its first ``accepted`` draft tokens (rank 0 at each depth)."""
    if not shape.speculative:
        return None
    ranks = torch.full((batch, shape.steps), -1, dtype=torch.int64)
    ranks[:, :accepted] = 0
    children = torch.zeros((batch, shape.steps), dtype=torch.int64)
    children[:, : accepted + 1] = shape.topk
    return AcceptedPathStats(children[:, : shape.steps], ranks)


def outcome(ticket, ms: float, accepted: int = 1, wall_time: float = 0.0) -> StepOutcome:
    shape = ticket.decision.shape
    n = accepted if shape.speculative else 0
    return StepOutcome(ms, (n,) * ticket.batch_size, wall_time, paths(ticket.batch_size, shape, n))


class Batch:
    """Requests decoding together: each step every context grows by what it emitted."""

    def __init__(self, *contexts: int) -> None:
        self.ids = tuple(f"r{i}" for i in range(len(contexts)))
        self.contexts = list(contexts)

    def view(self) -> BatchView:
        return BatchView(self.ids, tuple(self.contexts))

    def advance(self, report: StepReport | None, ticket) -> None:
        emitted = 1 if report is None else report.emitted_tokens // ticket.batch_size
        self.contexts = [n + emitted for n in self.contexts]


def test_one_report_per_finished_step_with_its_own_numbers():
    sink = ListSink()
    controller = StepController(config(), sinks=[sink])
    batch = Batch(100, 40)
    for i in range(5):
        ticket = controller.begin(batch.view())
        report = controller.finish(ticket, outcome(ticket, 20.0 + i, wall_time=float(i)))
        batch.advance(report, ticket)
    assert [r.ticket.id for r in sink.reports] == list(range(5))
    assert [r.outcome.measured_ms for r in sink.reports] == [20.0, 21.0, 22.0, 23.0, 24.0]
    first = sink.reports[0]
    assert first.ticket.features.batch_size == 2 and first.ticket.features.sum_context_len == 140
    state = controller.server_state()
    assert state["adatree_steps"] == 5 and state["adatree_unfinished_steps"] == 0
    assert state["adatree_step_noise"] is None  # too few steps to tell


def test_the_server_state_shows_the_step_noise_once_estimated():
    # Steps of one shape whose time strays by about 10% from one to the next: once the cost
    # model has seen enough of them, /server_info says so.
    controller = StepController(config(warmup_steps=0))
    batch = Batch(60, 80)
    rng = np.random.default_rng(0)
    for _ in range(200):
        ticket = controller.begin(batch.view())
        report = controller.finish(ticket, outcome(ticket, 50.0 * math.exp(0.1 * rng.normal())))
        batch.advance(report, ticket)
    state = controller.server_state()
    assert state["adatree_step_noise"] == pytest.approx(0.1, rel=0.3)
    # The split as the cost model stands: a machine at 50 ms a step, far from the model's
    # default costs, set the drift.
    split = controller.policy.cost_model.split()
    assert state["adatree_price_split"] == {
        "drift": split.drift,
        "tilt": split.tilt,
        "offset": split.offset,
    }
    assert abs(split.drift) > 0.1


def test_a_lost_completion_is_counted_and_shifts_nothing():
    # Under overlap scheduling step N+1 is launched before step N finishes. Step 3's result
    # never comes back: it is counted once step 4 finishes, and every later report keeps its
    # own decision, features and timing.
    sink = ListSink()
    controller = StepController(config(warmup_steps=1000), sinks=[sink])
    tickets = [controller.begin(BatchView(("a",), (50 + i,))) for i in range(8)]
    for t in tickets:
        if t.id != 3:
            controller.finish(t, outcome(t, 10.0 * (t.id + 1), wall_time=float(t.id)))
    assert sink.unfinished == 1
    assert [r.ticket.id for r in sink.reports] == [0, 1, 2, 4, 5, 6, 7]
    for r in sink.reports:
        assert r.outcome.measured_ms == 10.0 * (r.ticket.id + 1)
        assert r.ticket.features.sum_context_len == 50 + r.ticket.id
        assert r.ticket.decision is tickets[r.ticket.id].decision
    # A completion for the dropped step arriving late is ignored, not recorded under another.
    assert controller.finish(tickets[3], outcome(tickets[3], 99.0)) is None
    assert len(sink.reports) == 7
    assert controller.server_state()["adatree_unfinished_steps"] == 1


def test_open_tickets_are_bounded():
    sink = ListSink()
    controller = StepController(config(), sinks=[sink])
    for i in range(MAX_OPEN_TICKETS + 5):
        controller.begin(BatchView(("a",), (10 + i,)))
    assert sink.unfinished == 5


def test_an_outcome_must_match_its_batch():
    controller = StepController(config())
    ticket = controller.begin(BatchView(("a", "b"), (10, 20)))
    with pytest.raises(ValueError, match="2 requests but its outcome has 1"):
        controller.finish(ticket, StepOutcome(5.0, (0,), 0.0))


def test_a_batch_view_needs_a_context_per_request():
    with pytest.raises(ValueError):
        BatchView(("a", "b"), (10,))
    with pytest.raises(ValueError):
        BatchView((), ())


def drive(controller, batch: Batch, steps: int, ms: float = 30.0) -> list[tuple[str, str]]:
    seen = []
    for _ in range(steps):
        ticket = controller.begin(batch.view())
        seen.append((str(ticket.decision.shape), str(ticket.decision.source)))
        batch.advance(controller.finish(ticket, outcome(ticket, ms)), ticket)
    return seen


def test_a_draft_that_skipped_its_extend_catches_up_before_speculating():
    # Warm-up cycles the candidates in shape order, 0 -> 2,2,4 -> 3,1,4. After the step without
    # speculation (which skipped the draft's extend) the tree waits one step: a catch-up runs
    # first, then the held tree, then the warm-up goes on; no decision is lost or repeated.
    sink = ListSink()
    controller = StepController(config(warmup_steps=1000), sinks=[sink])
    seen = drive(controller, Batch(50), 7)
    assert seen == [
        ("0,1,1", "warmup"),
        ("0,1,1", "catch-up"),
        ("2,2,4", "warmup"),
        ("3,1,4", "warmup"),
        ("0,1,1", "warmup"),
        ("0,1,1", "catch-up"),
        ("2,2,4", "warmup"),
    ]
    assert [r.ticket.skips_draft_extend for r in sink.reports] == [
        True, False, False, False, True, False, False,
    ]  # fmt: skip
    assert controller.policy.step == 5  # the catch-ups were not policy decisions
    # Catch-ups cost no speculation plus the draft's extend: not taught as no speculation's
    # cost, nor counted as measurements of it.
    assert controller.policy.measured == [2, 2, 1]
    assert len(controller.measured) == 5
    assert [r.learned for r in sink.reports] == [True, False, True, True, True, False, True]


def test_a_catch_ups_runner_up_is_the_shape_it_holds():
    controller = StepController(config(warmup_steps=1000))
    ids = ("a",)
    controller.begin(BatchView(ids, (50,)))  # 0,1,1: "a" is behind
    ticket = controller.begin(BatchView(ids, (51,)))  # 2,2,4 held behind a catch-up
    decision = ticket.decision
    assert decision.source == DecisionSource.CATCH_UP and decision.shape == NO_SPEC
    held = controller.begin(BatchView(ids, (52,))).decision
    assert (held.shape, held.source) == (TREE, DecisionSource.WARMUP)
    assert decision.runner_up == TREE
    assert (decision.runner_up_ms, decision.runner_up_emitted) == (
        held.predicted_ms,
        held.predicted_emitted,
    )
    assert decision.split is not None and decision.split == held.split


def test_without_skipping_the_extend_no_catch_up_runs():
    controller = StepController(config(warmup_steps=1000, skip_idle_draft_extend=False))
    seen = drive(controller, Batch(50), 6)
    assert [source for _, source in seen] == ["warmup"] * 6


def test_only_requests_that_skipped_are_behind():
    controller = StepController(config(warmup_steps=1000))
    ticket = controller.begin(BatchView(("a",), (50,)))  # 0,1,1 skips: "a" is behind
    assert ticket.skips_draft_extend
    controller.finish(ticket, outcome(ticket, 30.0))
    # Another request alone: its draft is not behind, so the tree runs at once.
    ticket = controller.begin(BatchView(("b",), (70,)))
    assert (ticket.decision.shape, ticket.decision.source) == (TREE, DecisionSource.WARMUP)


def test_a_held_decision_is_dropped_for_another_batch_or_a_pin():
    controller = StepController(config(warmup_steps=1000))
    ids = ("a", "b")
    controller.begin(BatchView(ids, (50, 70)))  # 0,1,1: both behind
    ticket = controller.begin(BatchView(ids, (51, 71)))  # 2,2,4 held
    assert ticket.decision.source == DecisionSource.CATCH_UP
    # The batch changed (a request finished, another joined): a decision of its own.
    ticket = controller.begin(BatchView(("a", "c"), (52, 30)))
    assert (str(ticket.decision.shape), ticket.decision.source) == ("3,1,4", "warmup")
    # An operator's pin arriving between the catch-up and the held step wins at once.
    controller.begin(BatchView(ids, (53, 31)))  # 0,1,1
    ticket = controller.begin(BatchView(ids, (54, 32)))  # 2,2,4 held
    assert ticket.decision.source == DecisionSource.CATCH_UP
    controller.apply(ControlUpdate(pins=(Pin(CHAIN),)))
    ticket = controller.begin(BatchView(ids, (55, 33)))
    assert (ticket.decision.shape, ticket.decision.source) == (CHAIN, DecisionSource.PIN)


@pytest.mark.parametrize("policy", ["turbospec", "sglang-adaptive"])
def test_baseline_policies_catch_up_too(policy):
    # The baselines share the serving loop, so their speculation after no speculation waits
    # for a catch-up as adatree's does (they choose among chains and no speculation).
    controller = StepController(config(policy=policy, candidate_shapes="0;1,1,2;3,1,4"))
    ticket = controller.begin(BatchView(("a",), (50,)))  # both start on the 3-step chain
    assert ticket.decision.shape == CHAIN
    controller.finish(ticket, outcome(ticket, 30.0))
    controller.apply(ControlUpdate(pins=(Pin(NO_SPEC),)))
    ticket = controller.begin(BatchView(("a",), (52,)))  # pinned off: skips the extend
    assert ticket.skips_draft_extend
    controller.apply(ControlUpdate(pins=()))
    ticket = controller.begin(BatchView(("a",), (53,)))
    assert (str(ticket.decision.shape), ticket.decision.source) == ("0,1,1", "catch-up")
    ticket = controller.begin(BatchView(("a",), (54,)))
    assert ticket.decision.shape == CHAIN and ticket.decision.source != "catch-up"


def test_control_updates_apply_at_the_next_step_boundary():
    controller = StepController(config(warmup_steps=1000, skip_idle_draft_extend=False))
    ticket = controller.begin(BatchView(("a",), (10,)))
    controller.apply(ControlUpdate(pins=(Pin(TREE, min_batch_size=2),)))
    # Applied at the next begin, not during the open step...
    assert controller.pins == ()
    controller.finish(ticket, outcome(ticket, 5.0))
    assert controller.pins == ()
    # ...and then only for the batch sizes the pin covers.
    assert controller.begin(BatchView(("a",), (11,))).decision.source == DecisionSource.WARMUP
    two = controller.begin(BatchView(("a", "b"), (12, 20))).decision
    assert (two.shape, two.source) == (TREE, DecisionSource.PIN)
    assert controller.server_state()["adatree_pins"] == ["2,2,4"]
    with pytest.raises(ValueError, match="not a candidate"):
        controller.apply(ControlUpdate(pins=(Pin(TreeShape(4, 4, 8)),)))


def test_unknown_policy_name_is_a_config_error():
    with pytest.raises(ValueError, match="policy"):
        AdaTreeConfig().replace(policy="magic")
    policy = make_policy(AdaTreeConfig(), None, None)  # type: ignore[arg-type]
    assert type(policy).__name__ == "Policy"


# -- refits ------------------------------------------------------------------------------------


def measured_run(controller: StepController, shapes, steps: int, cost) -> list[int]:
    """Run ``shapes`` in turn (pinned), cost ``cost(shape)`` ms; the step counts at which a
    refit came due and was applied, as the control poller would apply it. The draft never
    skips its extend here, so no catch-up step comes between."""
    refits = []
    for i in range(1, steps + 1):
        shape = shapes[i % len(shapes)]
        controller.apply(ControlUpdate(pins=(Pin(shape),)))
        ticket = controller.begin(BatchView(("a",), (50 + i % 7,)))
        fitted = controller.measured.fitted
        controller.finish(ticket, outcome(ticket, cost(shape)))
        if controller.measured.fitted and not fitted:
            refits.append(i)  # the first refit: the controller's own
            continue
        update = controller.refit()
        if update is not None:
            controller.apply(update)
            refits.append(i)
    return refits


def linear(shape: TreeShape) -> float:
    return 40.0 + 10.0 * shape.num_draft_tokens


def test_the_analytic_model_refits_on_measured_steps():
    controller = StepController(config(skip_idle_draft_extend=False))
    shapes = list(controller.candidate_shapes)
    assert measured_run(controller, shapes, 200, linear)
    controller.begin(BatchView(("a",), (60,)))  # applies the last refit
    features = controller.begin(BatchView(("a",), (61,))).features
    predicted = controller.policy.cost_model.predict_ms_many(features, tuple(shapes))
    assert predicted == pytest.approx([linear(s) for s in shapes], rel=0.05)


def test_the_first_refit_comes_once_every_candidate_was_measured():
    controller = StepController(config(skip_idle_draft_extend=False))
    refits = measured_run(
        controller, list(controller.candidate_shapes), 2 * REFIT_EVERY_ROWS + 128, linear
    )
    # The default model prices a CPU's steps with a GPU's costs: refit as soon as the fit is
    # determined, then each time the measurements have doubled, then at the steady interval.
    first = FIRST_REFIT_ROWS
    assert refits == [first, 2 * first, 4 * first, 8 * first, 256, 384]


def test_the_controller_runs_the_first_refit_itself():
    # No poller here: the first refit must not wait for one, since until it the policy prices
    # a CPU's steps at a GPU's costs.
    controller = StepController(config(skip_idle_draft_extend=False))
    shapes = list(controller.candidate_shapes)
    for i in range(FIRST_REFIT_ROWS):
        shape = shapes[i % len(shapes)]
        controller.apply(ControlUpdate(pins=(Pin(shape),)))
        ticket = controller.begin(BatchView(("a",), (50 + i % 7,)))
        if i == 0:
            assert ticket.decision.predicted_ms < 0.5 * linear(shape)  # the default model's
        controller.finish(ticket, outcome(ticket, linear(shape)))
    assert controller.measured.fitted and controller.updates_pending
    controller.apply(ControlUpdate(pins=()))
    features = controller.begin(BatchView(("a",), (60,))).features
    fitted = controller.policy.cost_model
    predicted = fitted.predict_ms_many(features, tuple(shapes))
    assert predicted == pytest.approx([linear(s) for s in shapes], rel=0.1)
    # The later refits are the poller's.
    for i in range(4 * FIRST_REFIT_ROWS):
        ticket = controller.begin(BatchView(("a",), (61 + i,)))
        controller.finish(ticket, outcome(ticket, linear(ticket.decision.shape)))
    assert controller.policy.cost_model is fitted and controller.measured.refit_due()


def test_no_first_refit_replaces_a_trained_version():
    # A trained policy version prices the steps already: no refit replaces it.
    controller = StepController(config(skip_idle_draft_extend=False))
    trained = controller.measured.refit(force=True)
    controller.apply(ControlUpdate(cost_model=trained, policy_version=3))
    shapes = list(controller.candidate_shapes)
    controller.begin(BatchView(("a",), (50,)))  # applies the version
    for i in range(2 * FIRST_REFIT_ROWS):
        shape = shapes[i % len(shapes)]
        controller.apply(ControlUpdate(pins=(Pin(shape),)))
        ticket = controller.begin(BatchView(("a",), (51 + i,)))
        controller.finish(ticket, outcome(ticket, linear(shape)))
    assert not controller.updates_pending
    assert controller.policy.cost_model is trained and controller.policy.policy_version == 3


def test_without_every_candidate_measured_the_first_refit_waits():
    controller = StepController(config(skip_idle_draft_extend=False))
    # Two of the three candidates (as under a pin, or without warm-up): the fit's terms are
    # less determined, so it waits for more steps.
    refits = measured_run(controller, list(controller.candidate_shapes[:2]), 128, linear)
    assert refits == [MIN_REFIT_ROWS, 2 * MIN_REFIT_ROWS]


def test_a_refit_keeps_the_corrections_the_measurements_imply():
    # Step times no analytic fit matches: the 2-step tree costs far more than the 3-step chain
    # with as many draft tokens (non-negative coefficients cannot make a draft pass cheaper).
    truth = {"0,1,1": 40.0, "1,1,2": 55.0, "2,1,3": 60.0, "2,2,4": 150.0, "3,1,4": 70.0}
    controller = StepController(
        config(candidate_shapes=";".join(truth), skip_idle_draft_extend=False)
    )
    shapes = list(controller.candidate_shapes)
    measured_run(controller, shapes, 400, lambda s: truth[str(s)])
    update = controller.refit(force=True)
    assert update is not None and update.model_source == "refit"
    refit = update.cost_model
    features = controller.begin(BatchView(("a",), (52,))).features
    # The bare fit is off by more than 20% on some shape...
    raw = refit.raw_ms_many(features, tuple(shapes))
    expected = np.array([truth[str(s)] for s in shapes])
    assert np.max(np.abs(raw / expected - 1)) > 0.2
    # ...but the model the policy gets starts with the corrections of the same history.
    predicted = refit.predict_ms_many(features, tuple(shapes))
    assert predicted == pytest.approx(expected, rel=0.03)
    assert all(refit.residual.measured(s) == 80 for s in shapes)


def test_a_forced_refit_without_enough_steps_is_the_default_model_corrected():
    controller = StepController(config(skip_idle_draft_extend=False))
    measured_run(controller, [CHAIN], 3, linear)
    update = controller.refit(force=True)
    assert update is not None
    assert update.cost_model.residual.measured(CHAIN) == 3
    assert controller.refit() is None  # not due


def test_a_refit_on_one_batch_size_prices_smaller_batches_as_that_one():
    # Every measured step ran 16 requests, and steps cost the same at any batch size (a GPU
    # below its compute bound): the fit cannot tell a step's fixed cost from its cost per
    # request and put it on the requests, pricing one request's step at a sixteenth. Below the
    # smallest batch it was fitted on, the model prices that batch.
    controller = StepController(config(skip_idle_draft_extend=False))
    shapes = list(controller.candidate_shapes)
    ids = tuple(f"r{i}" for i in range(16))
    for i in range(1, 65):
        shape = shapes[i % len(shapes)]
        controller.apply(ControlUpdate(pins=(Pin(shape),)))
        ticket = controller.begin(BatchView(ids, (50 + i,) * 16))
        controller.finish(ticket, outcome(ticket, linear(shape)))
    update = controller.refit(force=True)
    assert update is not None
    model = update.cost_model
    one = controller.begin(BatchView(("a",), (60,))).features
    predicted = model.predict_ms_many(one, tuple(shapes))
    assert predicted == pytest.approx([linear(s) for s in shapes], rel=0.05)
    # At and above the batch it measured the fit is its own.
    assert model.at_floor(controller.begin(BatchView(ids, (60,) * 16)).features).batch_size == 16
