"""The drafts' training loss: the sparse teacher, the agreement count and a small real fit."""

import pytest
import torch
import torch.nn.functional as F
from models_tiny import TINY_HEAD

from sglang_adatree.models import eagle, standalone
from sglang_adatree.models.data import SequenceSet, make_batch
from sglang_adatree.models.train import (
    EagleTask,
    TrainConfig,
    _agreement,
    _teacher_top,
    _top_ce,
)


def test_top_ce_with_every_token_is_the_dense_soft_cross_entropy():
    torch.manual_seed(0)
    logits, teacher = torch.randn(7, 50), torch.randn(7, 50) * 3
    probs, index = _teacher_top(teacher, 50)
    dense = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()
    assert torch.allclose(_top_ce(logits, probs, index), dense, atol=1e-5)
    # Cut to the top 3 and renormalised: the teacher's mass outside them is gone.
    probs3, index3 = _teacher_top(teacher, 3)
    assert torch.allclose(probs3.sum(-1), torch.ones(7))
    assert torch.equal(index3[:, 0], teacher.argmax(-1))
    cut = torch.full_like(teacher, float("-inf")).scatter(1, index3, teacher.gather(1, index3))
    expected = -(torch.softmax(cut, -1) * torch.log_softmax(logits, -1)).nan_to_num().sum(-1)
    assert torch.allclose(_top_ce(logits, probs3, index3), expected.mean(), atol=1e-5)


def test_top_ce_gradient_matches_dense():
    torch.manual_seed(1)
    teacher = torch.randn(5, 20)
    a = torch.randn(5, 20, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    _top_ce(a, *_teacher_top(teacher, 20)).backward()
    F.cross_entropy(b, torch.softmax(teacher, -1)).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_agreement_counts_argmax_hits_and_unmapped_labels_as_misses():
    torch.manual_seed(2)
    logits = torch.randn(100, 30)
    labels = torch.randint(0, 30, (100,))
    labels[:10] = logits[:10].argmax(-1)
    labels[10] = -1  # a label outside the hot vocabulary
    want = float(((logits.argmax(-1) == labels) & (labels >= 0)).float().mean())
    assert _agreement(logits, labels) == want
    assert _agreement(logits.bfloat16(), labels) >= 0.1
    assert _agreement(logits[:0], labels[:0]) == 0.0


def _copy_task_data(num_seqs: int, length: int, seed: int) -> tuple[SequenceSet, torch.Tensor]:
    """Sequences where the target's next token follows a fixed rule the head can learn from the
    token it reads: target_ids[j] = (tokens[j] * 7 + 3) % 50 and tokens[j + 1] = target_ids[j]."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(num_seqs * length, dtype=torch.long)
    for s in range(num_seqs):
        t = int(torch.randint(0, 50, (1,), generator=g))
        for j in range(length):
            tokens[s * length + j] = t
            t = (t * 7 + 3) % 50
    target_ids = (tokens * 7 + 3) % 50
    embed = torch.randn(50, TINY_HEAD.hidden_size, generator=g)
    # The target's hidden state at j points at its next token: lm_head(h) peaks on it.
    hidden = (embed[target_ids] * 4).to(torch.float16)
    starts = torch.arange(num_seqs) * length
    return SequenceSet(
        tokens,
        target_ids,
        hidden,
        starts,
        torch.full((num_seqs,), length),
        torch.full((num_seqs,), 3),
    ), embed


@pytest.fixture
def one_thread():
    # Tiny matrices: a second thread only adds synchronisation (30x slower on a busy machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_eagle_task_learns_a_rule(one_thread):
    torch.manual_seed(0)
    data, embed = _copy_task_data(8, 16, seed=3)
    cfg = TrainConfig(draft="eagle", steps=2, teacher_top_k=8, input_noise=0.0)
    task = EagleTask(cfg, {standalone.EMBED_KEY: embed}, torch.arange(50))
    head = eagle.EagleHead(TINY_HEAD)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    batch = make_batch(data, list(range(8)))
    with torch.no_grad():
        first = task(head, batch, train=False)
    for _ in range(80):
        res = task(head, batch, train=True)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    with torch.no_grad():
        last = task(head, batch, train=False)
    assert first.agreement[0] < 0.3
    assert float(last.loss) < 0.5 * float(first.loss)
    assert last.agreement[0] > 0.9 and last.agreement[1] > 0.8


@pytest.mark.parametrize("draft", ["eagle", "standalone"])
def test_card_training_command_reproduces_the_config(draft):
    import argparse
    import dataclasses
    import shlex

    from sglang_adatree.models.card import train_command_line
    from sglang_adatree.models.commands import add_arguments
    from sglang_adatree.models.train import config_from_args

    cfg = TrainConfig(draft=draft, seed=3, epochs=4.5, lr=0.002, warmup_steps=50,
                      tokens_per_batch=2048, steps=2, val_every=25)  # fmt: skip
    line = train_command_line(draft, dataclasses.asdict(cfg))
    assert line.startswith(f"adatree models train {draft} ")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    back = config_from_args(parser.parse_args(shlex.split(line)[2:]))
    if draft == "standalone":  # the unrolled steps are the EAGLE head's alone
        back = dataclasses.replace(back, steps=cfg.steps)
    assert back == cfg
