import numpy as np
import pytest
import torch

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.acceptance import AcceptanceEstimator, AcceptedPathStats
from sglang_adatree.core.baselines import (
    BASELINE_POLICIES,
    AdaptiveSlot,
    SGLangAdaptivePolicy,
    TurboSpecPolicy,
    chain_shapes,
    nearest_steps,
)
from sglang_adatree.core.controller import BatchView, StepController, StepOutcome
from sglang_adatree.core.cost_model import AnalyticStepTime, OnlineCostModel
from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.policy import Pin
from sglang_adatree.core.shapes import NO_SPEC, TreeShape, parse_candidates

CHAINS = parse_candidates("0;1,1,2;2,1,3;3,1,4;5,1,6;3,2,6")


def step_time(fixed: float = 30.0, per_pass: float = 0.0, per_token: float = 0.0):
    """Step time = fixed + per draft pass * steps + per verified token * B * draft tokens."""
    return AnalyticStepTime(c_fixed=fixed, c_bs=0, c_compute=per_token, c_kv=0, c_spec=0,
                            c_draft_pass=per_pass, c_draft_token=0)  # fmt: skip


def make(cls, candidates=CHAINS, time_model=None):
    config = AdaTreeConfig(candidate_shapes=candidates)
    cost = OnlineCostModel(time_model or step_time(), config.residual_decay)
    return cls(config, cost, AcceptanceEstimator.from_config(config))


def batch(b: int) -> StepFeatures:
    return StepFeatures(b, b, 100 * b, 100)


def chain_stats(accepted: list[int], steps: int) -> AcceptedPathStats:
    """Verify stats of a chain: request i accepted its first ``accepted[i]`` draft tokens."""
    ranks = torch.full((len(accepted), steps), -1, dtype=torch.int64)  # [batch, steps]
    children = torch.zeros((len(accepted), steps), dtype=torch.int64)  # [batch, steps]
    for i, a in enumerate(accepted):
        ranks[i, :a] = 0
        children[i, : min(a + 1, steps)] = 1
    return AcceptedPathStats(children, ranks)


# -- TurboSpec ----------------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0.3, 0.5, 0.7, 0.9])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_turbospec_chain_formula_agrees_with_the_acceptance_model(a, k):
    policy = make(TurboSpecPolicy)
    policy.accept_rate = a
    # adatree's estimator with rank-0 acceptance a at every depth and no data: the same chain.
    estimator = AcceptanceEstimator(prior=a, prior_weight=1e6)
    assert policy.expected_emitted(k) == pytest.approx(
        estimator.expected_emitted(TreeShape(k, 1, k + 1)), rel=1e-9
    )
    assert policy.expected_emitted(k) == pytest.approx(sum(a**i for i in range(k + 1)))


def test_turbospec_formula_by_hand_and_full_acceptance():
    policy = make(TurboSpecPolicy)
    policy.accept_rate = 0.5
    assert policy.expected_emitted(2) == pytest.approx(1.75)
    assert policy.expected_emitted(0) == 1.0
    policy.accept_rate = 1.0
    assert policy.expected_emitted(3) == 4.0


def test_turbospec_picks_the_goodput_argmax_chain_only():
    # 30 ms per step plus 6 ms per draft pass, a = 0.7: E / T per k is
    # k=0 1/30, k=1 1.7/36, k=2 2.19/42, k=3 2.533/48, k=5 2.94/60 -> k=3 (0.0528) beats
    # k=2 (0.0521) and k=5 (0.049); the tree 3,2,6 is not a TurboSpec candidate.
    policy = make(TurboSpecPolicy, time_model=step_time(per_pass=6.0))
    decision = policy.decide(batch(4))
    assert decision.shape == TreeShape(3, 1, 4)
    assert decision.source == "fallback"
    assert decision.predicted_emitted == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert decision.predicted_ms == pytest.approx(48.0)
    assert TreeShape(3, 2, 6) not in policy.shapes


