import itertools

import numpy as np
import pytest
import torch
from synthetic import sample_path_stats

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.acceptance import (
    PRIOR_RANK_RATIO,
    AcceptanceEstimator,
    AcceptedPathStats,
    accepted_counts,
)
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape

# Known acceptance: the top draft token is accepted less often deeper in the tree, and a
# sibling less often than the better-ranked one.
TRUE_HAZARDS = np.array(
    [[0.85 - 0.08 * d, 0.45 - 0.04 * d, 0.3 - 0.03 * d] for d in range(4)]
)  # [depth, rank]


def eagle2_expected_emitted(p: np.ndarray, shape: TreeShape) -> float:
    """Reference: build the EAGLE-2 candidate tree node by node and keep the best nodes."""
    if not shape.speculative:
        return 1.0
    k = shape.topk
    candidates, frontier = [], [1.0]
    for depth in range(shape.steps):
        layer = [value * p[depth, r] for value in frontier for r in range(k)]
        candidates += layer
        frontier = sorted(layer, reverse=True)[:k]
    return 1.0 + sum(sorted(candidates, reverse=True)[: shape.num_draft_tokens - 1])


@pytest.mark.parametrize("a", [0.3, 0.6, 0.85])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_chain_agrees_with_turbospec(a, k):
    est = AcceptanceEstimator(prior=a)
    assert est.expected_emitted(TreeShape(k, 1, k + 1)) == pytest.approx(
        (1 - a ** (k + 1)) / (1 - a)
    )


def test_paths_read_from_host_tensors_arrays_and_lists_are_lists_of_ints():
    want_children, want_ranks = [[2, 1, 0], [1, 0, 0]], [[1, -1, -1], [-1, -1, -1]]
    for kind in (torch.int32, torch.int64, np.int32, np.int64, list):
        if kind is list:
            stats = AcceptedPathStats(want_children, want_ranks)
        elif isinstance(kind, torch.dtype):
            stats = AcceptedPathStats(
                torch.tensor(want_children, dtype=kind), torch.tensor(want_ranks, dtype=kind)
            )
        else:
            stats = AcceptedPathStats(
                np.array(want_children, dtype=kind), np.array(want_ranks, dtype=kind)
            )
        listed = stats.as_lists()
        assert listed.num_children == want_children and listed.accepted_rank == want_ranks
        for row in (*listed.num_children, *listed.accepted_rank):
            assert all(type(v) is int for v in row)


def test_accepted_counts_are_the_batch_totals():
    # Two requests of a 3-deep tree with topk 2: the first accepted rank 1 then rank 0, the
    # second rejected both children of the root.
    stats = AcceptedPathStats([[2, 2, 0], [2, 0, 0]], [[1, 0, -1], [-1, -1, -1]])
    offered, by_depth, by_rank = accepted_counts(stats, topk=2)
    assert offered == (4, 2, 0) and by_depth == (1, 1, 0) and by_rank == (1, 1)
    arrays = AcceptedPathStats(*(np.array(a) for a in (stats.num_children, stats.accepted_rank)))
    assert accepted_counts(arrays, topk=2) == (offered, by_depth, by_rank)


def test_no_speculation_emits_one():
    assert AcceptanceEstimator().expected_emitted(NO_SPEC) == 1.0


def test_worked_example_from_the_docstring():
    # Prior 0.6 and rank ratio 0.5: hazards (0.6, 0.3) give p = (0.6, 0.3 * 0.4 = 0.12).
    assert PRIOR_RANK_RATIO == 0.5
    est = AcceptanceEstimator(prior=0.6)
    np.testing.assert_allclose(est.positional_acceptance()[0, :2], [0.6, 0.12])
    # Layer 1: 0.6, 0.12. Layer 2 (expand both): 0.36, 0.072, 0.072, 0.0144.
    assert est.expected_emitted(TreeShape(2, 2, 3)) == pytest.approx(1 + 0.6 + 0.36)
    assert est.expected_emitted(TreeShape(2, 2, 4)) == pytest.approx(1 + 0.6 + 0.36 + 0.12)
    assert est.expected_emitted(TreeShape(2, 2, 7)) == pytest.approx(
        1 + 0.6 + 0.12 + 0.36 + 0.072 + 0.072 + 0.0144
    )


