import pytest
import torch
from tree_fixtures import (
    children_of,
    random_shape,
    random_tree,
    run_sglang_triton,
    six_node_draft,
)

from sglang_adatree.sglang.tree import (
    TreeMaskMode,
    accepted_path_stats,
    build_verify_tree,
    organize_draft_results,
    packed_mask_dtype,
    tree_topology,
    write_verify_tree,
)

# The hand-made six-node tree of tree_fixtures.six_node_draft, by hand:
#   0 ─┬─ 1 ── 3 ── 5
#      └─ 2 ── 4
SIX_NODE_MASK = [  # row i: the nodes i attends to (itself, its ancestors, the root)
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 0],
    [1, 0, 1, 0, 1, 0],
    [1, 1, 0, 1, 0, 1],
]
SIX_NODE_DEPTH = [0, 1, 1, 2, 2, 3]
SIX_NODE_NEXT_TOKEN = [1, 3, 4, 5, -1, -1]
SIX_NODE_NEXT_SIBLING = [-1, 2, -1, -1, -1, -1]


def build(selection, seq_lens, topk, steps, n, mode=TreeMaskMode.QLEN_ONLY, **kwargs):
    bonus = torch.arange(7, 7 + len(seq_lens), dtype=torch.int32)
    return build_verify_tree(
        bonus,
        selection.parent_list,
        selection.top_scores_index,
        selection.draft_tokens,
        seq_lens,
        int(seq_lens.sum()),
        topk,
        steps,
        n,
        mode,
        **kwargs,
    )


def six_node_tree(batch=1, seq_lens=None, mode=TreeMaskMode.QLEN_ONLY, **kwargs):
    selection = organize_draft_results(*six_node_draft(batch), num_draft_tokens=6)
    seq_lens = torch.full((batch,), 5) if seq_lens is None else seq_lens
    return selection, build(selection, seq_lens, 2, 3, 6, mode, **kwargs)


def test_chain_by_hand():
    # topk 1, steps 3: SGLang's topk-1 fast path hands over these tensors directly.
    parent_list = torch.tensor([[-1, 0, 1]])
    top_scores_index = torch.tensor([[0, 1, 2]])
    seq_lens = torch.tensor([5])
    tree = build_verify_tree(
        torch.tensor([9], dtype=torch.int32),
        parent_list,
        top_scores_index,
        torch.tensor([[11, 12, 13]]),
        seq_lens,
        5,
        1,
        3,
        4,
        TreeMaskMode.QLEN_ONLY,
    )
    assert tree.tree_mask.view(4, 4).int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 1, 1],
    ]
    assert tree.positions.tolist() == [5, 6, 7, 8]
    assert tree.retrieve_index.tolist() == [[0, 1, 2, 3]]
    assert tree.retrieve_next_token.tolist() == [[1, 2, 3, -1]]
    assert tree.retrieve_next_sibling.tolist() == [[-1, -1, -1, -1]]
    assert tree.draft_tokens.tolist() == [9, 11, 12, 13]
    assert tree.draft_tokens.dtype == torch.int64


def test_chain_from_draft_scores():
    # The general path gives the same chain: topk 1, three steps of one candidate each.
    scores = [torch.tensor([[[0.9]]]), torch.tensor([[[0.5]]]), torch.tensor([[[0.2]]])]
    tokens = [torch.tensor([[11]]), torch.tensor([[12]]), torch.tensor([[13]])]
    parents = [torch.tensor([[-1, 0]]), torch.tensor([[1]]), torch.tensor([[2]])]
    selection = organize_draft_results(scores, tokens, parents, 4)
    assert selection.top_scores_index.tolist() == [[0, 1, 2]]
    assert selection.parent_list.tolist() == [[-1, 0, 1]]
    tree = build(selection, torch.tensor([5]), 1, 3, 4)
    assert tree.positions.tolist() == [5, 6, 7, 8]
    assert tree.retrieve_next_token.tolist() == [[1, 2, 3, -1]]