def test_turbospec_no_spec_must_be_beaten_by_ten_percent():
    # k=1 only, a = 0.7: E = 1.7. Its goodput ratio over k=0 is 1.7 * 30 / (30 + d).
    only = (NO_SPEC, TreeShape(1, 1, 2))
    for ratio, expected in [(1.08, NO_SPEC), (1.12, TreeShape(1, 1, 2))]:
        draft_ms = 1.7 * 30.0 / ratio - 30.0
        policy = make(TurboSpecPolicy, only, step_time(per_pass=draft_ms))
        assert policy.decide(batch(1)).shape == expected


def test_turbospec_ema_update_and_refresh_every_twenty_steps():
    policy = make(TurboSpecPolicy, time_model=step_time(per_pass=6.0))
    first = policy.decide(batch(2)).shape
    assert first == TreeShape(3, 1, 4)
    # Both requests accept nothing: a <- 0.85 * 0.7 + 0.15 * 0 each step.
    for _ in range(19):
        policy.observe(batch(2), first, 48.0, chain_stats([0, 0], 3))
        assert policy.decide(batch(2)).shape == first  # no refresh inside the 20-step window
    assert policy.accept_rate == pytest.approx(0.7 * 0.85**19)
    assert policy.decide(batch(2)).shape == NO_SPEC  # step 20 refreshes: a is ~0.03 now


def test_turbospec_accept_rate_counts_accepted_over_drafted():
    policy = make(TurboSpecPolicy)
    policy.observe(batch(2), TreeShape(3, 1, 4), 40.0, chain_stats([3, 1], 3))
    assert policy.accept_rate == pytest.approx(0.85 * 0.7 + 0.15 * 4 / 6)
    policy.observe(batch(2), NO_SPEC, 30.0, None)  # no speculation: nothing to learn
    assert policy.accept_rate == pytest.approx(0.85 * 0.7 + 0.15 * 4 / 6)


def test_turbospec_pins_win_every_step():
    policy = make(TurboSpecPolicy, time_model=step_time(per_pass=6.0))
    policy.set_pins([Pin(TreeShape(3, 2, 6), min_batch_size=4)])
    assert policy.decide(batch(4)).shape == TreeShape(3, 2, 6)
    assert policy.decide(batch(4)).source == "pin"
    assert policy.decide(batch(1)).shape == TreeShape(3, 1, 4)
    with pytest.raises(ValueError, match="not a candidate"):
        policy.set_pins([Pin(TreeShape(4, 4, 12))])


def test_turbospec_uses_a_new_cost_model_and_labels_it():
    policy = make(TurboSpecPolicy, time_model=step_time(per_pass=6.0))
    policy.set_cost_model(OnlineCostModel(step_time(per_pass=0.0), 0.05), policy_version=3)
    decision = policy.decide(batch(1))
    assert decision.shape == TreeShape(5, 1, 6)  # free draft passes: the longest chain
    assert decision.source == "model" and policy.policy_version == 3


def test_baselines_need_a_chain():
    with pytest.raises(ValueError, match="chains"):
        make(TurboSpecPolicy, parse_candidates("0;3,2,6"))
    assert chain_shapes(CHAINS) == {
        0: NO_SPEC,
        1: TreeShape(1, 1, 2),
        2: TreeShape(2, 1, 3),
        3: TreeShape(3, 1, 4),
        5: TreeShape(5, 1, 6),
    }


# -- SGLang's adaptive rule -----------------------------------------------------------------------


def test_nearest_steps_prefers_the_shorter_chain_on_a_tie():
    assert nearest_steps(7, (0, 1, 2, 3, 5)) == 5
    assert nearest_steps(4, (1, 3, 5)) == 3
    assert nearest_steps(0, (1, 2)) == 1


def test_sglang_tiers_map_to_the_candidate_chains_and_slots_route_by_batch_size():
    policy = make(SGLangAdaptivePolicy)
    tiers = {bs: slot.candidate_steps for bs, slot in policy.slots.items()}
    assert tiers == {1: (1, 3, 5), 8: (0, 1, 3), 32: (0, 1), 64: (0,)}
    starts = {bs: slot.current_steps for bs, slot in policy.slots.items()}
    assert starts == {1: 3, 8: 3, 32: 1, 64: 0}  # 3 where the tier has it, else its middle
    for b, slot in [(1, 1), (7, 1), (8, 8), (31, 8), (32, 32), (63, 32), (64, 64), (200, 64)]:
        assert policy.slot_for(b) is policy.slots[slot]
    assert policy.decide(batch(64)).shape == NO_SPEC
    assert policy.decide(batch(40)).shape == TreeShape(1, 1, 2)


