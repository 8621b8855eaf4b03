"""Data generation on a tiny target: exact labels and features, and resume after a stop."""

import json

import pytest
import torch
from models_tiny import make_tiny_target
from safetensors.torch import load_file

from sglang_adatree.models import datagen, prompts
from sglang_adatree.models.datagen import DatagenConfig, load_shard, read_manifest, run_datagen

CFG = DatagenConfig(
    name="tiny",
    prompts_per_shard=5,
    num_meta=1,
    num_followup=1,
    num_passage=1,
    num_detailed_meta=1,
    num_real=1,
    batch_size=2,
    max_new_tokens=6,
    meta_max_new_tokens=4,
    dtype="float32",
)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


def _run(target, out, **kwargs):
    return run_datagen(target, out, CFG, log=lambda _: None, **kwargs)


def test_labels_are_greedy_and_hidden_is_after_the_final_norm(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    manifest = _run(tiny_target, tmp_path, max_shards=1)
    shard = load_shard(tmp_path, manifest["shards"][0])
    assert manifest["shards"][0]["device"] == "cpu"
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    first = slice(int(shard.offsets[0]), int(shard.offsets[1]))
    with torch.no_grad():
        out = model(shard.tokens[first].long()[None], output_hidden_states=True)
    # transformers' last hidden state is the final norm's output; the logits read it.
    last = out.hidden_states[-1][0]
    torch.testing.assert_close(shard.hidden[first].float(), last, atol=2e-3, rtol=2e-3)
    assert torch.equal(shard.target_ids[first].long(), out.logits[0].argmax(-1))
    # Greedy answers: every answer token is the target's argmax after its prefix.
    prompt_len = int(shard.prompt_lens[0])
    answer = shard.tokens[first][prompt_len:]
    assert torch.equal(answer, shard.target_ids[first][prompt_len - 1 : -1])


def test_resume_after_a_stop_gives_the_same_data(tiny_target, tmp_path, monkeypatch):
    # The tiny target's answers are a few characters long: let any of them be a passage.
    monkeypatch.setattr(datagen, "PASSAGE_CHARS", (1, 1600))
    whole, split = tmp_path / "whole", tmp_path / "split"
    _run(tiny_target, whole, max_shards=4)
    _run(tiny_target, split, max_shards=2)
    first = (split / "shard-00000.safetensors").stat().st_mtime_ns
    # A run killed while writing leaves a temporary file behind: it must not count.
    (split / "shard-00002.safetensors.tmp").write_bytes(b"partial")
    manifest = _run(tiny_target, split, max_shards=4)
    assert [s["index"] for s in manifest["shards"]] == [0, 1, 2, 3]
    assert (split / "shard-00000.safetensors").stat().st_mtime_ns == first
    for index in range(4):
        name = f"shard-{index:05d}"
        a, b = load_file(whole / f"{name}.safetensors"), load_file(split / f"{name}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert (whole / f"{name}.json").read_text() == (split / f"{name}.json").read_text()
    # Every shard: both meta kinds (the templates' and a detailed one) and a real question.
    first_rows = json.loads((whole / "shard-00000.json").read_text())
    metas = [r["messages"][0][1] for r in first_rows if r["kind"] == "meta"]
    assert len(metas) == 2 and any(m in _detailed_meta_texts() for m in metas)
    real = [r["messages"][0][1] for r in first_rows if r["kind"] == "real"]
    assert len(real) == 1 and real[0] in prompts.load_real_questions()
    # Shard 2 harvested shard 0: a follow-up on one of its answers, and a passage task on one.
    rows = json.loads((whole / "shard-00002.json").read_text())
    kinds = [row["kind"] for row in rows]
    assert "followup" in kinds and "passage" in kinds
    earlier = [r["answer"] for r in json.loads((whole / "shard-00000.json").read_text())]
    passage = next(r for r in rows if r["kind"] == "passage")["messages"][0][1]
    assert any(a.strip() and a.strip() in passage for a in earlier)


def _detailed_meta_texts() -> set[str]:
    return {
        t.format(subject=subject)
        for kind, templates in prompts.DETAILED_META.items()
        for t in templates
        for subject in prompts.SUBJECTS.get(kind, prompts._SETTINGS)
    }


def test_two_workers_split_the_shards(tiny_target, tmp_path):
    _run(tiny_target, tmp_path, max_shards=4, worker=1, num_workers=2)
    assert [s["index"] for s in read_manifest(tmp_path)["shards"]] == [1, 3]
    _run(tiny_target, tmp_path, max_shards=4, worker=0, num_workers=2)
    assert [s["index"] for s in read_manifest(tmp_path)["shards"]] == [0, 1, 2, 3]


def test_other_settings_are_refused(tiny_target, tmp_path):
    _run(tiny_target, tmp_path, max_shards=1)
    other = DatagenConfig(**{**CFG.__dict__, "max_new_tokens": 7})
    with pytest.raises(ValueError, match="other settings"):
        run_datagen(tiny_target, tmp_path, other, max_shards=1)


def test_token_budget_stops_generation(tiny_target, tmp_path):
    manifest = _run(tiny_target, tmp_path, max_response_tokens=1)
    assert len(manifest["shards"]) == 1


def test_a_data_set_made_before_later_prompt_kinds_still_resumes(tiny_target, tmp_path):
    _run(tiny_target, tmp_path, max_shards=1)
    path = tmp_path / "manifest.json"
    legacy = json.loads(path.read_text())
    for key in ("num_passage", "num_detailed_meta", "num_real"):
        del legacy["config"][key]
    path.write_text(json.dumps(legacy))
    old = DatagenConfig(**{**CFG.__dict__, "num_passage": 0, "num_detailed_meta": 0, "num_real": 0})
    manifest = run_datagen(tiny_target, tmp_path, old, max_shards=2, log=lambda _: None)
    assert len(manifest["shards"]) == 2
    with pytest.raises(ValueError, match="other settings"):
        run_datagen(tiny_target, tmp_path, CFG, max_shards=3)


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        ("short.", 100, "short."),
        ("One two three. Four five six seven.", 20, "One two three."),
        ("Hi. abcdefghijklmnop", 12, "Hi. abcdefgh"),  # the only break is too early: hard cut
        ("First line here\nsecond line goes on", 24, "First line here"),
        ("abcdefghij klmnop", 8, "abcdefgh"),
    ],
)
def test_passages_are_cut_at_a_line_or_sentence_end(text, limit, expected):
    assert datagen._cut(text, limit) == expected


