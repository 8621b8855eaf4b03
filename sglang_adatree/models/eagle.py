"""The EAGLE head: SGLang 0.5.23's ``LlamaForCausalLMEagle``, in plain PyTorch for training.

What SGLang runs (``srt/models/llama_eagle.py``), and therefore what this module computes::

    x = fc(cat(embed(token), hidden))            # fc: Linear(2H, H) with bias
    layer 0 without input_layernorm:             # SGLang deletes it (EAGLE's cnets.py)
        x = x + o_proj(attention(x))
        x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(x)                          # no final norm; lm_head is the target's

The head's embedding and lm_head are the target's (``EAGLEWorkerV2.init_lm_head`` calls
``set_embed_and_head``), sliced to the hot tokens when ``--speculative-token-map`` is given,
so the checkpoint holds only ``fc.*`` and ``layers.0.*``. ``hidden`` is the target's final
hidden state after its final norm for the first draft step, then the head's own output ``x``
(the tensor before ``lm_head``) for every further step.

Alignment: at position ``i`` the head reads the token ``i + 1`` and the target's hidden state
at ``i`` (which produced that token) and predicts token ``i + 2``. ``forward`` also unrolls
further draft steps the way they run at inference: step ``s`` at position ``i`` reads token
``i + s`` and the step ``s - 1`` output, and attends to the step-1 keys of positions ``<= i``
plus its own ancestors' keys at ``i`` (the draft's KV cache during a tree expansion).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from sglang_adatree.models.paths import TOKEN_MAP_FILE

ARCHITECTURE = "LlamaForCausalLMEagle"


@dataclass(frozen=True)
class HeadConfig:
    """The head's dimensions; the target's except the layer count."""

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    vocab_size: int = 49152

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_target(cls, target_config: dict, num_hidden_layers: int = 1) -> HeadConfig:
        rope = target_config.get("rope_parameters") or {}
        return cls(
            hidden_size=target_config["hidden_size"],
            intermediate_size=target_config["intermediate_size"],
            num_attention_heads=target_config["num_attention_heads"],
            num_key_value_heads=target_config["num_key_value_heads"],
            num_hidden_layers=num_hidden_layers,
            rms_norm_eps=target_config["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", target_config.get("rope_theta", 10000.0)),
            vocab_size=target_config["vocab_size"],
        )

    def sglang_config(self, target_config: dict, hot_vocab_size: int | None) -> dict:
        """config.json that SGLang resolves to ``LlamaForCausalLMEagle``."""
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": target_config["max_position_embeddings"],
            "vocab_size": self.vocab_size,
            # The head borrows the target's embedding and lm_head; tying would make SGLang's
            # set_embed_and_head delete one module's weight twice.
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": target_config.get("bos_token_id"),
            "eos_token_id": target_config.get("eos_token_id"),
            "torch_dtype": "float32",
        }
        if hot_vocab_size is not None:
            out["hot_vocab_size"] = hot_vocab_size
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (NeoX-style, half-split) rotary embedding. x: [B, heads, L, D], positions: [B, L]."""
    dim = x.shape[-1]
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[:, None, :, None] * inv_freq  # [B, 1, L, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        d, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kv, bias=False)
        self.v_proj = nn.Linear(d, kv, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)


class _MLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class _Layer(nn.Module):
    def __init__(self, cfg: HeadConfig, layer_id: int) -> None:
        super().__init__()
        if layer_id > 0:  # SGLang keeps input_layernorm on every layer but the first
            self.input_layernorm = _Norm(cfg.hidden_size)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _Norm(cfg.hidden_size)
        self.mlp = _MLP(cfg)