def test_exact_counts_from_hand_written_paths():
    est = AcceptanceEstimator(prior_weight=0.0, refresh_every=1)
    shape = TreeShape(2, 3, 6)
    # Request 0: the root has 3 children, rank 1 accepted; that node has 2 children, both
    # rejected. Request 1: the root has 2 children, both rejected.
    num_children = torch.tensor([[3, 2], [2, 0]])
    accepted_rank = torch.tensor([[1, -1], [-1, -1]])
    est.observe(shape, num_children, accepted_rank)
    trials = est.effective_observations()
    np.testing.assert_array_equal(trials[0, :3], [2, 2, 0])
    np.testing.assert_array_equal(trials[1, :3], [1, 1, 0])
    h = est.hazards()
    np.testing.assert_allclose(h[0, :2], [0.0, 0.5])
    np.testing.assert_allclose(h[1, :2], [0.0, 0.0])
    assert h[0, 2] == est.prior_hazards[0, 2]  # never tried: the prior stands
    assert est.acceptance_length(shape) == pytest.approx(1.5)


def test_accepted_rank_past_num_children_still_a_probability():
    # A score tie may keep rank 2 but not rank 1; the accepted rank counts ranks 0..2 as tried.
    est = AcceptanceEstimator(prior_weight=0.0, refresh_every=1)
    est.observe(TreeShape(1, 3, 3), np.array([[2]]), np.array([[2]]))
    np.testing.assert_allclose(est.hazards()[0, :3], [0.0, 0.0, 1.0])


def test_contract_violations_are_caught():
    est = AcceptanceEstimator()
    with pytest.raises(AssertionError, match="depths"):
        est.observe(TreeShape(3, 1, 4), np.zeros((2, 2), dtype=int), np.zeros((2, 2), dtype=int))
    with pytest.raises(AssertionError, match="topk"):
        est.observe(TreeShape(2, 2, 3), np.full((1, 2), 3), np.full((1, 2), -1))