def test_six_node_tree_by_hand():
    selection, tree = six_node_tree()
    assert selection.top_scores_index.tolist() == [[0, 1, 2, 4, 6]]
    assert selection.parent_list.tolist() == [[-1, 0, 1, 2, 4]]
    assert selection.draft_tokens.tolist() == [[10, 11, 20, 22, 30]]
    assert tree.tree_mask.dtype == torch.bool
    assert tree.tree_mask.view(6, 6).int().tolist() == SIX_NODE_MASK
    assert tree.positions.tolist() == [5 + d for d in SIX_NODE_DEPTH]
    assert tree.retrieve_index.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert tree.retrieve_next_token.tolist() == [SIX_NODE_NEXT_TOKEN]
    assert tree.retrieve_next_sibling.tolist() == [SIX_NODE_NEXT_SIBLING]
    assert tree.draft_tokens.tolist() == [7, 10, 11, 20, 22, 30]


def test_full_mask_layout_by_hand():
    # Request b's rows are seq_len + 6 wide: the prefix, then the tree columns.
    seq_lens = torch.tensor([2, 3])
    _, tree = six_node_tree(2, seq_lens, TreeMaskMode.FULL_MASK)
    expected = [[1] * 2 + row for row in SIX_NODE_MASK] + [[1] * 3 + row for row in SIX_NODE_MASK]
    flat = [cell for row in expected for cell in row]
    assert tree.tree_mask.int().tolist() == flat
    assert tree.positions.tolist() == [2 + d for d in SIX_NODE_DEPTH] + [
        3 + d for d in SIX_NODE_DEPTH
    ]
    assert tree.retrieve_index.tolist() == [list(range(6)), list(range(6, 12))]


def test_bit_packed_rows_by_hand():
    _, tree = six_node_tree(mode=TreeMaskMode.QLEN_ONLY_BITPACKING)
    assert tree.tree_mask.dtype == torch.uint8
    # Bit j of row i is column j: 0b1, 0b11, 0b101, 0b1011, 0b10101, 0b101011.
    assert tree.tree_mask.tolist() == [1, 3, 5, 11, 21, 43]


@pytest.mark.parametrize(("n", "dtype"), [(8, torch.uint8), (12, torch.uint16), (20, torch.uint32)])
def test_bit_packed_rows_match_the_boolean_mask(n, dtype):
    gen = torch.Generator().manual_seed(n)
    plain = random_tree(3, 5, 4, n, 50, gen)
    gen = torch.Generator().manual_seed(n)
    packed = random_tree(3, 5, 4, n, 50, gen, TreeMaskMode.QLEN_ONLY_BITPACKING)
    assert packed_mask_dtype(n) == dtype and packed.tree.tree_mask.dtype == dtype
    weights = 1 << torch.arange(n)
    rows = (plain.tree.tree_mask.view(3 * n, n).long() * weights).sum(dim=1)
    assert packed.tree.tree_mask.long().tolist() == rows.tolist()
    assert torch.equal(packed.tree.positions, plain.tree.positions)


