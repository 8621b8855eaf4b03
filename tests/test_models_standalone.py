"""The standalone draft: built from target layers, shipped without the embedding, reassembled."""

import json

import pytest
import torch
from models_tiny import make_tiny_target
from safetensors.torch import load_file

from sglang_adatree.models import standalone
from sglang_adatree.models.paths import STANDALONE_NAME, shipped_weights


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    torch.set_num_threads(1)
    return make_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


def test_build_starts_from_the_chosen_target_layers(tiny_target):
    draft = standalone.build_draft(tiny_target, (1,))
    target = load_file(tiny_target / "model.safetensors")
    state = draft.state_dict()
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(
        state["model.layers.0.mlp.up_proj.weight"], target["model.layers.1.mlp.up_proj.weight"]
    )
    assert torch.equal(state[standalone.EMBED_KEY], target[standalone.EMBED_KEY])
    assert draft.lm_head.weight is draft.model.embed_tokens.weight  # tied to the target's embedding
    assert not draft.model.embed_tokens.weight.requires_grad


def test_export_then_assemble_loads_with_transformers(tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft = standalone.build_draft(tiny_target, (0, 1))
    with torch.no_grad():
        draft.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # "trained": differs from the target
        for p in draft.model.layers.parameters():  # shipped in bf16: compare at that precision
            p.copy_(p.to(torch.bfloat16).float())
    shipped, servable = tmp_path / "shipped", tmp_path / "servable"
    standalone.export_trained(draft, tiny_target, shipped)
    assert standalone.EMBED_KEY not in load_file(shipped / "model.safetensors")
    standalone.assemble(shipped, tiny_target, servable)

    loaded = AutoModelForCausalLM.from_pretrained(servable, dtype=torch.float32).eval()
    ids = torch.randint(0, draft.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, draft.eval()(ids).logits)
    target_tok, draft_tok = (
        AutoTokenizer.from_pretrained(tiny_target),
        AutoTokenizer.from_pretrained(servable),
    )
    text = "Write a short story about cats."
    assert draft_tok.encode(text) == target_tok.encode(text)
    assert draft_tok.chat_template == target_tok.chat_template
    reloaded = standalone.load(shipped, tiny_target)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, draft(ids).logits)


def test_shipped_draft_is_small_and_matches_the_target_vocabulary():
    folder = shipped_weights(STANDALONE_NAME)
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 20 * 1024 * 1024
    tensors = load_file(weights)
    assert standalone.EMBED_KEY not in tensors and "model.norm.weight" in tensors
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"]) == (49152, 576)
    assert config["tie_word_embeddings"] is True
    layers = {k.split(".")[2] for k in tensors if k.startswith("model.layers.")}
    assert len(layers) == config["num_hidden_layers"]
    card = (folder / "MODEL_CARD.md").read_text()
    assert "top-1 agreement: 0." in card and "adatree models evaluate" in card
