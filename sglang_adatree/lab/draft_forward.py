"""The draft in plain torch, run the way SGLang 0.5.23 runs it around a decode step.

Two kinds of forward, over one request whose whole sequence (prompt and greedy answer) is
known in advance:

* context: the draft's extend over the sequence. SGLang shifts the draft's input one token left
  of the target's (``_draft_extend_for_prefill``; the decode extend feeds the verify's next
  tokens): draft position ``j`` reads token ``j + 1`` (and, for an EAGLE head, the target's
  post-norm hidden state at ``j``). A standalone draft is shifted the same way, so it never
  reads the sequence's first token. The KV of positions ``0 .. j`` is what every draft step
  after a verify that left the request with ``j + 2`` tokens attends to.
* tree step: one draft pass of a tree expansion over ``topk`` branch rows per request. Branch
  row ``t`` at pass ``i`` attends to the context prefix plus the keys that branch row ``t``
  wrote at passes ``0 .. i``: SGLang's draft KV layout (``generate_draft_decode_kv_indices``,
  ``cpu/attention.py``'s multi-step backend) gives each branch row fixed slots, while the
  selection re-picks which node sits in each row every pass, so a node may attend to keys of
  another branch's nodes instead of its ancestors'. The hidden states, on the other hand,
  follow the parent (``select_top_k_tokens``). Reproduced as it is, since it is what runs.

Logits cover the draft's vocabulary: the hot tokens of an EAGLE head with a token map
(``vocab_ids`` maps a column to its full-vocabulary id), else the full vocabulary. An EAGLE
head borrows the target's embedding and lm_head (sliced to the hot tokens), as
``EAGLEWorkerV2.init_lm_head`` does.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from sglang_adatree.drafts import draft_kind_of
from sglang_adatree.models import eagle
from sglang_adatree.models.paths import TOKEN_MAP_FILE


@dataclass(frozen=True)
class DraftContext:
    """The draft's extend over one request: its KV cache and (EAGLE) its outputs."""

    keys: tuple[torch.Tensor, ...]  # per layer [positions, kv_heads, head_dim], rope applied
    values: tuple[torch.Tensor, ...]  # per layer [positions, kv_heads, head_dim]
    hidden: torch.Tensor | None  # [positions, hidden] the head's outputs; None: standalone


