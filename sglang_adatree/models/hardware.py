"""What this machine's CPU is, for choosing a precision and for naming it on a card.

Read from Linux's ``/proc/cpuinfo`` (its first processor block); elsewhere the answers fall
back to what is always safe: fp32, and the name ``platform.processor()`` gives.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
# flags of CPUs whose bf16 matmuls run in hardware (AMX tiles, AVX-512 BF16); without them
# torch emulates bf16 and a bf16 matmul took 7x an fp32 one (an AVX2-only AMD EPYC)
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_fields(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """``key: value`` lines of the first processor; empty where the file cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def cpu_has_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether the CPU runs bf16 matmuls in hardware; False where its flags cannot be read
    (fp32 is never the slow choice by much, bf16 without the instructions is)."""
    return bool(set(cpu_fields(cpuinfo).get("flags", "").split()) & BF16_CPU_FLAGS)


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+"), or "" if unknown."""
    return cpu_fields(cpuinfo).get("model name") or platform.processor()


def resolve_dtype(dtype: str, device: str, cpuinfo: Path = CPUINFO) -> str:
    """``--dtype auto`` made concrete (other choices pass through): bf16 on a GPU or on a CPU
    with bf16 instructions, fp32 on any other CPU. Data sets and summaries record the result."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type != "cpu":
        return "bfloat16"
    return "bfloat16" if cpu_has_bf16(cpuinfo) else "float32"
