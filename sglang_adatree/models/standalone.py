"""The standalone draft: a 2-layer Llama with the target's vocabulary, served as a normal model.

SGLang's STANDALONE worker loads the draft as an ordinary ``LlamaForCausalLM`` with its own
embedding and lm_head (``StandaloneDraftWorker.init_lm_head`` shares nothing). Here both are the
target's embedding, tied and frozen: the draft reads and writes exactly the target's token
space, only its two decoder layers (started from target layers) and final norm are trained.

The embedding alone (49,152 x 576) is 57 MB in bf16, over the 20 MB a shipped draft may take,
so the package ships the trained tensors only (``model.layers.*``, ``model.norm.weight``) and
``prepare`` assembles the servable folder, copying the embedding from the prepared target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

NUM_LAYERS = 2
EMBED_KEY = "model.embed_tokens.weight"


def draft_config(target_config: dict, num_layers: int = NUM_LAYERS) -> dict:
    """The target's config with fewer layers: same vocabulary, width and tokenizer."""
    cfg = {k: v for k, v in target_config.items() if not k.startswith("_")}
    cfg.update(
        num_hidden_layers=num_layers,
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=True,
        dtype="float32",
    )
    cfg.pop("quantization_config", None)
    return cfg


def build_draft(target_dir: Path, source_layers: tuple[int, ...]):
    """A draft initialised from the target: embedding, final norm, and the chosen layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target_config = json.loads((target_dir / "config.json").read_text())
    cfg = draft_config(target_config, len(source_layers))
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    target = load_file(target_dir / "model.safetensors")
    state = {EMBED_KEY: target[EMBED_KEY], "model.norm.weight": target["model.norm.weight"]}
    for own, src in enumerate(source_layers):
        prefix = f"model.layers.{src}."
        for key, value in target.items():
            if key.startswith(prefix):
                state[f"model.layers.{own}." + key[len(prefix) :]] = value
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the package ships: everything but the (frozen, target's) embedding."""
    return {
        k: v.detach().to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k not in (EMBED_KEY, "lm_head.weight")
    }


def export_trained(model: torch.nn.Module, target_dir: Path, out_dir: Path) -> None:
    """Write the shipped folder: config.json and the trained tensors (bf16, no embedding)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((target_dir / "config.json").read_text())
    cfg = draft_config(target_config, model.config.num_hidden_layers)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(trained_state(model), out_dir / "model.safetensors", metadata={"format": "pt"})


def assemble(shipped_dir: Path, target_dir: Path, out_dir: Path) -> None:
    """A servable HF folder: shipped tensors + the target's embedding and tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(shipped_dir / "model.safetensors")
    target = load_file(target_dir / "model.safetensors")
    tensors[EMBED_KEY] = target[EMBED_KEY]  # exactly the target's, as in training and evaluation
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text((shipped_dir / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (target_dir / name).is_file():
            (out_dir / name).write_bytes((target_dir / name).read_bytes())


def load(shipped_dir: Path, target_dir: Path):
    """The draft (fp32) from shipped tensors plus the target's embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((shipped_dir / "config.json").read_text())
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    state = {k: v.float() for k, v in load_file(shipped_dir / "model.safetensors").items()}
    if EMBED_KEY not in state:
        state[EMBED_KEY] = load_file(target_dir / "model.safetensors")[EMBED_KEY].float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()