def test_upstream_golden_values():
    # SGLang's test/registered/spec/utils/test_build_eagle_tree.py: topk 4, depth 4, 8 draft
    # tokens, batch 2; the same inputs and expected outputs.
    score_list = [
        torch.tensor(
            [
                [[7.1127e-01, 2.8292e-01, 2.2995e-03, 1.7357e-03]],
                [[9.7476e-01, 2.2219e-02, 6.5031e-04, 1.3212e-04]],
            ]
        ),
        torch.tensor(
            [
                [
                    [6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03],
                    [2.4787e-01, 1.8818e-02, 1.4204e-02, 9.2235e-04],
                    [2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08],
                    [1.2771e-03, 2.4374e-04, 1.7832e-04, 1.1947e-05],
                ],
                [
                    [8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02],
                    [2.3616e-03, 1.1243e-03, 5.4368e-04, 2.7768e-04],
                    [2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05],
                    [1.2834e-04, 2.5417e-06, 1.1279e-06, 1.6088e-08],
                ],
            ]
        ),
        torch.tensor(
            [
                [
                    [6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06],
                    [2.4402e-01, 2.8409e-03, 5.0935e-04, 2.9022e-04],
                    [1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05],
                    [1.3023e-02, 5.0497e-04, 3.6371e-04, 8.7750e-05],
                ],
                [
                    [2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03],
                    [6.4156e-02, 5.5506e-04, 1.0429e-04, 9.7211e-05],
                    [4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04],
                    [7.5817e-03, 8.5731e-04, 6.9972e-04, 6.0793e-04],
                ],
            ]
        ),
        torch.tensor(
            [
                [
                    [6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06],
                    [1.3019e-01, 1.0461e-01, 5.2083e-03, 1.6777e-03],
                    [2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05],
                    [1.5142e-02, 7.0819e-04, 9.6595e-05, 8.7951e-05],
                ],
                [
                    [5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04],
                    [1.2185e-02, 2.0684e-03, 1.7418e-03, 1.4327e-03],
                    [6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03],
                    [1.8590e-03, 1.6151e-03, 1.2481e-03, 3.6038e-04],
                ],
            ]
        ),
    ]
    # fmt: off
    token_list = [
        torch.tensor([[29896, 29906, 29900, 29945], [13, 2, 29871, 28956]]),
        torch.tensor([
            [29889, 29974, 29945, 29900, 29974, 29922, 29930, 29958,
             29889, 29974, 29930, 29945, 29974, 29922, 29930, 29958],
            [22550, 4136, 16492, 8439, 29871, 2, 3001, 13,
             2, 13, 29906, 29946, 2, 13, 29871, 259],
        ]),
        torch.tensor([
            [29946, 29945, 29953, 29906, 29896, 29945, 29900, 29906,
             29896, 29945, 29906, 29953, 29896, 29945, 29906, 29946],
            [29871, 2, 29901, 29889, 29871, 2, 395, 259,
             29901, 29871, 2, 29889, 3001, 1234, 7146, 2186],
        ]),
        torch.tensor([
            [29946, 29974, 29945, 29930, 29889, 29922, 29974, 29930,
             29974, 29946, 29930, 29922, 29889, 29974, 29945, 29922],
            [29941, 29906, 2, 29946, 29871, 450, 319, 14990,
             29946, 29941, 2, 29906, 29871, 2, 3001, 13],
        ]),
    ]
    # fmt: on
    parents_list = [
        torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]]),
        torch.tensor([[4, 8, 9, 10], [4, 5, 6, 7]]),
        torch.tensor([[20, 24, 21, 28], [24, 28, 20, 21]]),
        torch.tensor([[36, 40, 41, 44], [36, 40, 44, 45]]),
    ]
    selection = organize_draft_results(score_list, token_list, parents_list, 8)
    tree = build_verify_tree(
        torch.tensor([29974, 13], dtype=torch.int32),
        selection.parent_list,
        selection.top_scores_index,
        selection.draft_tokens,
        torch.tensor([5, 10]),
        15,
        4,
        4,
        8,
    )
    assert tree.positions.tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert tree.retrieve_index.tolist() == [list(range(8)), list(range(8, 16))]
    assert tree.retrieve_next_token.tolist() == [
        [1, 3, 4, 5, 6, 7, -1, -1],
        [1, 2, -1, 6, -1, -1, 7, -1],
    ]
    assert tree.retrieve_next_sibling.tolist() == [
        [-1, 2, -1, -1, -1, -1, -1, -1],
        [-1, -1, 3, 4, 5, -1, -1, -1],
    ]
    assert tree.draft_tokens.tolist() == [
        29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946,
        13, 13, 22550, 4136, 16492, 8439, 29871, 29941,
    ]  # fmt: skip


