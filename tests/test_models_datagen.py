"""Data generation on a tiny target: exact labels and features, and resume after a stop."""

import json

import pytest
import torch
from models_tiny import make_tiny_target
from safetensors.torch import load_file

from sglang_adatree.models.datagen import DatagenConfig, load_shard, read_manifest, run_datagen

CFG = DatagenConfig(
    name="tiny",
    prompts_per_shard=5,
    num_meta=1,
    num_followup=1,
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


def test_resume_after_a_stop_gives_the_same_data(tiny_target, tmp_path):
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
    # Shard 2 harvested shard 0: a follow-up on one of its answers.
    kinds = [row["kind"] for row in json.loads((whole / "shard-00002.json").read_text())]
    assert "followup" in kinds


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
