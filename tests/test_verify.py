import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare
from tree_fixtures import (
    children_of,
    random_links,
    random_shape,
    random_tree,
    run_sglang_triton,
    six_node_draft,
)

from sglang_adatree.sglang.cpu.verify import (
    target_probs_from_logits,
    top_k_renorm_prob,
    top_p_renorm_prob,
    verify_tree_greedy,
    verify_tree_sampling,
)
from sglang_adatree.sglang.tree import TreeMaskMode, build_verify_tree, organize_draft_results


def buffers(batch, n, steps):
    """Output buffers as SGLang allocates them before a verify kernel runs."""
    return (
        torch.zeros(batch * n, dtype=torch.int32),
        torch.full((batch, steps + 1), -1, dtype=torch.int32),
        torch.empty(batch, dtype=torch.int32),
    )


def greedy(candidates, retrieve_index, next_token, next_sibling, target_predict, steps):
    batch, n = candidates.shape
    return verify_tree_greedy(
        *buffers(batch, n, steps),
        candidates,
        retrieve_index,
        next_token,
        next_sibling,
        target_predict,
    )


def six_node_tree(batch, tokens=(10, 11, 20, 22, 30)):
    """The tree of tree_fixtures.six_node_draft, with the given node tokens (root: 7)."""
    selection = organize_draft_results(*six_node_draft(batch), num_draft_tokens=6)
    return build_verify_tree(
        torch.full((batch,), 7, dtype=torch.int32),
        selection.parent_list,
        selection.top_scores_index,
        torch.tensor([list(tokens)]).expand(batch, -1),
        torch.full((batch,), 5),
        5 * batch,
        2,
        3,
        6,
        TreeMaskMode.QLEN_ONLY,
    )


# -- greedy ------------------------------------------------------------------------------


def test_greedy_by_hand():
    #   0 ─┬─ 1 (10) ── 3 (20) ── 5 (30)
    #      └─ 2 (11) ── 4 (22)
    tree = six_node_tree(3)
    target = torch.tensor(
        [
            [10, 20, 0, 30, 0, 99],  # the whole left branch, then bonus 99
            [11, 0, 22, 0, 5, 0],  # second child of the root, then its child, bonus 5
            [3, 10, 11, 20, 22, 30],  # nothing: bonus 3 at the root
        ]
    )
    result = greedy(
        tree.draft_tokens.view(3, 6),
        tree.retrieve_index,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        target,
        3,
    )
    assert result.accept_token_num.tolist() == [3, 2, 0]
    assert result.accept_index.tolist() == [[0, 1, 3, 5], [6, 8, 10, -1], [12, -1, -1, -1]]
    assert result.predicts.view(3, 6).tolist() == [
        [10, 20, 0, 30, 0, 99],
        [11, 0, 22, 0, 5, 0],
        [3, 0, 0, 0, 0, 0],
    ]
    assert result.predicts.dtype == result.accept_index.dtype == torch.int32


def chain_accept_length(candidates, target, path):
    """Verify one root-to-leaf path as a chain with the same function: accepted tokens."""
    n = len(path)
    result = greedy(
        candidates[path].unsqueeze(0),
        torch.arange(n).unsqueeze(0),
        torch.tensor([[*range(1, n), -1]]),
        torch.full((1, n), -1),
        target[path].unsqueeze(0),
        n - 1,
    )
    return int(result.accept_token_num[0])