class EagleHead(nn.Module):
    """Trainable part of the head; ``state_dict()`` keys are SGLang's checkpoint names."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layers = nn.ModuleList(_Layer(cfg, i) for i in range(cfg.num_hidden_layers))

    def init_from_target(self, target_state: dict[str, torch.Tensor], layer: int) -> None:
        """Start each decoder layer from target layer ``layer``; fc keeps its random init
        (passing the target's hidden state through, norm about 46, unnormalised into the
        attention made the first losses explode)."""
        with torch.no_grad():
            for own in self.layers:
                for name, p in own.named_parameters():
                    p.copy_(target_state[f"model.layers.{layer}.{name}"])

    def forward(
        self,
        embed: torch.Tensor,  # [vocab, H] the target's embedding (frozen)
        step_tokens: torch.Tensor,  # [steps, B, L] token read by step s at position i
        hidden: torch.Tensor,  # [B, L, H] target's post-norm hidden state at i
        positions: torch.Tensor,  # [B, L] position ids
        key_valid: torch.Tensor,  # [B, L] bool, False on padding
    ) -> torch.Tensor:
        """Outputs (the tensor before lm_head) of every unrolled step: [steps, B, L, H]."""
        steps, batch, length = step_tokens.shape
        assert hidden.shape[:2] == (batch, length), (hidden.shape, step_tokens.shape)
        assert positions.shape == (batch, length) and key_valid.shape == (batch, length)
        causal = torch.ones(length, length, dtype=torch.bool, device=hidden.device).tril()
        base_mask = causal[None, None] & key_valid[:, None, None, :]  # [B, 1, L, L]
        outputs = []
        layer_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        x_in = hidden
        for s in range(steps):
            emb = F.embedding(step_tokens[s], embed)  # [B, L, H]
            x = self.fc(torch.cat((emb.to(x_in.dtype), x_in), dim=-1))
            for li, layer in enumerate(self.layers):
                x = self._layer(layer, li, x, positions + s, base_mask, layer_kv[li])
            outputs.append(x)
            x_in = x
        return torch.stack(outputs)

    def _layer(
        self,
        layer: _Layer,
        layer_id: int,
        x: torch.Tensor,  # [B, L, H]
        positions: torch.Tensor,  # [B, L]
        base_mask: torch.Tensor,  # [B, 1, L, L]
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],  # earlier steps' (k, v)
    ) -> torch.Tensor:
        cfg = self.cfg
        batch, length, _ = x.shape
        heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a_in = x if layer_id == 0 else rms_norm(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        attn = layer.self_attn
        q = attn.q_proj(a_in).view(batch, length, heads, dim).transpose(1, 2)
        k = attn.k_proj(a_in).view(batch, length, kv_heads, dim).transpose(1, 2)
        v = attn.v_proj(a_in).view(batch, length, kv_heads, dim).transpose(1, 2)
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
        rep = heads // kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        kv_cache.append((k, v))
        k1, v1 = kv_cache[0]  # step 1: the context, causal over positions
        scale = 1.0 / math.sqrt(dim)
        scores = (q @ k1.transpose(-1, -2)) * scale  # [B, heads, L, L]
        scores = scores.masked_fill(~base_mask, float("-inf"))
        # Step s > 1 at position i also sees its ancestors' entries at i (steps 2..s).
        diag = [(q * ks).sum(-1, keepdim=True) * scale for ks, _ in kv_cache[1:]]
        # In the scores' dtype: the CPU kernel accumulates bf16 in fp32, and an fp32 copy of
        # [B, heads, L, L] and back cost more than the softmax itself in bf16 training.
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        out = probs[..., :length] @ v1  # [B, heads, L, D]
        for j, (_, vs) in enumerate(kv_cache[1:]):
            out = out + probs[..., length + j : length + j + 1] * vs
        out = out.transpose(1, 2).reshape(batch, length, heads * dim)
        x = x + attn.o_proj(out)
        return x + layer.mlp(rms_norm(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps))


def export(
    head: EagleHead, hot_ids: torch.Tensor | None, target_config: dict, out_dir: Path
) -> None:
    """Write a folder SGLang serves: config.json, model.safetensors (bf16), token_map.pt."""
    out_dir.mkdir(parents=True, exist_ok=True)
    hot_size = None if hot_ids is None else int(hot_ids.numel())
    config = head.cfg.sglang_config(target_config, hot_size)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    if hot_ids is not None:
        # SGLang's load_token_map: torch.load(path, weights_only=True) -> a list of target ids.
        torch.save(hot_ids.tolist(), out_dir / TOKEN_MAP_FILE)


def load(folder: Path) -> tuple[EagleHead, torch.Tensor | None]:
    """A head (fp32) and its hot token ids from a folder written by ``export``."""
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE], config["architectures"]
    rope = config.get("rope_parameters") or {}
    cfg = HeadConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        num_hidden_layers=config["num_hidden_layers"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        vocab_size=config["vocab_size"],
    )
    head = EagleHead(cfg)
    head.load_state_dict({k: v.float() for k, v in load_file(folder / "model.safetensors").items()})
    token_map = folder / TOKEN_MAP_FILE
    hot_ids = None
    if token_map.is_file():
        hot_ids = torch.tensor(torch.load(token_map, weights_only=True), dtype=torch.long)
    return head.eval(), hot_ids