def test_a_device_torch_cannot_use_is_refused_before_any_work(tmp_path, monkeypatch):
    from sglang_adatree import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, message in (("cuda", "no CUDA device"), ("gpu7", "--device gpu7")):
        with pytest.raises(SystemExit, match=message):
            cli.main(["models", "--home", str(tmp_path), "--device", device, "datagen"])
    assert not (tmp_path / "datagen").exists()


def test_a_negative_prompt_count_is_refused_before_any_work(tmp_path):
    from sglang_adatree import cli

    for flag in ("--num-passage", "--num-detailed-meta", "--num-real"):
        with pytest.raises(SystemExit, match=f"{flag} must be 0 or more"):
            cli.main(["models", "--home", str(tmp_path), "datagen", flag, "-1"])
    assert not (tmp_path / "datagen").exists()


def test_reproduce_refuses_an_unusable_device_before_preparing_anything(tmp_path, monkeypatch):
    from sglang_adatree.models.paths import ModelPaths
    from sglang_adatree.models.reproduce import Budget, reproduce

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        reproduce(ModelPaths(tmp_path), Budget(), device="cuda")
    assert list(tmp_path.iterdir()) == []


def test_gqa_attention_matches_transformers_sdpa_with_padding(tiny_target):
    """The runner's attention (shared K/V heads read in place) gives transformers' answers."""
    from transformers import AutoModelForCausalLM

    runner = datagen.TargetRunner(tiny_target, "float32")
    assert runner.model.config._attn_implementation == datagen.GQA_ATTENTION
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15]]  # unequal: left padding, a mask
    answers = runner.generate(prompts, 8)
    hidden, greedy = runner.teacher_forced([p + a for p, a in zip(prompts, answers, strict=True)])
    runner.model = AutoModelForCausalLM.from_pretrained(
        tiny_target, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    assert runner.generate(prompts, 8) == answers
    ref_hidden, ref_greedy = runner.teacher_forced(
        [p + a for p, a in zip(prompts, answers, strict=True)]
    )
    for h, r in zip(hidden, ref_hidden, strict=True):
        torch.testing.assert_close(h, r, atol=1e-3, rtol=1e-3)
    assert all(torch.equal(g, r) for g, r in zip(greedy, ref_greedy, strict=True))


def test_reproduce_hands_device_and_precision_to_every_datagen_worker(tmp_path, monkeypatch):
    from sglang_adatree.models import reproduce
    from sglang_adatree.models.paths import ModelPaths

    commands: list[list[str]] = []

    class Worker:  # stands in for the subprocess only: the commands are what is checked
        def __init__(self, cmd: list[str]) -> None:
            commands.append(cmd)

        def wait(self) -> int:
            return 0

    monkeypatch.setattr(reproduce.subprocess, "Popen", Worker)
    budget = reproduce.Budget(workers=2)
    reproduce.generate_training_data(ModelPaths(tmp_path), budget, "cuda", "float32")
    assert [c[c.index("--worker") + 1] for c in commands] == ["0/2", "1/2"]
    for c in commands:
        assert c[c.index("--device") + 1] == "cuda" and c[c.index("--dtype") + 1] == "float32"


def test_auto_precision_is_bf16_only_where_bf16_runs_in_hardware(tmp_path):
    from sglang_adatree.models.hardware import cpu_name, resolve_dtype

    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile\n\n")
    avx2 = tmp_path / "avx2"  # an AMD EPYC of this project's CI: bf16 emulated, 5-7x slower
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: avx512_bf16\n\n")
    assert resolve_dtype("auto", "cpu", amx) == "bfloat16"
    assert resolve_dtype("auto", "cpu", avx2) == "float32"  # a flag outside "flags" is no flag
    assert resolve_dtype("auto", "cpu", tmp_path / "absent") == "float32"
    assert resolve_dtype("auto", "cuda", avx2) == "bfloat16"
    assert resolve_dtype("bfloat16", "cpu", avx2) == "bfloat16"  # an explicit choice stands
    assert resolve_dtype("float32", "cuda", amx) == "float32"
    named = tmp_path / "named"
    named.write_text("processor\t: 0\nmodel name\t: AMD EPYC\n\nprocessor\t: 1\nmodel name\t: X\n")
    assert cpu_name(named) == "AMD EPYC"