def test_preallocated_buffers_are_filled_as_sglang_fills_them():
    # A buffer sized for a larger batch (CUDA-graph style), uint8 as the triton backend's.
    seq_lens = torch.tensor([2, 3])
    _, reference = six_node_tree(2, seq_lens, TreeMaskMode.FULL_MASK)
    used = reference.tree_mask.numel()

    buffer = torch.full((used + 10,), 7, dtype=torch.uint8)
    _, tree = six_node_tree(2, seq_lens, TreeMaskMode.FULL_MASK, tree_mask_buf=buffer)
    assert tree.tree_mask is buffer
    assert buffer[:used].tolist() == reference.tree_mask.int().tolist()
    assert buffer[used:].tolist() == [1] * 10  # the fill covers the whole buffer

    # Without the prefix fill only the tree columns change: prefix cells keep their bytes.
    buffer = torch.full((used + 10,), 7, dtype=torch.uint8)
    six_node_tree(2, seq_lens, TreeMaskMode.FULL_MASK, tree_mask_buf=buffer, fill_prefix_mask=False)
    rows = [2] * 6 + [3] * 6
    expected = []
    for prefix, row in zip(rows, SIX_NODE_MASK + SIX_NODE_MASK, strict=True):
        expected += [7] * prefix + row
    assert buffer.tolist() == expected + [7] * 10

    buffer = torch.zeros(100, dtype=torch.bool)
    six_node_tree(2, seq_lens, TreeMaskMode.QLEN_ONLY, tree_mask_buf=buffer)
    assert buffer[:72].int().tolist() == [c for row in SIX_NODE_MASK * 2 for c in row]
    assert bool(buffer[72:].all())

    buffer = torch.full((20,), 255, dtype=torch.uint8)
    six_node_tree(2, seq_lens, TreeMaskMode.QLEN_ONLY_BITPACKING, tree_mask_buf=buffer)
    assert buffer.tolist() == [1, 3, 5, 11, 21, 43] * 2 + [0] * 8


def test_write_verify_tree_fills_kernel_buffers():
    gen = torch.Generator().manual_seed(3)
    drawn = random_tree(4, 4, 3, 9, 40, gen, TreeMaskMode.FULL_MASK)
    batch, n = 4, 9
    mask = torch.ones(drawn.tree.tree_mask.numel(), dtype=torch.bool)
    positions = torch.empty(batch * n, dtype=torch.long)
    links = torch.full((3, batch, n), -1, dtype=torch.long)
    write_verify_tree(
        drawn.selection.parent_list,
        drawn.selection.top_scores_index,
        drawn.seq_lens,
        mask,
        positions,
        links[0],
        links[1],
        links[2],
        3,
        4,
        n,
        TreeMaskMode.FULL_MASK,
    )
    assert torch.equal(mask, drawn.tree.tree_mask)
    assert torch.equal(positions, drawn.tree.positions)
    assert torch.equal(links[0], drawn.tree.retrieve_index)
    assert torch.equal(links[1], drawn.tree.retrieve_next_token)
    assert torch.equal(links[2], drawn.tree.retrieve_next_sibling)


def test_empty_batch():
    # SGLang's idle ranks build a tree for zero requests.
    tree = build_verify_tree(
        torch.empty(0, dtype=torch.int32),
        torch.empty(0, 5, dtype=torch.long),
        torch.empty(0, 7, dtype=torch.long),
        torch.empty(0, 7, dtype=torch.long),
        torch.empty(0, dtype=torch.long),
        0,
        4,
        2,
        8,
        TreeMaskMode.QLEN_ONLY,
    )
    assert tree.tree_mask.numel() == 0 and tree.positions.numel() == 0
    assert tree.retrieve_next_token.shape == (0, 8)


def test_nodes_without_a_kept_parent_are_left_out_like_the_triton_kernel():
    # Candidate 4 (a child of candidate 1) kept without candidate 1: only NaN or tied scores
    # do this. The node gets no link and its ancestor walk stops at once.
    tree = build_verify_tree(
        torch.tensor([9], dtype=torch.int32),
        torch.tensor([[-1, 0, 1]]),
        torch.tensor([[0, 4]]),
        torch.tensor([[11, 12]]),
        torch.tensor([5]),
        5,
        2,
        2,
        3,
        TreeMaskMode.QLEN_ONLY,
    )
    assert tree.retrieve_next_token.tolist() == [[1, -1, -1]]
    assert tree.retrieve_next_sibling.tolist() == [[-1, -1, -1]]
    assert tree.positions.tolist() == [5, 6, 6]
    assert tree.tree_mask.view(3, 3).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]