def root_to_leaf_paths(tree, b):
    paths, stack = [], [[0]]
    while stack:
        path = stack.pop()
        kids = children_of(tree, b, path[-1])
        if not kids:
            paths.append(path)
        stack.extend([*path, k] for k in kids)
    return paths


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), vocab=st.integers(2, 8))
def test_greedy_tree_equals_best_root_to_leaf_chain(seed, batch, vocab):
    gen = torch.Generator().manual_seed(seed)
    steps, topk, n = random_shape(gen)
    drawn = random_tree(batch, steps, topk, n, max(vocab, topk), gen)
    tree, candidates = drawn.tree, drawn.candidates
    # Targets that often agree with a child, so long paths get accepted.
    target = torch.randint(0, max(vocab, topk), (batch, n), generator=gen)
    for b in range(batch):
        for node in range(n):
            kids = children_of(tree, b, node)
            if kids and float(torch.rand(1, generator=gen)) < 0.75:
                pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                target[b, node] = candidates[b, pick]
    result = greedy(
        candidates,
        tree.retrieve_index,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        target,
        steps,
    )
    for b in range(batch):
        lengths = {
            tuple(path): chain_accept_length(candidates[b], target[b], path)
            for path in root_to_leaf_paths(tree, b)
        }
        best = max(lengths.values())
        assert int(result.accept_token_num[b]) == best
        # Siblings hold distinct tokens, so exactly one path prefix is that long.
        prefixes = {path[: best + 1] for path, length in lengths.items() if length == best}
        assert len(prefixes) == 1
        (prefix,) = prefixes
        flat = [b * n + node for node in prefix]
        assert result.accept_index[b, : best + 1].tolist() == flat
        assert result.accept_index[b, best + 1 :].tolist() == [-1] * (steps - best)
        assert result.predicts[flat].tolist() == target[b, list(prefix)].tolist()


