"""A tiny EAGLE head for the tiny seeded target (``tiny_models``), fitted in seconds.

A randomly initialised head almost never agrees with the target, which leaves nothing for an
acceptance test to check; this one is fitted (a few hundred Adam steps) to the target's own
greedy answers to the prompts it will be tested on, over a hot vocabulary of the tokens those
sequences use, so it agrees often but not always. Exported as SGLang serves it
(``LlamaForCausalLMEagle``, bf16 weights, ``token_map.pt``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from sglang_adatree.lab.target_pass import TargetPass
from sglang_adatree.models import eagle

FIT_STEPS = 100  # the chain 3,1,4 emits ~2.0 a step after 100 (after 300 too)
FIT_LR = 3e-3


def make_tiny_eagle(
    target: Path, out_dir: Path, prompts: Sequence[str], max_new_tokens: int, seed: int = 0
) -> Path:
    """Fit and export a head for ``target`` (once per directory); returns ``out_dir``."""
    if (out_dir / "config.json").is_file():
        return out_dir
    threads = torch.get_num_threads()
    # Products this small run faster on one thread: on the shared 2-core machine the fit took
    # 58 s of CPU with two threads and 2 s with one.
    torch.set_num_threads(1)
    try:
        _fit(target, out_dir, prompts, max_new_tokens, seed)
    finally:
        torch.set_num_threads(threads)
    return out_dir


def _fit(
    target: Path, out_dir: Path, prompts: Sequence[str], max_new_tokens: int, seed: int
) -> None:
    target_pass = TargetPass(target)
    prompt_ids = [target_pass.prompt_ids(p) for p in prompts]
    answers = target_pass.answers(prompt_ids, max_new_tokens)
    seqs = [p + a for p, a in zip(prompt_ids, answers, strict=True)]
    hidden = [
        target_pass.teacher_forced(s, len(p))[0] for s, p in zip(seqs, prompt_ids, strict=True)
    ]
    hot_ids = torch.tensor(sorted({t for s in seqs for t in s}))
    column = torch.full((target_pass.model.config.vocab_size,), -100, dtype=torch.long)
    column[hot_ids] = torch.arange(hot_ids.numel())

    # Position i reads token i + 1 and the hidden state at i, and predicts token i + 2.
    width = max(len(s) for s in seqs) - 2
    tokens = torch.zeros(1, len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    states = torch.zeros(len(seqs), width, hidden[0].shape[1])
    valid = torch.zeros(len(seqs), width, dtype=torch.bool)
    for row, (s, h) in enumerate(zip(seqs, hidden, strict=True)):
        n = len(s) - 2
        tokens[0, row, :n] = torch.tensor(s[1:-1])
        labels[row, :n] = column[torch.tensor(s[2:])]
        states[row, :n] = h[:n]
        valid[row, :n] = True
    positions = torch.arange(width).expand(len(seqs), width)

    target_config = json.loads((target / "config.json").read_text())
    torch.manual_seed(seed)
    head = eagle.EagleHead(eagle.HeadConfig.from_target(target_config))
    model = target_pass.model
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()[hot_ids]
    optimizer = torch.optim.Adam(head.parameters(), lr=FIT_LR)
    for _ in range(FIT_STEPS):
        out = head(embed, tokens, states, positions, valid)[0]  # [seqs, width, hidden]
        loss = F.cross_entropy((out @ lm_head.T).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    eagle.export(head.eval(), hot_ids, target_config, out_dir)