def test_sglang_without_no_spec_maps_zero_to_the_shortest_chain():
    policy = make(SGLangAdaptivePolicy, parse_candidates("1,1,2;3,1,4"))
    assert policy.slots[64].candidate_steps == (1,)
    assert policy.slots[8].candidate_steps == (1, 3)


def test_sglang_warmup_then_decide_every_five_batches():
    policy = make(SGLangAdaptivePolicy)
    # Every request accepts all 3 drafts: the EMA climbs from 2 towards 3.
    sources = []
    for _ in range(15):
        decision = policy.decide(batch(1))
        sources.append(decision.source)
        policy.observe(batch(1), decision.shape, 40.0, chain_stats([3], decision.shape.steps))
        if len(sources) < 15:
            assert policy.slots[1].current_steps == 3  # warm-up, then 4 batches to wait
    assert sources == ["warmup"] * 10 + ["fallback"] * 5
    slot = policy.slots[1]
    assert slot.ema_accept_len == pytest.approx(3 - 0.8**15)  # 2 -> 3 at weight 0.2
    assert slot.current_steps == 5  # 15th batch: EMA 2.96 > 3 - 0.5 -> up one tier


def test_sglang_hysteresis_of_the_batch_one_slot():
    # At steps 5, dropping to 3 needs EMA <= 3 - 0.5 + hysteresis.
    def at(ema, hysteresis):
        slot = AdaptiveSlot((1, 3, 5), hysteresis, current_steps=5, ema_accept_len=ema)
        return slot.recompute()

    assert at(2.4, 0.0) == 3  # without hysteresis 2.4 <= 2.5 drops
    assert at(2.4, -0.25) == 5  # the batch-1 slot keeps 5 until 2.25
    assert at(2.2, -0.25) == 3
    assert at(0.2, -0.25) == 1  # several tiers down in one decision
    assert at(4.6, 0.0) == 5  # already at the top


def test_sglang_probes_up_from_no_speculation_and_steps_down_to_it():
    slot = AdaptiveSlot((0, 1, 3), 0.0, current_steps=0, ema_accept_len=-1.0)
    assert slot.recompute() == 1 and slot.ema_accept_len == 0.0
    slot = AdaptiveSlot((0, 1, 3), 0.0, current_steps=1, ema_accept_len=0.4)
    assert slot.recompute() == 0
    slot = AdaptiveSlot((0, 1, 3), 0.0, current_steps=1, ema_accept_len=0.6)
    assert slot.recompute() == 3  # 0.6 > 1 - 0.5


def test_sglang_slots_learn_independently():
    policy = make(SGLangAdaptivePolicy)
    for _ in range(15):
        policy.observe(batch(8), TreeShape(3, 1, 4), 40.0, chain_stats([0] * 8, 3))
    assert policy.slots[8].current_steps == 0  # nothing accepted: drafting is switched off
    assert policy.slots[1].current_steps == 3 and policy.slots[1].batch_count == 0
    assert policy.decide(batch(8)).shape == NO_SPEC


# -- both, through adatree's serving loop -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BASELINE_POLICIES))
def test_baselines_run_in_the_serving_loop(name):
    config = AdaTreeConfig(candidate_shapes=CHAINS, policy=name, record_steps=False)
    controller = StepController(config)
    assert isinstance(controller.policy, BASELINE_POLICIES[name])
    view = BatchView(("a", "b"), (120, 80))
    for _ in range(30):
        ticket = controller.begin(view)
        shape = ticket.decision.shape
        assert shape == NO_SPEC or shape.is_chain
        steps = shape.steps
        stats = chain_stats([min(1, steps)] * 2, steps) if steps else None
        controller.finish(ticket, StepOutcome(35.0, (min(1, steps),) * 2, 0.0, stats))
        view = BatchView(view.request_ids, tuple(n + 1 + min(1, steps) for n in view.context_lens))
    state = controller.server_state()
    assert state["adatree_steps"] == 30 and state["adatree_shape"] is not None
    assert np.isfinite(state["adatree_recent_accept_length"])