def reference_greedy(candidates, retrieve_index, next_token, next_sibling, target, steps):
    """SGLang's greedy verify kernel, one request and one link at a time."""
    batch, n = candidates.shape
    predicts, accept_index, accept_num = buffers(batch, n, steps)
    target_flat = target.flatten()
    for b in range(batch):
        last = int(retrieve_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(steps):
            cur = int(next_token[b, cur])
            while cur != -1:
                if int(candidates[b, cur]) == int(target_flat[last]):
                    predicts[last] = target_flat[last]
                    accepted += 1
                    last = int(retrieve_index[b, cur])
                    accept_index[b, accepted] = last
                    break
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
        accept_num[b] = accepted
        predicts[last] = target_flat[last]
    return predicts, accept_index, accept_num


def test_greedy_follows_arbitrary_links_like_the_kernel():
    # Node ids out of depth order, children linked in random order, duplicate sibling tokens:
    # the first matching child in link order wins, as in the kernel.
    gen = torch.Generator().manual_seed(7)
    for _ in range(40):
        batch, n = 3, int(torch.randint(2, 12, (1,), generator=gen))
        next_token, next_sibling = random_links(batch, n, gen)
        candidates = torch.randint(0, 3, (batch, n), generator=gen)
        target = torch.randint(0, 3, (batch, n), generator=gen)
        retrieve_index = torch.arange(batch * n).view(batch, n)
        steps = n - 1
        args = (candidates, retrieve_index, next_token, next_sibling, target, steps)
        result = greedy(*args)
        expected = reference_greedy(*args)
        assert result.predicts.tolist() == expected[0].tolist()
        assert result.accept_index.tolist() == expected[1].tolist()
        assert result.accept_token_num.tolist() == expected[2].tolist()


def test_greedy_one_node_tree_emits_the_target_token():
    # A step without speculation verifies a one-node tree per request; SGLang builds its
    # retrieve_index as arange(batch), other callers may number the roots otherwise.
    gen = torch.Generator().manual_seed(3)
    for retrieve_index in (torch.arange(4).view(4, 1), torch.tensor([[2], [0], [3], [1]])):
        candidates = torch.randint(0, 50, (4, 1), generator=gen)
        target = torch.randint(0, 50, (4, 1), generator=gen)
        none = torch.full((4, 1), -1)
        args = (candidates, retrieve_index, none, none, target, 0)
        result = greedy(*args)
        expected = reference_greedy(*args)
        assert result.predicts.tolist() == expected[0].tolist()
        assert result.accept_index.tolist() == expected[1].tolist()
        assert result.accept_token_num.tolist() == [0, 0, 0, 0] == expected[2].tolist()


@pytest.mark.slow
def test_greedy_matches_sglang_triton_kernel(tmp_path):
    gen = torch.Generator().manual_seed(13)
    cases = []
    for _ in range(40):
        steps, topk, n = random_shape(gen)
        batch = int(torch.randint(1, 4, (1,), generator=gen))
        drawn = random_tree(batch, steps, topk, n, 6, gen)
        # A small vocabulary makes matches, and so long accepted paths, common.
        target = torch.randint(0, 6, (batch, n), generator=gen)
        cases.append((drawn, target))
    payload = [
        (
            d.candidates,
            d.tree.retrieve_index,
            d.tree.retrieve_next_token,
            d.tree.retrieve_next_sibling,
            target,
            d.steps,
        )
        for d, target in cases
    ]
    code = """
result = []
for candidates, index, next_token, next_sibling, target, steps in payload:
    batch, n = candidates.shape
    predicts = torch.zeros(batch * n, dtype=torch.int32)
    accept_index = torch.full((batch, steps + 1), -1, dtype=torch.int32)
    accept_num = torch.empty(batch, dtype=torch.int32)
    spec_tree.verify_tree_greedy_triton(
        predicts, accept_index, accept_num, candidates, index, next_token, next_sibling, target)
    result.append((predicts, accept_index, accept_num))
"""
    expected = run_sglang_triton(code, payload, tmp_path)
    accepted = 0
    for args, (predicts, accept_index, accept_num) in zip(payload, expected, strict=True):
        result = greedy(*args)
        assert torch.equal(result.predicts, predicts)
        assert torch.equal(result.accept_index, accept_index)
        assert torch.equal(result.accept_token_num, accept_num)
        accepted += int(accept_num.sum())
    assert accepted > 20  # the comparison covered accepted paths, not only rejections


# -- sampling ----------------------------------------------------------------------------


def reference_sampling(
    candidates,
    retrieve_index,
    next_token,
    next_sibling,
    coins,
    final_coins,
    target_probs,
    draft_probs,
    threshold_single,
    threshold_acc,
    steps,
):
    """SGLang's CUDA sampling verify kernel, one request and one link at a time."""
    batch, n, vocab = target_probs.shape
    predicts, accept_index, accept_num = buffers(batch, n, steps)
    threshold_acc = max(threshold_acc, 1e-9)
    for b in range(batch):
        mass, row, coin = torch.tensor(0.0), 0, coins[b, 0]
        last = int(retrieve_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(steps):
            cur = int(next_token[b, cur])
            while cur != -1:
                token = int(candidates[b, cur])
                prob = target_probs[b, row, token]
                mass = mass + prob
                if prob > 0 and (coin < mass / threshold_acc or prob >= threshold_single):
                    mass, row, coin = torch.tensor(0.0), cur, coins[b, cur]
                    predicts[last] = token
                    accepted += 1
                    last = int(retrieve_index[b, cur])
                    accept_index[b, accepted] = last
                    break
                draft_probs[b, row, token] = target_probs[b, row, token]
                cur = int(next_sibling[b, cur])
            if cur == -1:
                break
        accept_num[b] = accepted
        subtract = draft_probs[b, row] if accepted != steps else 0.0
        residual = (target_probs[b, row] - subtract).clamp(min=0)
        below = residual.cumsum(0) <= final_coins[b] * residual.sum()
        sampled = int(below.sum())
        if sampled == vocab:
            positive = torch.nonzero(residual > 0).flatten()
            sampled = int(positive[-1]) if len(positive) else vocab - 1
        predicts[last] = sampled
    return predicts, accept_index, accept_num


@pytest.mark.parametrize(("threshold_single", "threshold_acc"), [(1.0, 1.0), (0.3, 0.5)])
def test_sampling_matches_the_kernel_step_by_step(threshold_single, threshold_acc):
    gen = torch.Generator().manual_seed(17)
    for trial in range(40):
        batch, vocab = 3, 6
        if trial % 2:
            steps, topk, n = random_shape(gen)
            drawn = random_tree(batch, steps, topk, n, vocab, gen)
            links = drawn.tree.retrieve_next_token, drawn.tree.retrieve_next_sibling
            candidates = drawn.candidates
        else:  # arbitrary links and duplicate sibling tokens
            n = int(torch.randint(2, 10, (1,), generator=gen))
            steps = n - 1
            links = random_links(batch, n, gen)
            candidates = torch.randint(0, vocab, (batch, n), generator=gen)
        probs = torch.softmax(2 * torch.randn(batch, n, vocab, generator=gen), dim=-1)
        probs = probs.masked_fill(torch.rand(probs.shape, generator=gen) < 0.2, 0.0)
        args = (
            candidates,
            torch.arange(batch * n).view(batch, n),
            *links,
            torch.rand(batch, n, generator=gen),
            torch.rand(batch, generator=gen),
            probs,
        )
        scratch = torch.zeros_like(probs)
        result = verify_tree_sampling(
            *buffers(batch, n, steps), *args, scratch, threshold_single, threshold_acc
        )
        reference_scratch = torch.zeros_like(probs)
        expected = reference_sampling(
            *args, reference_scratch, threshold_single, threshold_acc, steps
        )
        assert result.predicts.tolist() == expected[0].tolist()
        assert result.accept_index.tolist() == expected[1].tolist()
        assert result.accept_token_num.tolist() == expected[2].tolist()
        assert torch.equal(scratch, reference_scratch)  # rejected children, as the kernel


# Target distributions of the statistical test, one row per node of the six-node tree.
NODE_PROBS = torch.tensor(
    [
        [0.10, 0.30, 0.25, 0.20, 0.15],  # root; its children hold tokens 1 and 2
        [0.05, 0.10, 0.20, 0.40, 0.25],  # node 1; its child holds token 3
        [0.30, 0.00, 0.10, 0.35, 0.25],  # node 2; its child holds token 0
        [0.20, 0.20, 0.20, 0.20, 0.20],  # node 3; its child holds token 4
        [0.50, 0.10, 0.10, 0.10, 0.20],
        [0.15, 0.15, 0.30, 0.25, 0.15],
    ]
)
TRIALS = 20_000
# Four chi-square tests per run, each at alpha / 4 (Bonferroni): a correct verifier fails
# this test for at most one seed in 1,000.
ALPHA = 1e-3


def sample_emitted_tokens(seed, threshold_acc=1.0, reuse_root_coin=False):
    """Run the sampling verifier on TRIALS copies of the six-node tree (one big batch)."""
    gen = torch.Generator().manual_seed(seed)
    #   0 ─┬─ 1 (token 1) ── 3 (token 3) ── 5 (token 4)
    #      └─ 2 (token 2) ── 4 (token 0)
    tree = six_node_tree(TRIALS, tokens=(1, 2, 3, 0, 4))
    coins = torch.rand(TRIALS, 6, generator=gen)
    final = coins[:, 0].clone() if reuse_root_coin else torch.rand(TRIALS, generator=gen)
    probs = NODE_PROBS.expand(TRIALS, 6, 5).contiguous()
    result = verify_tree_sampling(
        *buffers(TRIALS, 6, 3),
        tree.draft_tokens.view(TRIALS, 6),
        tree.retrieve_index,
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        coins,
        final,
        probs,
        torch.zeros_like(probs),
        1.0,
        threshold_acc,
    )
    return result.predicts.view(TRIALS, 6)  # [trial, node]: the token emitted after the node


def distribution_p_values(predicts):
    """p-values of: 1st token ~ root; 2nd ~ node 1 or 2 given the 1st; 3rd ~ node 3 given both.

    A token equal to a child's token was that child, accepted (a rejected child's token has
    no mass left for the bonus), so each condition selects the trials that reached the node.
    """
    first = predicts[:, 0]
    reached = {
        0: torch.ones_like(first, dtype=torch.bool),
        1: first == 1,
        2: first == 2,
        3: (first == 1) & (predicts[:, 1] == 3),
    }
    p_values = []
    for node, rows in reached.items():
        counts = torch.bincount(predicts[rows, node].long(), minlength=5).double()
        target = NODE_PROBS[node].double()
        expected = target / target.sum() * counts.sum()
        support = expected > 0
        assert counts[~support].sum() == 0, f"node {node} emitted a zero-probability token"
        assert counts.sum() > 1000  # enough trials reach the node for the test to have power
        p_values.append(float(chisquare(counts[support], expected[support]).pvalue))
    return p_values


def test_sampling_keeps_the_target_distribution():
    p_values = distribution_p_values(sample_emitted_tokens(seed=2024))
    assert min(p_values) > ALPHA / len(p_values), p_values


@pytest.mark.parametrize(
    "wrong",
    [
        {"threshold_acc": 0.5},  # SGLang's lossy relaxation: accepts drafts too often
        {"reuse_root_coin": True},  # the bonus drawn with the coin that rejected the children
    ],
)
def test_the_distribution_test_catches_a_wrong_verifier(wrong):
    p_values = distribution_p_values(sample_emitted_tokens(seed=2024, **wrong))
    assert min(p_values) < ALPHA / len(p_values), p_values


# -- target probabilities ----------------------------------------------------------------


def test_top_k_keeps_ties_and_renormalises():
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1], [0.4, 0.2, 0.2, 0.1, 0.1]])
    out = top_k_renorm_prob(probs, torch.tensor([1, 2]))
    assert out[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    # k = 2 keeps both 0.2s: ties at the k-th value stay (FlashInfer's pivot rule).
    torch.testing.assert_close(out[1], torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0]))
    torch.testing.assert_close(top_k_renorm_prob(probs, 1 << 30), probs)


