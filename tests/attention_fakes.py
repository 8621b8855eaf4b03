"""Small stand-ins for the SGLang objects the CPU attention backend reads.

Shared by ``test_sglang_cpu_attention.py`` and ``scripts/bench_cpu_attention.py``; the real
objects need a server, and ``test_e2e_cpu_path.py`` runs the backend inside one.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch


class FakePool:
    """Token-indexed K/V buffers with SGLang's pool interface (one layer's worth)."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, fill: str = "zeros") -> None:
        make = torch.zeros if fill == "zeros" else torch.randn
        self.k = make(slots, kv_heads, head_dim)
        self.v = make(slots, kv_heads, head_dim)

    def set_kv_buffer(self, layer: object, loc: object, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[loc.loc] = k.view(-1, *self.k.shape[1:])
        self.v[loc.loc] = v.view(-1, *self.v.shape[1:])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v


@dataclass
class Mode:
    """A forward mode: ``decode``, ``verify`` (target verify) or ``extend``."""

    name: str

    def is_idle(self) -> bool:
        return False

    def is_decode(self) -> bool:
        return self.name == "decode"

    def is_target_verify(self) -> bool:
        return self.name == "verify"


def attention_layer(heads: int, kv_heads: int, head_dim: int) -> SimpleNamespace:
    """The attributes of a ``RadixAttention`` layer the backend reads (layer 0)."""
    return SimpleNamespace(
        tp_q_head_num=heads,
        tp_k_head_num=kv_heads,
        qk_head_dim=head_dim,
        v_head_dim=head_dim,
        scaling=head_dim**-0.5,
        layer_id=0,
    )


def fused_qkv(
    rows: int, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random flat q [rows, H*D], k and v [rows, KVH*D], as a layer hands them over: views
    of one fused projection (rows strided by the fused width, not contiguous)."""
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return q, k, v
