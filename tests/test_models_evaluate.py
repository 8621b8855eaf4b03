"""Agreement figures on hand-made cases, and the two rank functions on tiny models."""

import dataclasses

import pytest
import torch
from models_tiny import TINY_HEAD, make_tiny_target

from sglang_adatree.models import eagle, standalone
from sglang_adatree.models.data import SequenceSet
from sglang_adatree.models.evaluate import (
    NOT_RANKED,
    eagle_ranks,
    emitted_tokens,
    standalone_ranks,
    summarize,
    token_ranks,
)


def test_token_ranks_counts_strictly_better_logits():
    logits = torch.tensor([[0.1, 0.9, 0.5, 0.2], [3.0, 1.0, 2.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    labels = torch.tensor([1, 2, 1])
    assert token_ranks(logits, labels).tolist() == [0, 1, 0]  # a tie counts for the label
    assert token_ranks(logits[:1], torch.tensor([-1])).tolist() == [NOT_RANKED]


def test_emitted_tokens_for_chains_and_trees():
    ranks = torch.tensor([[0, 0, 0], [0, 1, 0], [2, 0, 0], [0, 0, 5]])
    # chain 1: rows 0, 1, 3 accept one token -> 1 + 3/4
    assert emitted_tokens(ranks, (1,)) == pytest.approx(1.75)
    # chain 3: accepted 3, 1, 0, 2 -> 1 + 6/4
    assert emitted_tokens(ranks, (1, 1, 1)) == pytest.approx(2.5)
    # tree 4-2-1: accepted 3, 3, 3, 2 -> 1 + 11/4
    assert emitted_tokens(ranks, (4, 2, 1)) == pytest.approx(3.75)


def test_summarize_conditional_agreement():
    ranks = torch.tensor([[0, 0], [0, 3], [1, 0], [0, 0]])
    result = summarize("toy", ranks)
    assert result.top1 == pytest.approx(0.75)
    assert result.top4 == pytest.approx(1.0)
    assert result.conditional_top1 == pytest.approx((0.75, 2 / 3))
    assert result.chain_emitted == pytest.approx({1: 1.75, 2: 2.25})
    assert result.tree_emitted["2-1"] == pytest.approx(1 + (2 + 1 + 2 + 2) / 4)


def _sequences(vocab: int, hidden_size: int, seed: int = 0) -> SequenceSet:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 14])  # batches sort by length: sequence 0 stays first
    n = int(lengths.sum())
    return SequenceSet(
        tokens=torch.randint(0, vocab, (n,), generator=gen),
        target_ids=torch.randint(0, vocab, (n,), generator=gen),
        hidden=torch.randn(n, hidden_size, generator=gen).half(),
        starts=torch.tensor([0, 12]),  # sequence 1: tokens 12..25
        lengths=lengths,
        prompt_lens=torch.tensor([4, 3]),
    )


def test_standalone_depth_s_is_the_prediction_s_minus_1_later(tmp_path):
    torch.set_num_threads(1)
    model = standalone.build_draft(make_tiny_target(tmp_path / "t"), (0,)).eval()
    data = _sequences(model.config.vocab_size, model.config.hidden_size)
    ranks = standalone_ranks(model, data, depth=3)
    tokens = data.tokens[:12]
    with torch.no_grad():
        logits = model(tokens[None]).logits[0]
    direct = token_ranks(logits, data.target_ids[:12])
    # Sequence 0: P = 4, n = 12; first guesses are tokens 5..9 (the deepest must fit in 11).
    assert ranks.shape == (5 + 8, 3)  # sequence 1: P = 3, n = 14 -> starts 3..10
    assert torch.equal(ranks[:5, 0], direct[4:9])
    assert torch.equal(ranks[:5, 2], direct[6:11])


def test_eagle_depth_1_ranks_match_a_direct_forward():
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY_HEAD, vocab_size=40)
    head = eagle.EagleHead(cfg).eval()
    embed = torch.randn(40, 32)
    data = _sequences(40, 32)
    hot = torch.arange(0, 40, 2)  # even ids only: odd targets can never be ranked
    ranks = eagle_ranks(head, embed, hot, data, depth=2)
    n = 12
    tokens = torch.zeros(1, 1, n, dtype=torch.long)
    tokens[0, 0, :-1] = data.tokens[1:n]
    with torch.no_grad():
        out = head(
            embed,
            tokens,
            data.hidden[:n].float()[None],
            torch.arange(n)[None],
            (torch.arange(n) <= n - 2)[None],
        )[0, 0]
    labels = data.target_ids[1 : n + 1][:n].clone()
    index = torch.full((40,), -1)
    index[hot] = torch.arange(20)
    direct = token_ranks(out @ embed[hot].T, index[labels])
    # Sequence 0: P = 4; starts i = 3..8 (first guess token i + 2 >= 5, deepest i + 3 <= 11).
    assert torch.equal(ranks[:6, 0], direct[3:9])
    assert (ranks[:, 0] == NOT_RANKED).any()  # odd target ids are outside the hot vocabulary