class BranchCache:
    """Keys and values the tree passes wrote, per layer, in branch-row order."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_theta(config: dict) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported by the trace builder")
    return float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))


class DraftRunner:
    """A Llama-style draft (EAGLE head or standalone model) with explicit KV handling."""

    def __init__(
        self,
        kind: str,
        config: dict,
        layers: torch.nn.ModuleList,
        embed: torch.Tensor,  # [vocab, hidden] input embedding
        lm_head: torch.Tensor,  # [draft_vocab, hidden] output rows (hot rows for a token map)
        vocab_ids: torch.Tensor | None,  # [draft_vocab] full ids of the logit columns
        fc: torch.nn.Module | None = None,  # EAGLE: Linear(2 hidden, hidden)
        final_norm: torch.Tensor | None = None,  # standalone: [hidden]
    ) -> None:
        assert kind in ("eagle", "standalone"), kind
        assert (fc is not None) == (kind == "eagle"), "an EAGLE head, and only one, has fc"
        self.kind = kind
        self.layers = layers
        self.embed = embed
        self.lm_head = lm_head
        self.vocab_ids = vocab_ids
        self.fc = fc
        self.final_norm = final_norm
        self.eps = float(config["rms_norm_eps"])
        self.num_heads = int(config["num_attention_heads"])
        self.num_kv_heads = int(config["num_key_value_heads"])
        self.head_dim = int(config.get("head_dim") or config["hidden_size"] // self.num_heads)
        theta = _rope_theta(config)
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]

    @property
    def reads_hidden(self) -> bool:
        return self.fc is not None

    # -- the math shared by both passes --------------------------------------------------------

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """NeoX-style (half-split) rotary embedding; x: [rows, heads, head_dim]."""
        angles = positions.float()[:, None, None] * self.inv_freq  # [rows, 1, head_dim / 2]
        cos, sin = angles.cos(), angles.sin()
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _input(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """First layer's input of rows: [rows, hidden] from tokens [rows] (and hidden)."""
        x = F.embedding(tokens, self.embed)
        if self.fc is not None:
            assert hidden is not None, "an EAGLE head reads a hidden state per row"
            x = self.fc(torch.cat((x, hidden), dim=-1))
        return x

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """All decoder layers over rows x [rows, hidden]; ``attend(layer, q, k, v)`` gives
        [rows, heads, head_dim] from q [rows, heads, D] and the rows' own k, v."""
        rows = x.shape[0]
        for li, layer in enumerate(self.layers):
            norm = getattr(layer, "input_layernorm", None)  # EAGLE's layer 0 has none
            h = x if norm is None else _rms_norm(x, norm.weight, self.eps)
            attn = layer.self_attn
            q = attn.q_proj(h).view(rows, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(rows, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(rows, self.num_kv_heads, self.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            out = attend(li, q, k, v)
            x = x + attn.o_proj(out.reshape(rows, self.num_heads * self.head_dim))
            x = x + layer.mlp(_rms_norm(x, layer.post_attention_layernorm.weight, self.eps))
        return x

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft logits [rows, draft_vocab] of layer outputs [rows, hidden]."""
        if self.final_norm is not None:
            out = _rms_norm(out, self.final_norm, self.eps)
        return out @ self.lm_head.T

    # -- the two passes ------------------------------------------------------------------------

    @torch.inference_mode()
    def context(
        self,
        tokens: torch.Tensor,  # [seq] the whole sequence, prompt and answer
        target_hidden: torch.Tensor | None,  # [seq, hidden] post-norm; EAGLE only
    ) -> tuple[DraftContext, torch.Tensor]:
        """The extend over draft positions ``0 .. seq - 2`` (position j reads token j + 1):
        the KV cache, and the layers' outputs [seq - 1, hidden] (before any final norm)."""
        n = tokens.shape[0] - 1
        assert n >= 1, "a draft context needs at least two tokens"
        hidden = target_hidden[:n] if self.reads_hidden else None
        x = self._input(tokens[1:], hidden)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []

        def causal(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys.append(k)
            values.append(v)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=self.num_heads != self.num_kv_heads,
            )  # fmt: skip
            return out[0].transpose(0, 1)

        out = self._layers(x, torch.arange(n), causal)
        ctx = DraftContext(tuple(keys), tuple(values), out if self.reads_hidden else None)
        return ctx, out

    @torch.inference_mode()
    def tree_step(
        self,
        ctx: DraftContext,
        prefix_lens: torch.Tensor,  # [requests] draft positions each row attends to
        step: int,  # the pass: its rows sit at rope position prefix_len + step
        tokens: torch.Tensor,  # [requests, topk] full-vocabulary ids of the frontier
        hidden: torch.Tensor | None,  # [requests, topk, hidden] each node's parent output
        cache: BranchCache,  # keys and values of the earlier passes; this one's is added
    ) -> torch.Tensor:
        """One tree pass: layer outputs [requests, topk, hidden] of the frontier rows."""
        requests, topk = tokens.shape
        rows = requests * topk
        x = self._input(tokens.reshape(rows), None if hidden is None else hidden.flatten(0, 1))
        lens = prefix_lens.repeat_interleave(topk)  # [rows]
        positions = lens + step
        width = int(prefix_lens.max())
        visible = torch.arange(width)[None] < lens[:, None]  # [rows, width]
        rep = self.num_heads // self.num_kv_heads
        scale = 1.0 / math.sqrt(self.head_dim)

        def prefix_and_branch(li, q, k, v):
            cache.keys[li].append(k)
            cache.values[li].append(v)
            qg = q.view(rows, self.num_kv_heads, rep, self.head_dim)
            kp, vp = ctx.keys[li][:width], ctx.values[li][:width]  # [width, kv_heads, D]
            kb = torch.stack(cache.keys[li], dim=1)  # [rows, passes, kv_heads, D]
            vb = torch.stack(cache.values[li], dim=1)
            s_prefix = torch.einsum("nkrd,jkd->nkrj", qg, kp) * scale
            s_prefix = s_prefix.masked_fill(~visible[:, None, None, :], float("-inf"))
            s_branch = torch.einsum("nkrd,nskd->nkrs", qg, kb) * scale
            probs = torch.softmax(torch.cat((s_prefix, s_branch), dim=-1), dim=-1)
            out = torch.einsum("nkrj,jkd->nkrd", probs[..., :width], vp)
            out = out + torch.einsum("nkrs,nskd->nkrd", probs[..., width:], vb)
            return out.reshape(rows, self.num_heads, self.head_dim)

        out = self._layers(x, positions, prefix_and_branch)
        return out.view(requests, topk, -1)


# -- loading ------------------------------------------------------------------------------------


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    return {k: v.float() for k, v in tensors.items()}


def load_draft(draft: Path, target_model: torch.nn.Module) -> DraftRunner:
    """The draft of folder ``draft`` for a target loaded in transformers (fp32).

    An EAGLE head uses ``token_map.pt`` from its folder when there is one (serve it with
    ``--speculative-token-map`` pointing there, as ``adatree demo`` does); EAGLE-3 heads are
    not supported.
    """
    config = json.loads((draft / "config.json").read_text())
    kind = draft_kind_of(config)
    if kind == "standalone":
        return _load_standalone(draft, config)
    if kind != "eagle":
        raise ValueError(f"{draft}: {kind} drafts are not supported by the trace builder")
    embed = target_model.get_input_embeddings().weight.detach().float()
    head_config = eagle.HeadConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        num_hidden_layers=config["num_hidden_layers"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=_rope_theta(config),
        vocab_size=config["vocab_size"],
    )
    head = eagle.EagleHead(head_config)
    # SGLang loads every checkpoint tensor but lm_head under "model."; the embedding is
    # replaced by the target's.
    state = {
        k.removeprefix("model."): v
        for k, v in _read_tensors(draft).items()
        if not k.removeprefix("model.").startswith(("embed_tokens.", "lm_head."))
    }
    head.load_state_dict(state)
    head.eval()
    lm_head = target_model.get_output_embeddings().weight.detach().float()
    vocab_ids = None
    token_map = draft / TOKEN_MAP_FILE
    if token_map.is_file():
        vocab_ids = torch.tensor(torch.load(token_map, weights_only=True), dtype=torch.long)
        lm_head = lm_head[vocab_ids]
    return DraftRunner("eagle", config, head.layers, embed, lm_head, vocab_ids, fc=head.fc)


def _load_standalone(draft: Path, config: dict) -> DraftRunner:
    from transformers import AutoModelForCausalLM

    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"{draft}: only Llama standalone drafts are supported")
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    return DraftRunner(
        "standalone",
        config,
        model.model.layers,
        model.get_input_embeddings().weight.detach(),
        model.get_output_embeddings().weight.detach(),
        None,
        final_norm=model.model.norm.weight.detach(),
    )