def run_synthetic(est, shape, hazards, steps, batch, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        nc, ar = sample_path_stats(shape, batch, hazards, rng)
        est.observe(shape, torch.from_numpy(nc), torch.from_numpy(ar))
    est.refresh()


def test_converges_to_known_acceptance_by_depth_and_rank():
    est = AcceptanceEstimator(prior=0.5, prior_weight=20.0, decay=0.01)
    run_synthetic(est, TreeShape(4, 3, 12), TRUE_HAZARDS, steps=400, batch=64, seed=1)
    h, n = est.hazards()[:4, :3], est.effective_observations()[:4, :3]
    assert n.min() > 100  # every (depth, rank) was tried
    # Four binomial standard errors plus the prior's pull (20 pseudo-observations).
    sigma = np.sqrt(TRUE_HAZARDS * (1 - TRUE_HAZARDS) / n)
    prior = est.prior_hazards[:4, :3]
    tolerance = 4 * sigma + 20 / (n + 20) * np.abs(prior - TRUE_HAZARDS)
    assert np.all(np.abs(h - TRUE_HAZARDS) <= tolerance), (h, tolerance)
    assert h[0, 0] == pytest.approx(TRUE_HAZARDS[0, 0], abs=0.02)
    assert est.confidence() > 0.99


def test_prior_fades_at_batch_size_one():
    # One request per step: the decayed evidence is only about 1 / decay = 50 trials, the same
    # order as the prior's 20 pseudo-observations. A prior that kept its weight would read
    # (0.2 * 50 + 0.6 * 20) / 70 = 0.31 for a true hazard of 0.2, for ever.
    est = AcceptanceEstimator(prior=0.6, prior_weight=20.0, decay=0.02, refresh_every=1)
    run_synthetic(est, TreeShape(1, 1, 2), np.full((1, 1), 0.2), steps=2000, batch=1, seed=7)
    hazards = []
    for seed in range(8, 28):  # the estimate is noisy at batch 1: average over a while
        run_synthetic(est, TreeShape(1, 1, 2), np.full((1, 1), 0.2), steps=25, batch=1, seed=seed)
        hazards.append(est.hazards()[0, 0])
    assert np.mean(hazards) == pytest.approx(0.2, abs=0.04)
    # A depth never measured takes the one above as its prior: the draft's measured 0.2, not
    # the configured prior's 0.6.
    assert est.hazards()[1, 0] == pytest.approx(est.hazards()[0, 0])
    assert est.hazards()[5, 0] == pytest.approx(est.hazards()[0, 0])


def test_expected_emitted_matches_the_eagle2_reference():
    est = AcceptanceEstimator(prior=0.5, decay=0.05)
    run_synthetic(est, TreeShape(4, 3, 12), TRUE_HAZARDS, steps=50, batch=32, seed=2)
    p = est.positional_acceptance()
    shapes = [*DEFAULT_CANDIDATES, TreeShape(4, 3, 9), TreeShape(4, 3, 29), TreeShape(2, 3, 5)]
    for shape in shapes:
        assert est.model_emitted(shape) == pytest.approx(eagle2_expected_emitted(p, shape))
    # Only 4,3,12 ran: nothing to correct the model by, every factor is 1.
    assert all(est.correction(s) == pytest.approx(1.0) for s in shapes)
    np.testing.assert_allclose(
        est.expected_emitted_many(shapes), [eagle2_expected_emitted(p, s) for s in shapes]
    )


def test_a_first_layer_token_is_worth_the_kept_nodes_below_it():
    # The worked example's estimator: p = (0.6, 0.12) at every depth.
    est = AcceptanceEstimator(prior=0.6)
    shapes = (NO_SPEC, TreeShape(1, 1, 2), TreeShape(3, 1, 4), TreeShape(2, 2, 3),
              TreeShape(2, 2, 4), TreeShape(2, 2, 7))  # fmt: skip
    w = est.first_layer_weights(shapes)  # [ranks, shapes]
    assert w.shape == (2, len(shapes))
    np.testing.assert_allclose(w[:, 0], [0, 0])  # no speculation keeps no node
    np.testing.assert_allclose(w[:, 1], [1, 0])  # the chain: its one node
    np.testing.assert_allclose(w[:, 2], [1 + 0.6 + 0.36, 0])
    # 2,2,3 keeps 0.6 and 0.36 below it; 2,2,4 adds the second first-layer token; 2,2,7 all.
    np.testing.assert_allclose(w[:, 3], [1 + 0.6, 0])
    np.testing.assert_allclose(w[:, 4], [1 + 0.6, 1])
    np.testing.assert_allclose(w[:, 5], [1 + 0.6 + 0.12, 1 + 0.6 + 0.12])
    assert est.first_layer_weights(shapes) is w  # kept until the next refresh
    est.refresh()
    assert est.first_layer_weights(shapes) is not w


def test_first_layer_weights_at_the_estimators_own_first_depth_give_its_estimates():
    est = AcceptanceEstimator(prior=0.5, decay=0.05)
    run_synthetic(est, TreeShape(4, 3, 12), TRUE_HAZARDS, steps=50, batch=32, seed=2)
    shapes = (*DEFAULT_CANDIDATES, TreeShape(4, 3, 9), TreeShape(2, 3, 5))
    w = est.first_layer_weights(shapes)  # [ranks, shapes]
    p0 = est.positional_acceptance()[0, : w.shape[0]]
    np.testing.assert_allclose(1.0 + p0 @ w, [est.model_emitted(s) for s in shapes])


def test_more_tokens_never_emit_less():
    est = AcceptanceEstimator(prior=0.7)
    for steps, topk in itertools.product(range(1, 6), range(2, 5)):
        base = TreeShape(steps, topk, 2)
        values = [
            est.expected_emitted(TreeShape(steps, topk, n))
            for n in range(2, base.num_candidates + 2)
        ]
        assert values == sorted(values)
        assert values[-1] <= steps + 1


@pytest.mark.parametrize("seed", range(6))
def test_a_dominating_shape_never_expects_fewer_tokens(seed):
    # The positional model, for any hazards, never expects fewer tokens of a shape at least as
    # deep, as wide and as large as another (``TreeShape.dominates``): it keeps at least as
    # many of a richer set of candidates.
    rng = np.random.default_rng(seed)
    est = AcceptanceEstimator(prior=0.5, decay=0.05, refresh_every=1)
    hazards = rng.uniform(0.05, 0.95, size=(16, 16))
    for shape in DEFAULT_CANDIDATES[1:]:
        run_synthetic(est, shape, hazards, steps=20, batch=4, seed=seed)
    model = {s: est.model_emitted(s) for s in DEFAULT_CANDIDATES}
    pairs = [(a, b) for a in DEFAULT_CANDIDATES for b in DEFAULT_CANDIDATES if a.dominates(b)]
    assert len(pairs) > 20
    for a, b in pairs:
        assert model[a] >= model[b] - 1e-12, (a, b)


def test_decay_follows_a_change_in_acceptance():
    shape = TreeShape(2, 1, 3)
    est = AcceptanceEstimator(prior=0.5, decay=0.05, refresh_every=1)
    run_synthetic(est, shape, np.full((2, 1), 0.9), steps=200, batch=16, seed=3)
    assert est.hazards()[0, 0] == pytest.approx(0.9, abs=0.05)
    run_synthetic(est, shape, np.full((2, 1), 0.3), steps=100, batch=16, seed=4)
    assert est.hazards()[0, 0] == pytest.approx(0.3, abs=0.05)
    assert est.acceptance_length(shape) == pytest.approx(1 + 0.3 + 0.09, abs=0.1)


def test_estimates_move_only_at_refresh():
    est = AcceptanceEstimator(prior=0.5, refresh_every=4)
    shape = TreeShape(1, 1, 2)
    revision, before = est.revision, est.expected_emitted(shape)
    accept_all = (np.ones((8, 1), dtype=int), np.zeros((8, 1), dtype=int))
    for _ in range(3):
        est.observe(shape, *accept_all)
    assert est.revision == revision and est.expected_emitted(shape) == before
    est.observe(shape, *accept_all)
    assert est.revision == revision + 1 and est.expected_emitted(shape) > before


def test_from_config():
    config = AdaTreeConfig(acceptance_prior=0.7, acceptance_prior_weight=5.0, acceptance_decay=0.1)
    est = AcceptanceEstimator.from_config(config)
    assert (est.prior_weight, est.decay) == (5.0, 0.1)
    assert est.hazards()[0, 0] == pytest.approx(0.7)
    assert est.confidence() == 0.0


def chain_emitted(hazards: np.ndarray, steps: int) -> float:
    """Expected emitted tokens of a chain whose depth-d draft token is accepted with
    ``hazards[d]`` once the ones before it were."""
    return 1.0 + float(np.cumprod(hazards[:steps]).sum())


def test_a_shape_the_positional_model_overrates_gets_corrected():
    # Trees (3,2,6) run most of the time and follow TRUE_HAZARDS; the chain 3,1,4 runs in
    # streaks of 10 steps in 100 (the policy keeps a shape for a while), and its deep tokens are
    # accepted less often than the trees' deep nodes (a chain drafts them whatever the draft's
    # confidence): the positional model overrates it.
    tree, chain = TreeShape(3, 2, 6), TreeShape(3, 1, 4)
    chain_hazards = TRUE_HAZARDS.copy()
    chain_hazards[1:, 0] *= 0.6
    est = AcceptanceEstimator(prior=0.5, prior_weight=20.0, decay=0.005, refresh_every=16)
    rng = np.random.default_rng(11)
    for i in range(3000):
        shape, hazards = (chain, chain_hazards) if i % 100 < 10 else (tree, TRUE_HAZARDS)
        est.observe(shape, *sample_path_stats(shape, 1, hazards, rng))
    est.refresh()
    truth = chain_emitted(chain_hazards[:, 0], 3)
    model, corrected = est.model_emitted(chain), est.expected_emitted(chain)
    assert model - truth > 0.3  # the bias the correction is for
    assert abs(corrected - truth) < 0.6 * (model - truth)
    # The trees the hazards come from stay as the model says, and shapes never run get no
    # correction.
    assert est.correction(tree) == pytest.approx(1.0, abs=0.05)
    assert est.correction(TreeShape(2, 2, 4)) == 1.0


def test_the_shape_with_the_most_evidence_is_predicted_by_the_hazards_alone():
    # One shape running through a drop in acceptance: the hazards lag, its own ratio misses
    # for a while, yet its factor stays 1, so the level of every estimate is the hazards'.
    shape = TreeShape(2, 2, 4)
    est = AcceptanceEstimator(prior=0.5, decay=0.005, refresh_every=16)
    run_synthetic(est, shape, np.full((2, 2), 0.9), steps=600, batch=1, seed=12)
    for block in range(8):
        run_synthetic(est, shape, np.full((2, 2), 0.3), steps=50, batch=1, seed=13 + block)
        assert est.correction(shape) == 1.0
        assert est.expected_emitted(shape) == est.model_emitted(shape)


def test_corrected_estimates_stay_possible():
    # A shape that emitted more than its model predicts is clipped at steps + 1.
    est = AcceptanceEstimator(prior=0.5, prior_weight=0.0, refresh_every=1, factor_prior_weight=0.0)
    tree, chain = TreeShape(2, 2, 4), TreeShape(1, 1, 2)
    for i in range(150):
        est.observe(tree, np.array([[2, 0]]), np.array([[-1, -1]]))  # nothing accepted
        if i % 3 == 0:
            est.observe(chain, np.array([[1]]), np.array([[0]]))  # always accepted
    est.refresh()
    assert est.correction(tree) == 1.0  # the most evidence: the reference
    assert est.correction(chain) > 2.0 / est.model_emitted(chain)
    assert est.expected_emitted(chain) == 2.0


def chain_factor_after(chain_streaks: int, factor_prior_weight: float) -> float:
    """The chain 3,1,4's correction after 2000 steps of the tree 3,2,6 but for
    ``chain_streaks`` streaks of 10 steps of the chain among the last ones, both under
    TRUE_HAZARDS except the chain's deep tokens, accepted less often (as in
    ``test_a_shape_the_positional_model_overrates_gets_corrected``)."""
    tree, chain = TreeShape(3, 2, 6), TreeShape(3, 1, 4)
    chain_hazards = TRUE_HAZARDS.copy()
    chain_hazards[1:, 0] *= 0.6
    est = AcceptanceEstimator(prior=0.5, factor_prior_weight=factor_prior_weight)
    rng = np.random.default_rng(5)
    for i in range(2000):
        runs_chain = i % 100 < 10 and i // 100 >= 20 - chain_streaks
        shape, hazards = (chain, chain_hazards) if runs_chain else (tree, TRUE_HAZARDS)
        est.observe(shape, *sample_path_stats(shape, 1, hazards, rng))
    est.refresh()
    return est.correction(chain)


def test_a_shape_factor_is_shrunk_towards_1_by_its_prior_weight():
    # The policy runs the shape whose estimate is highest, so a factor moved by a few lucky
    # steps is acted on: a heavier prior keeps a factor measured on a few steps nearer 1, and
    # takes a smaller share off one measured on many, which still corrects the model's bias.
    few = [1.0 - chain_factor_after(1, w) for w in (20.0, 60.0)]
    many = [1.0 - chain_factor_after(20, w) for w in (20.0, 60.0)]
    assert 0.0 < few[1] < 0.5 * few[0]
    assert 0.0 < many[1] < many[0] and many[1] / many[0] > 0.6
    assert many[1] > 0.1


def test_steps_before_the_first_refresh_set_no_shape_factor():
    # A warm-up at batch 32 runs each shape once before the first refresh: the model it is
    # measured against is still the prior (0.5 where the draft accepts 0.85), so every shape
    # beats it. Counted with the confidence of the live counts (already 0.6 after one step of
    # 32) that miss set the tree's factor for as long as the tree did not run again, while the
    # chain that kept running measured its own back to 1: the tree stayed overrated by a fifth.
    tree, chain = TreeShape(3, 2, 6), TreeShape(3, 1, 4)
    est = AcceptanceEstimator(prior=0.5, prior_weight=20.0, decay=0.005, refresh_every=16)
    rng = np.random.default_rng(21)
    for shape in (chain, tree):
        est.observe(shape, *sample_path_stats(shape, 32, TRUE_HAZARDS, rng))
    for _ in range(300):
        est.observe(chain, *sample_path_stats(chain, 32, TRUE_HAZARDS, rng))
    est.refresh()
    assert est.correction(chain) == 1.0  # the reference
    assert est.correction(tree) == pytest.approx(1.0, abs=0.03)
