"""The drafts' training loss: the sparse teacher, the agreement count, a small real fit, and
whole runs on a tiny target (several data sets, a start from earlier weights)."""

import json

import pytest
import torch
import torch.nn.functional as F
from models_tiny import TINY_HEAD, make_tiny_target
from safetensors.torch import load_file

from sglang_adatree.models import eagle, standalone
from sglang_adatree.models.card import _datagen_commands, _later_kinds, _training_commands
from sglang_adatree.models.data import SequenceSet, make_batch
from sglang_adatree.models.datagen import DatagenConfig, run_datagen
from sglang_adatree.models.paths import ModelPaths
from sglang_adatree.models.train import (
    EagleTask,
    TrainConfig,
    _agreement,
    _teacher_top,
    _top_ce,
    train,
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


def test_top_ce_on_bf16_logits_stays_close_to_fp64():
    # Training runs under bf16 autocast, so the log-softmax runs in bf16 (fp32 accumulation).
    torch.manual_seed(2)
    logits = torch.randn(64, 4096, dtype=torch.float64) * 3
    probs, index = _teacher_top(torch.randn(64, 4096) * 4, 32)
    exact = logits.clone().requires_grad_()
    want = -(probs.double() * torch.log_softmax(exact, -1).gather(1, index)).sum(-1).mean()
    want.backward()
    low = logits.to(torch.bfloat16).requires_grad_()
    got = _top_ce(low, probs, index)
    got.backward()
    assert got.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=2e-3)
    error = (low.grad.double() - exact.grad).norm() / exact.grad.norm()
    assert error < 0.02


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


def test_a_batch_moves_whole_to_another_device():
    data, _ = _copy_task_data(3, 5, seed=1)
    batch = make_batch(data, [0, 2]).to(torch.device("meta"))
    fields = (batch.tokens, batch.target_ids, batch.hidden, batch.lengths, batch.prompt_lens)
    assert all(t.device.type == "meta" for t in fields)
    # Masks built from positions follow the batch, so a task never mixes devices.
    assert batch.positions().device.type == "meta" and batch.positions().shape == (2, 5)
    assert batch.predicts_answer(2).device.type == "meta"


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
                      tokens_per_batch=2048, steps=2, val_every=25, data=("train", "train-b"),
                      init_from="/some/run-1", dtype="float32")  # fmt: skip
    line = train_command_line(draft, dataclasses.asdict(cfg))
    assert "--dtype float32" in line
    assert line.startswith(f"adatree models train {draft} ")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    back = config_from_args(parser.parse_args(shlex.split(line)[2:]))
    if draft == "standalone":  # the unrolled steps are the EAGLE head's alone
        back = dataclasses.replace(back, steps=cfg.steps)
    assert back == cfg


@pytest.fixture(scope="module")
def tiny_home(tmp_path_factory):
    """A data directory with a tiny target and two small generated data sets."""
    torch.set_num_threads(1)
    paths = ModelPaths(tmp_path_factory.mktemp("home"))
    make_tiny_target(paths.target_dir)
    for name, seed, later in (("a", 0, 0), ("b", 1, 2)):  # later: passage, detailed, real
        cfg = DatagenConfig(name=name, seed=seed, prompts_per_shard=6, num_meta=1,
                            num_followup=1, num_passage=later, num_detailed_meta=later,
                            num_real=later, batch_size=3, max_new_tokens=12,
                            meta_max_new_tokens=4, dtype="float32")  # fmt: skip
        run_datagen(paths.target_dir, paths.datagen_dir(name), cfg, max_shards=2, log=print)
    return paths


def test_a_run_reads_every_data_set_and_starts_from_given_weights(tiny_home, tmp_path):
    torch.manual_seed(5)
    target_config = json.loads((tiny_home.target_dir / "config.json").read_text())
    start = eagle.EagleHead(eagle.HeadConfig.from_target(target_config))
    for p in start.parameters():  # far from any fresh initialisation
        p.data.fill_(0.25)
    eagle.export(start, None, target_config, tmp_path / "run-1")
    earlier = {"config": {"epochs": 1}, "steps": 7, "train_seconds": 60, "best_val_top1": 0.5}
    (tmp_path / "run-1" / "training.json").write_text(json.dumps(earlier))

    one = train(TrainConfig(draft="eagle", data=("a",), epochs=1), tiny_home, 600)
    cfg = TrainConfig(draft="eagle", data=("a", "b"), init_from=str(tmp_path / "run-1"),
                      lr=1e-12, warmup_steps=1, epochs=0.01)  # fmt: skip
    both = train(cfg, tiny_home, 600)

    assert both["data"]["names"] == ["a", "b"] and [d["seed"] for d in both["data"]["sets"]] == [
        0,
        1,
    ]
    assert _datagen_commands(both["data"]) == (
        ", by `adatree models --threads 1 datagen --name a --seed 0 --batch-size 3 "
        "--max-new-tokens 12 --num-passage 0 --num-detailed-meta 0 --num-real 0 --dtype float32 "
        "--worker w/2` and `adatree models --threads 1 datagen --name b --seed 1 --batch-size 3 "
        "--max-new-tokens 12 --num-passage 2 --num-detailed-meta 2 --num-real 2 --dtype float32 "
        "--worker w/2` (w = 0, 1)"
    )
    kinds = _later_kinds(both["data"])
    assert "summarise" in kinds and "coding task" in kinds and "GPQA Diamond" in kinds
    assert not _later_kinds(one["data"])
    assert both["data"]["sequences"] > one["data"]["sequences"] > 0
    assert both["init"] == earlier and one["init"] is None
    assert one["device"] == both["device"] == "cpu"
    assert [d["devices"] for d in both["data"]["sets"]] == [["cpu"], ["cpu"]]
    # One step at a vanishing learning rate: the weights are still the given ones.
    trained = torch.load(tiny_home.train_dir("eagle") / "last.pt", weights_only=False)["model"]
    shipped = load_file(tmp_path / "run-1" / "model.safetensors")
    assert both["steps"] == 1 and trained.keys() == shipped.keys()
    for key, value in shipped.items():
        assert torch.allclose(trained[key], value.float(), atol=1e-6), key