def test_topology_matches_walking_the_links():
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        steps, topk, n = random_shape(gen)
        drawn = random_tree(3, steps, topk, n, 30, gen)
        topo = tree_topology(drawn.tree.retrieve_next_token, drawn.tree.retrieve_next_sibling)
        for b in range(3):
            parent, rank = [-1] * n, [-1] * n
            for node in range(n):
                for r, child in enumerate(children_of(drawn.tree, b, node)):
                    parent[child], rank[child] = node, r
            assert topo.parent[b].tolist() == parent
            assert topo.sibling_rank[b].tolist() == rank
            children = [[parent[j] == p for j in range(n)] for p in range(n)]
            assert topo.children[b].tolist() == children


def path_stats(accept_path, accept_token_num, batch=1):
    selection, tree = six_node_tree(batch)
    accept_index = torch.tensor(accept_path, dtype=torch.int32)
    return accepted_path_stats(
        accept_index,
        torch.tensor(accept_token_num, dtype=torch.int32),
        tree.retrieve_next_token,
        tree.retrieve_next_sibling,
        selection.top_scores_index,
        2,
    )


def test_accepted_path_stats_by_hand():
    # Full path 0 -> 1 -> 3 -> 5: each node on it has one child but the root (two).
    stats = path_stats([[0, 1, 3, 5]], [3])
    assert stats.num_children.tolist() == [[2, 1, 1]]
    assert stats.accepted_rank.tolist() == [[0, 0, 0]]
    assert stats.num_children.dtype == stats.accepted_rank.dtype == torch.int64
    # 0 -> 2 -> 4: the root's second-ranked child (candidate 1), then a leaf.
    stats = path_stats([[0, 2, 4, -1]], [2])
    assert stats.num_children.tolist() == [[2, 1, 0]]
    assert stats.accepted_rank.tolist() == [[1, 0, -1]]
    # Nothing accepted: the root offered two children and the target took neither.
    stats = path_stats([[0, -1, -1, -1]], [0])
    assert stats.num_children.tolist() == [[2, 0, 0]]
    assert stats.accepted_rank.tolist() == [[-1, -1, -1]]
    # Batch rows use flat indices b * N + i.
    stats = path_stats([[0, 1, -1, -1], [6, 8, 10, -1]], [1, 2], batch=2)
    assert stats.num_children.tolist() == [[2, 1, 0], [2, 1, 0]]
    assert stats.accepted_rank.tolist() == [[0, -1, -1], [1, 0, -1]]


@pytest.mark.slow
def test_matches_sglang_triton_kernel(tmp_path):
    """Our builder against SGLang's Triton kernel (interpreted) on random draft trees."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for _ in range(40):
        steps, topk, n = random_shape(gen)
        batch = int(torch.randint(1, 4, (1,), generator=gen))
        for mode in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
            drawn = random_tree(batch, steps, topk, n, 50, gen, mode)
            cases.append((drawn, int(mode)))
    payload = [
        (
            d.selection.parent_list.contiguous(),
            d.selection.top_scores_index,
            d.seq_lens,
            d.tree.tree_mask.numel(),
            d.topk,
            d.steps,
            d.num_draft_tokens,
            mode,
        )
        for d, mode in cases
    ]
    code = """
result = [{m.name: m.value for m in spec_tree.TreeMaskMode}]
for parents, selected, seq_lens, numel, topk, steps, n, mode in payload:
    batch = seq_lens.numel()
    mask = torch.ones(numel, dtype=torch.bool)
    positions = torch.empty(batch * n, dtype=torch.long)
    links = torch.full((3, batch, n), -1, dtype=torch.long)
    spec_tree.sgl_build_tree_kernel_triton(
        parents, selected, seq_lens, mask, positions, links[0], links[1], links[2],
        topk, steps, n, spec_tree.TreeMaskMode(mode))
    result.append((mask, positions, links))
"""
    sglang_modes, *expected = run_sglang_triton(code, payload, tmp_path)
    assert sglang_modes == {m.name: m.value for m in TreeMaskMode}
    for (drawn, _), (mask, positions, links) in zip(cases, expected, strict=True):
        assert torch.equal(drawn.tree.tree_mask, mask)
        assert torch.equal(drawn.tree.positions, positions)
        assert torch.equal(drawn.tree.retrieve_index, links[0])
        assert torch.equal(drawn.tree.retrieve_next_token, links[1])
        assert torch.equal(drawn.tree.retrieve_next_sibling, links[2])
