"""The EAGLE head: same math as SGLang's LlamaForCausalLMEagle, same checkpoint names."""

import json

import pytest
import torch
from models_tiny import TINY_HEAD
from safetensors.torch import load_file

from sglang_adatree.models import eagle
from sglang_adatree.models.paths import EAGLE_NAME, TOKEN_MAP_FILE, shipped_weights

# What SGLang 0.5.23's LlamaForCausalLMEagle.load_weights consumes for a 1-layer head (it adds
# "model." and stacks q/k/v and gate/up itself); embed_tokens and lm_head come from the target.
SGLANG_EAGLE_KEYS = {
    "fc.weight",
    "fc.bias",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}
TARGET_CONFIG = {"max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}


def _random_head(seed: int = 0) -> eagle.EagleHead:
    torch.manual_seed(seed)
    head = eagle.EagleHead(TINY_HEAD)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.2)
    return head


def test_layer_matches_hf_decoder_layer_without_input_norm():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    hf_config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        rms_norm_eps=1e-5,
    )
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(hf_config, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    head = eagle.EagleHead(TINY_HEAD)
    head.init_from_target({f"model.layers.3.{k}": v for k, v in layer.state_dict().items()}, 3)
    with torch.no_grad():  # fc passes the hidden state through: only the layer is compared
        head.fc.weight.zero_()
        head.fc.weight[:, 32:] = torch.eye(32)
        head.fc.bias.zero_()
    layer.input_layernorm = torch.nn.Identity()  # SGLang deletes it on the head's layer 0

    batch, length = 2, 7
    x = torch.randn(batch, length, 32)
    pos = torch.arange(length).expand(batch, length)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    pe = LlamaRotaryEmbedding(hf_config)(x, pos)
    ref = layer(x, attention_mask=mask, position_embeddings=pe, position_ids=pos)
    ref = ref[0] if isinstance(ref, tuple) else ref
    tokens = torch.zeros(1, batch, length, dtype=torch.long)
    out = head(torch.zeros(50, 32), tokens, x, pos, torch.ones(batch, length, dtype=torch.bool))
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def test_unrolled_step_equals_an_appended_position():
    """Step 2 at i sees positions <= i plus itself: like a sequence extended by one entry."""
    head = _random_head()
    embed = torch.randn(50, 32)
    batch, length, i = 2, 9, 4
    hidden = torch.randn(batch, length, 32)
    tokens = torch.randint(0, 50, (2, batch, length))
    pos = torch.arange(length).expand(batch, length)
    valid = torch.ones(batch, length, dtype=torch.bool)
    two = head(embed, tokens, hidden, pos, valid)

    seq_hidden = torch.cat([hidden[:, : i + 1], two[0][:, i : i + 1]], dim=1)
    seq_tokens = torch.cat([tokens[0][:, : i + 1], tokens[1][:, i : i + 1]], dim=1)[None]
    n = i + 2
    one = head(embed, seq_tokens, seq_hidden, torch.arange(n).expand(batch, n), valid[:, :n])
    torch.testing.assert_close(one[0][:, i + 1], two[1][:, i], atol=1e-5, rtol=1e-5)
    # Step 1 is plain causal attention: position i ignores everything after it.
    later = hidden.clone()
    later[:, i + 1 :] += 1.0
    moved = head(embed, tokens, later, pos, valid)
    torch.testing.assert_close(moved[0][:, : i + 1], two[0][:, : i + 1])


def test_padding_keys_are_ignored():
    head = _random_head()
    embed = torch.randn(50, 32)
    hidden = torch.randn(1, 6, 32)
    tokens = torch.randint(0, 50, (3, 1, 6))
    pos = torch.arange(6)[None]
    valid = torch.tensor([[True, True, True, True, False, False]])
    out = head(embed, tokens, hidden, pos, valid)
    noisy = hidden.clone()
    noisy[:, 4:] = 100.0
    torch.testing.assert_close(head(embed, tokens, noisy, pos, valid)[:, :, :4], out[:, :, :4])


def test_export_writes_sglang_names_config_and_token_map(tmp_path):
    head = _random_head()
    hot_ids = torch.tensor([2, 3, 5, 7, 11, 13, 17])
    eagle.export(head, hot_ids, TARGET_CONFIG, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert set(tensors) == SGLANG_EAGLE_KEYS
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert config["hot_vocab_size"] == 7 and config["tie_word_embeddings"] is False
    assert torch.load(tmp_path / TOKEN_MAP_FILE, weights_only=True) == hot_ids.tolist()
    loaded, loaded_hot = eagle.load(tmp_path)
    assert torch.equal(loaded_hot, hot_ids)
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value.to(torch.bfloat16).float())


def test_shipped_head_is_complete_and_small():
    folder = shipped_weights(EAGLE_NAME)
    weights = folder / "model.safetensors"
    assert weights.stat().st_size <= 20 * 1024 * 1024
    assert set(load_file(weights)) == SGLANG_EAGLE_KEYS
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert (config["hidden_size"], config["vocab_size"]) == (576, 49152)
    hot = torch.load(folder / TOKEN_MAP_FILE, weights_only=True)
    assert len(hot) == config["hot_vocab_size"] == len(set(hot))
    assert min(hot) >= 0 and max(hot) < 49152
    card = (folder / "MODEL_CARD.md").read_text()
    assert "top-1 agreement: 0." in card and "adatree models evaluate" in card


@pytest.mark.slow
def test_sglang_llama_eagle_loads_the_export(tmp_path, monkeypatch):
    """SGLang's own model class takes every tensor, stacked the way its layers expect."""
    import os

    for key, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29655", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        monkeypatch.setenv(key, os.environ.get(key, value))
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    if not model_parallel_is_initialized():
        reset_context()
        publish(
            ServerArgs(model_path="dummy", device="cpu"),
            role="test",
            ranks=SpawnRanks(world_rank=0),
        )
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
    # Without the (separately installed) CPU engine SGLang takes the vllm rotary kernel path
    # off CUDA; the pure-torch rotary path is what a CPU build uses.
    monkeypatch.setattr(rope_base, "_is_cpu", True)
    from sglang.srt.models.llama_eagle import LlamaForCausalLMEagle

    head = _random_head()
    config = {**TARGET_CONFIG, "num_hidden_layers": 1}
    eagle.export(head, torch.arange(10), config, tmp_path)
    sgl_config = LlamaConfig(**json.loads((tmp_path / "config.json").read_text()))
    model = LlamaForCausalLMEagle(sgl_config)
    tensors = load_file(tmp_path / "model.safetensors")
    model.load_weights(list(tensors.items()))
    params = {k: v.data.float() for k, v in model.named_parameters()}
    t = {k: v.float() for k, v in tensors.items()}
    prefix = "model.layers.0."
    expected = {
        "model.fc.weight": t["fc.weight"],
        "model.fc.bias": t["fc.bias"],
        prefix + "self_attn.qkv_proj.weight": torch.cat(
            [t[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]
        ),
        prefix + "self_attn.o_proj.weight": t["layers.0.self_attn.o_proj.weight"],
        prefix + "mlp.gate_up_proj.weight": torch.cat(
            [t["layers.0.mlp.gate_proj.weight"], t["layers.0.mlp.up_proj.weight"]]
        ),
        prefix + "mlp.down_proj.weight": t["layers.0.mlp.down_proj.weight"],
        prefix + "post_attention_layernorm.weight": t["layers.0.post_attention_layernorm.weight"],
    }
    assert set(params) == set(expected) | {"model.embed_tokens.weight", "lm_head.weight"}
    assert not hasattr(model.model.layers[0], "input_layernorm")
    for key, value in expected.items():
        assert torch.equal(params[key], value), key