def test_a_missing_start_folder_is_refused(tiny_home, tmp_path):
    cfg = TrainConfig(draft="eagle", data=("a",), init_from=str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="--init-from"):
        train(cfg, tiny_home, 600)


def test_the_card_names_every_run_of_a_lineage():
    first = {"config": dataclasses_dict(TrainConfig(draft="eagle", lr=0.002)), "steps": 456,
             "train_seconds": 2160, "best_val_top1": 0.517, "init": None}  # fmt: skip
    second = {"config": dataclasses_dict(TrainConfig(draft="eagle", data=("train", "train-b"),
                                                     init_from="/x/run-1")),
              "steps": 800, "train_seconds": 3600, "best_val_top1": 0.6, "init": first}  # fmt: skip
    text = _training_commands("eagle", second)
    assert text.startswith("Trained in 2 runs")
    assert "--lr 0.002" in text and "456 steps, 36 min" in text
    assert "--data train train-b --init-from <run 1 weights>" in text and "/x/run-1" not in text
    alone = _training_commands("eagle", first)
    assert alone.startswith("Command: `adatree models train eagle") and "--init-from" not in alone


def test_the_card_says_where_each_run_and_data_set_ran():
    from sglang_adatree.models.card import _compute, _generated_on, _precisions, _training_time

    cpu = {"config": dataclasses_dict(TrainConfig(draft="eagle")), "steps": 100,
           "train_seconds": 3000, "best_val_top1": 0.5, "init": None}  # fmt: skip
    gpu = {"config": dataclasses_dict(TrainConfig(draft="eagle", init_from="/x")), "steps": 900,
           "train_seconds": 120, "best_val_top1": 0.7, "init": cpu, "device": "cuda"}  # fmt: skip
    text = _training_commands("eagle", gpu)
    assert "run 1: `adatree models train eagle" in text
    assert "run 2: `adatree models --device cuda train eagle" in text
    assert _training_time([cpu, gpu]) == "50 min on the CPU and 2 min on a GPU (`--device cuda`)"
    fp32 = {**gpu, "config": {**gpu["config"], "dtype": "float32"}, "device": "cpu"}
    assert _compute([cpu, gpu]) == "bf16 autocast"
    assert _compute([cpu, fp32]).startswith("bf16 autocast or fp32")
    del cpu["config"]["dtype"]  # a run before the option: bf16
    assert _compute([cpu]) == "bf16 autocast"
    made = {"batch_size": 64, "max_new_tokens": 256, "num_passage": 12}  # before detailed/real
    data = {"sets": [{"name": "a", "seed": 0, **made},
                     {"name": "g-0", "seed": 10, **made, "devices": ["cuda"]},
                     {"name": "g-1", "seed": 11, **made, "devices": ["cuda"]}]}  # fmt: skip
    # Sets alike but for name and seed share one command; an old set without devices is cpu,
    # without dtype bf16, spelled out since the default (auto) depends on the machine.
    assert _datagen_commands(data) == (
        ", by `adatree models --threads 1 datagen --name a --seed 0 --batch-size 64 "
        "--max-new-tokens 256 --num-passage 12 --num-detailed-meta 0 --num-real 0 "
        "--dtype bfloat16 --worker w/2` and `adatree models --threads 1 "
        "--device cuda datagen --name NAME --seed SEED --batch-size 64 --max-new-tokens 256 "
        "--num-passage 12 --num-detailed-meta 0 --num-real 0 --dtype bfloat16 --worker w/2` "
        "for each NAME/SEED of g-0/10, g-1/11 (w = 0, 1)"
    )
    assert "a GPU (`--device cuda`)" in _generated_on(data)
    assert "2 CPU cores" in _generated_on({"sets": data["sets"][:1]})
    # A set made in fp32 says so in its command and in the card's words; older ones are bf16.
    fp32 = {"name": "f", "seed": 5, **made, "dtype": "float32"}
    assert "--num-real 0 --dtype float32 --worker w/2" in _datagen_commands({"sets": [fp32]})
    assert _precisions({"sets": [fp32, data["sets"][0]]}) == "bf16 or fp32"
    assert _precisions(data) == "bf16"
    # A set only an earlier run of the lineage trained on is still named, with its command.
    from sglang_adatree.models.card import _earlier_data

    gpu["data"], cpu["data"] = {"sets": data["sets"][:1]}, {"sets": data["sets"]}
    (para, _) = _earlier_data([cpu, gpu])
    assert "2 other data set(s)" in para and "g-0/10, g-1/11" in para
    assert "--name a " not in para and _earlier_data([gpu]) == []


def dataclasses_dict(cfg: TrainConfig) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)
