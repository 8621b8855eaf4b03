"""The draft's first layer and its confidence: the bins of the confidence's factor, the policy
that prices each request by them, the controller that hands them over only for requests whose
draft is up to date, and the worker that reads them from the engine."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_controller import config
from test_policy import batch, chain_gaining, make_policy

from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.confidence import BIN_EDGES, ConfidenceAcceptance, confidence_of
from sglang_adatree.core.controller import BatchView, StepController, StepOutcome
from sglang_adatree.core.policy import Decision, DecisionSource
from sglang_adatree.core.shapes import NO_SPEC, TreeShape
from sglang_adatree.sglang.worker import AdaTreeWorkerMixin

CHAIN = TreeShape(1, 1, 2)


def test_a_bin_factor_is_its_ratio_shrunk_towards_one():
    table = ConfidenceAcceptance(prior_steps=2.0, keep=1.0)
    assert table.factor(None) == 1.0 and table.factor(0.95) == 1.0
    table.observe([0.95, 0.05, None], [2, 0, 5], [1.0, 1.0, 1.0])
    assert table.factor(0.91) == pytest.approx((2 + 2) / (1 + 2))
    assert table.factor(0.05) == pytest.approx(2 / 3)
    assert table.factor(0.5) == 1.0  # nothing seen there; the unknown confidence taught nothing
    assert [w for _, _, w in table.table()] == [1, 0, 0, 0, 0, 0, 0, 0, 0, 1]
    assert len(table.table()) == len(BIN_EDGES) + 1
    # A request expected to accept more than another is judged against its own expectation.
    table.observe([0.5], [2], [4.0])
    assert table.factor(0.55) == pytest.approx((0.5 + 2) / (1 + 2))


def test_a_bins_factor_is_a_ratio_of_sums_under_the_first_layer():
    table = ConfidenceAcceptance(prior_steps=0.0, keep=1.0, ratio_of_sums=True)
    table.observe([0.05, 0.06], [2, 0], [0.1, 1.0])  # one lucky step expected to accept little
    assert table.factor(0.05) == pytest.approx(2 / 1.1)
    mean = ConfidenceAcceptance(prior_steps=0.0, keep=1.0)  # the default: each step's ratio
    mean.observe([0.05, 0.06], [2, 0], [0.1, 1.0])
    assert mean.factor(0.05) == pytest.approx(10.0)


def test_bins_are_validated():
    with pytest.raises(ValueError):
        ConfidenceAcceptance(edges=(0.5, 0.2))
    with pytest.raises(ValueError):
        ConfidenceAcceptance(keep=0.0)


def test_the_confidence_is_the_first_layers_top_1():
    assert confidence_of((0.4, 0.3)) == 0.4 and confidence_of(None) is None


def first_layer_policy(**settings):
    """Chains and trees at the estimator's prior acceptance, no request measured yet, the first
    layer read (``draft_first_layer``, off by default): it alone tells two requests apart."""
    shapes = (NO_SPEC, CHAIN, TreeShape(3, 1, 4), TreeShape(2, 2, 4), TreeShape(3, 4, 8))
    settings.setdefault("draft_first_layer", True)
    return make_policy(prior=0.5, candidate_shapes=shapes, **settings)


def test_the_first_layer_prices_a_tree_against_a_chain_per_request():
    policy = first_layer_policy()
    chain, tree = TreeShape(3, 1, 4), TreeShape(3, 4, 8)
    j, k = policy.candidates.index(chain), policy.candidates.index(tree)
    sure, unsure = (0.9, 0.05, 0.02, 0.01), (0.2, 0.6, 0.1, 0.05)
    each = policy.request_emitted(["a", "b"], [sure, unsure])  # [batch, candidates]
    assert each[0, j] > each[1, j] and each[0, k] > each[1, k]
    # Unsure of its best guess, the draft's second is likely: the tree holds up, the chain not.
    assert each[1, k] / each[0, k] > each[1, j] / each[0, j]
    assert each[1, k] > each[1, j] and each[0, k] >= each[0, j]
    # The chain 1,1,2 drafts only the top-1 token: 1 + the draft's probability of it.
    assert each[1, policy.candidates.index(CHAIN)] == pytest.approx(1.2)
    # The batch's expectation is the mean of its requests'.
    mean = policy.predictions(batch(2), ["a", "b"], [sure, unsure])[1]
    assert mean == pytest.approx(each.mean(axis=0))
    # A request whose draft is behind, or a policy told not to read the first layer: the
    # shapes' estimates, whatever the first layer.
    alone = policy.request_emitted(["c"], [None])[0]
    assert alone == pytest.approx(policy.request_emitted(["c"], per_request=False)[0])
    mixed = policy.request_emitted(["a", "c"], [sure, None])
    assert mixed[0] == pytest.approx(each[0]) and mixed[1] == pytest.approx(alone)
    off = first_layer_policy(draft_first_layer=False)
    rows = off.request_emitted(["a", "b"], [sure, unsure])
    assert rows[0] == pytest.approx(rows[1]) and rows[0] == pytest.approx(alone)


def chain_steps(policy, confidences, accepted) -> None:
    """Verify steps of the chain 1,1,2 for one request each, at these confidences."""
    for i, (q, a) in enumerate(zip(confidences, accepted, strict=True)):
        stats = AcceptedPathStats(torch.tensor([[1]]), torch.tensor([[0 if a else -1]]))
        policy.observe(batch(1), CHAIN, 10.0, stats, [f"r{i}"], [(float(q),)])


@pytest.mark.parametrize("first_layer", [True, False])
def test_the_policy_speculates_where_the_draft_is_sure_and_declines_where_it_is_not(
    first_layer,
):
    # The chain gains 10% on average; a sure draft's steps accept, an unsure one's do not.
    policy = chain_gaining(0.10, new_batch_steps=0, min_gain=0.0, draft_first_layer=first_layer)
    rng = np.random.default_rng(0)
    qs = rng.choice([0.05, 0.95], 400)
    chain_steps(policy, qs, qs > 0.5)
    if first_layer:
        # The draft's first layer states a sure step's chance itself: its bin's factor is
        # about 1 (0.95 accepted in all its steps). An unsure one's 0.05 never is.
        assert policy.confidence.factor(0.95) == pytest.approx(1 / 0.95, rel=0.02)
    else:
        assert policy.confidence.factor(0.95) > 1.5
    assert policy.confidence.factor(0.05) < 0.2
    assert policy.decide(batch(1), ["x"], [(0.95,)]).shape == CHAIN
    assert policy.decide(batch(1), ["x"], [(0.05,)]).shape == NO_SPEC
    # Unknown: the estimate over every step, as without the draft's confidence.
    unknown = policy.decide(batch(1), ["x"], [None]).predicted_emitted
    assert unknown == pytest.approx(policy.decide(batch(1), ["x"]).predicted_emitted)
    # A batch's expectation is the mean over its requests.
    both = policy.predictions(batch(2), ["x", "y"], [(0.95,), (0.05,)])[1]
    sure = policy.predictions(batch(1), ["x"], [(0.95,)])[1]
    unsure = policy.predictions(batch(1), ["y"], [(0.05,)])[1]
    assert both == pytest.approx((sure + unsure) / 2)


def test_a_dip_is_charged_the_catch_up_a_decline_puts_before_the_next_speculative_step():
    # The chain gains 20%: a sure draft's steps accept, a middling one's 30%, an unsure one's
    # none.
    rng = np.random.default_rng(0)
    qs = rng.choice([0.05, 0.55, 0.95], 600)
    accepted = np.where(qs > 0.9, True, np.where(qs < 0.1, False, rng.random(600) < 0.3))

    def speculating(**settings):
        policy = chain_gaining(0.20, new_batch_steps=0, min_gain=0.0, **settings)
        chain_steps(policy, qs, accepted)
        assert policy.decide(batch(1), ["x"], [(0.95,)]).shape == CHAIN
        return policy

    # Uncharged, the middling token alone stops speculation, and so does the unsure one; a
    # decline that runs the draft's extend itself is followed by no catch-up.
    off = speculating(price_catch_up=False)
    assert off.decide(batch(1), ["x"], [(0.55,)]).shape == NO_SPEC
    extends = speculating(skip_idle_draft_extend=False)
    assert extends.decide(batch(1), ["x"], [(0.55,)]).shape == NO_SPEC
    off.current = CHAIN
    assert off.decide(batch(1), ["x"], [(0.05,)]).shape == NO_SPEC
    # Charged the catch-up, the middling token's dip speculates; the unsure one's still
    # declines.
    policy = speculating()
    times, emitted = policy.predictions(batch(1), ["x"], [(0.55,)])
    decision = policy.decide(batch(1), ["x"], [(0.55,)])
    assert (decision.shape, decision.source) == (CHAIN, "fallback")
    assert decision.predicted_emitted == pytest.approx(emitted[1])
    assert emitted[1] / times[1] < 1.0 / times[0]  # uncharged, declining would win
    assert decision.runner_up == NO_SPEC
    assert policy.decide(batch(1), ["x"], [(0.05,)]).shape == NO_SPEC
    # Declined, the catch-up is owed whatever the next step runs: nothing more is charged.
    assert policy.decide(batch(1), ["x"], [(0.55,)]).shape == NO_SPEC
    # A request whose own steps accept nothing declines on its own: an unsure token is no dip.
    policy.current = CHAIN
    for _ in range(30):
        stats = AcceptedPathStats(torch.tensor([[1]]), torch.tensor([[-1]]))
        policy.observe(batch(1), CHAIN, 10.0, stats, ["bad"], [None])
    assert policy.decide(batch(1), ["bad"], [(0.55,)]).shape == NO_SPEC


def test_each_requests_prediction_is_what_the_batch_mean_is_made_of():
    policy = chain_gaining(0.10, new_batch_steps=0, min_gain=0.0)
    rng = np.random.default_rng(1)
    qs = rng.choice([0.05, 0.95], 300)
    chain_steps(policy, qs, qs > 0.5)
    # Two requests with their own levels: one accepted everything, one nothing.
    for _ in range(20):
        stats = AcceptedPathStats(torch.tensor([[1], [1]]), torch.tensor([[0], [-1]]))
        policy.observe(batch(2), CHAIN, 10.0, stats, ["good", "bad"], [None, None])
    ids, qs = ["good", "bad"], [(0.95,), (0.05,)]
    each = policy.request_emitted(ids, qs)  # [batch, candidates]
    assert each.shape == (2, len(policy.candidates))
    assert each.mean(axis=0) == pytest.approx(policy.predictions(batch(2), ids, qs)[1])
    chain = policy.candidates.index(CHAIN)
    assert each[0, chain] > each[1, chain] and each[1, chain] >= 1.0
    assert each[0, chain] <= CHAIN.steps + 1.0  # capped at what a step can emit
    # The shape's estimate alone: one row for every request, whatever each has shown.
    alone = policy.request_emitted(ids, qs, per_request=False)
    assert alone[0] == pytest.approx(alone[1])
    assert alone[0] == pytest.approx(policy.predictions(batch(1))[1])
    assert alone[0, policy.candidates.index(NO_SPEC)] == 1.0


def test_the_policy_ignores_the_confidence_when_told_to():
    policy = chain_gaining(0.10, new_batch_steps=0, min_gain=0.0, draft_confidence=False)
    chain_steps(policy, [0.05] * 50, [False] * 50)
    assert policy.confidence.table()[0][2] == 0  # nothing learnt
    low = policy.predictions(batch(1), ["x"], [(0.05,)])[1]
    assert low == pytest.approx(policy.predictions(batch(1), ["x"])[1])


def test_a_confidence_per_request_is_required():
    policy = chain_gaining(0.10)
    with pytest.raises(ValueError):
        policy.decide(batch(2), ["a", "b"], [(0.5,)])
    with pytest.raises(ValueError):
        BatchView(("a", "b"), (10, 11), ((0.5,),))
    with pytest.raises(ValueError):
        BatchView(("a",), (10,), ((),))  # a first layer holds at least the top-1


def test_the_controller_hands_over_no_confidence_for_a_draft_behind():
    controller = StepController(config(warmup_steps=1000))
    seen = []
    real_decide = controller.policy.decide

    def decide(features, request_ids=(), confidence=None):
        seen.append(confidence)
        return real_decide(features, request_ids, confidence)

    controller.policy.decide = decide
    ticket = controller.begin(
        BatchView(("a", "b"), (50, 60), ((0.9, 0.05), (0.2, 0.1)))
    )  # 0: both skip
    assert ticket.decision.shape == NO_SPEC and ticket.confidence == ((0.9, 0.05), (0.2, 0.1))
    controller.finish(ticket, StepOutcome(30.0, (0, 0), 0.0))
    # "a" and "b" are behind: what the engine holds for them is a placeholder. "c" is new.
    ticket = controller.begin(
        BatchView(("a", "b", "c"), (51, 61, 70), ((1.0,), (1.0,), (0.7, 0.2)))
    )
    assert seen[-1] == (None, None, (0.7, 0.2)) and ticket.confidence == seen[-1]
    assert ticket.decision.source == "catch-up"
    controller.finish(ticket, StepOutcome(30.0, (0, 0, 0), 0.0))
    # After the catch-up every draft is up to date; the held decision runs.
    ticket = controller.begin(BatchView(("a", "b", "c"), (52, 62, 71), ((0.3,), (0.4,), (0.5,))))
    assert ticket.confidence == ((0.3,), (0.4,), (0.5,))
    assert BatchView(("a",), (50,)).draft_confidence is None


def scripted(controller: StepController, script: list) -> list:
    """Make ``controller``'s policy decide ``script``'s (shape, source) in turn; returns the
    confidences each decision was given."""
    seen = []
    moves = iter(script)

    def decide(features, request_ids=(), confidence=None):
        seen.append(confidence)
        shape, source = next(moves)
        return Decision(shape, DecisionSource(source), 10.0, 1.0)

    controller.policy.decide = decide
    return seen


@pytest.mark.parametrize(
    ("source", "settings", "decides_again"),
    [
        ("fallback", {}, True),
        ("model", {}, True),
        ("explore", {}, False),  # run for what it measures
        ("warmup", {}, False),
        ("fallback", {"draft_confidence": False}, False),
    ],
)
def test_after_a_catch_up_the_goodput_rule_decides_again_on_the_known_confidence(
    source, settings, decides_again
):
    controller = StepController(config(**settings))
    seen = scripted(controller, [(NO_SPEC, "fallback"), (CHAIN, source), (NO_SPEC, "fallback")])
    ids = ("a",)
    first = controller.begin(BatchView(ids, (50,), ((0.9,),)))
    assert first.skips_draft_extend  # "a" is behind after it
    catch_up = controller.begin(BatchView(ids, (51,), ((1.0,),)))
    assert catch_up.decision.source == "catch-up" and catch_up.decision.runner_up == CHAIN
    known = controller.begin(BatchView(ids, (52,), ((0.1,),)))
    if decides_again:
        assert seen == [((0.9,),), None, ((0.1,),)]
        assert (known.decision.shape, known.decision.source) == (NO_SPEC, "fallback")
    else:
        assert len(seen) == 2 and known.decision.shape == CHAIN


def test_the_worker_hands_over_each_requests_first_layer_on_a_cpu():
    topk_p = torch.tensor([[0.7, 0.2, 0.05, 0.01], [0.3, 0.25, 0.2, 0.1]])  # [batch, relay]
    batch = SimpleNamespace(spec_info=SimpleNamespace(topk_p=topk_p), reqs=[object(), object()])
    worker = SimpleNamespace(
        _loop=object(), _on_cpu=True, _config=SimpleNamespace(draft_confidence=True)
    )
    layers = AdaTreeWorkerMixin._draft_confidence(worker, batch)
    assert layers == tuple(tuple(row) for row in topk_p.tolist())
    assert all(isinstance(p, float) for row in layers for p in row)
    # None where nothing is to be read: a GPU, the confidence off, or no relay of this batch.
    assert (
        AdaTreeWorkerMixin._draft_confidence(
            SimpleNamespace(**{**vars(worker), "_on_cpu": False}), batch
        )
        is None
    )
    off = SimpleNamespace(**{**vars(worker), "_config": SimpleNamespace(draft_confidence=False)})
    assert AdaTreeWorkerMixin._draft_confidence(off, batch) is None
    other = SimpleNamespace(spec_info=SimpleNamespace(topk_p=topk_p[:1]), reqs=batch.reqs)
    assert AdaTreeWorkerMixin._draft_confidence(worker, other) is None