def test_top_p_keeps_the_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = top_p_renorm_prob(probs, torch.tensor([0.7, 1.0]))
    # Ascending mass 0.05, 0.2, 0.5: the prefix below 1 - 0.7 = 0.3 goes; 0.3 and 0.5 stay.
    torch.testing.assert_close(out[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(out[1], probs[1])


def test_target_probs_per_request_settings():
    # Two requests of two nodes: temperature 0.5 with top-k 1, temperature 2 with top-p 0.9.
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    probs = target_probs_from_logits(
        logits, torch.tensor([0.5, 2.0]), torch.tensor([1, 1 << 30]), torch.tensor([1.0, 0.9]), 2
    )
    assert probs.shape == (2, 2, 3) and probs.dtype == torch.float32
    assert probs[0].tolist() == [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    hot = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 2, dim=0)  # 0.51, 0.31, 0.19
    torch.testing.assert_close(probs[1, 0], hot)  # the nucleus of 0.9 needs all three
    torch.testing.assert_close(probs[1, 1].sum(), torch.tensor(1.0))
    without_filters = target_probs_from_logits(logits, torch.tensor([1.0, 1.0]), None, None, 2)
    torch.testing.assert_close(without_filters.view(4, 3), torch.softmax(logits, dim=-1))


def test_filters_match_flashinfer_rule_on_random_rows():
    # The sorted-vocabulary rules of FlashInfer's renorm kernels (as SGLang's ROCm fallback
    # spells them), against our partial sorts: peaked rows (nucleus inside the first 256) and
    # flat ones (nucleus of thousands, the full-sort path), one row without a filter.
    gen = torch.Generator().manual_seed(23)
    scale = torch.tensor([8.0, 4.0, 0.5, 0.05, 2.0, 1.0])
    probs = torch.softmax(torch.randn(6, 3000, generator=gen) * scale.unsqueeze(1), dim=-1)
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.8, 1.0, 0.3])
    ascending = probs.sort(dim=-1).values
    cut = torch.searchsorted(ascending.cumsum(dim=-1), (1 - top_p).unsqueeze(1))
    pivot = ascending.gather(1, cut.clamp(max=2999))
    expected = probs.masked_fill(probs < pivot, 0.0)
    torch.testing.assert_close(top_p_renorm_prob(probs, top_p), expected / expected.sum(1, True))
    assert int((expected[3] > 0).sum()) > 256  # the full-sort path ran

    top_k = torch.tensor([1, 5, 300, 3000, 1 << 30, 40])
    descending = probs.sort(dim=-1, descending=True).values
    pivot = descending.gather(1, (top_k.clamp(max=3000) - 1).unsqueeze(1))
    expected = probs.masked_fill(probs < pivot, 0.0)
    torch.testing.assert_close(top_k_renorm_prob(probs, top_k), expected / expected.sum(1, True))
