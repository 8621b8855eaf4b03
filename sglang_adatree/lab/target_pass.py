"""The target's side of a trace: prompt tokens, greedy answers, teacher-forced hidden states.

Prompts are tokenised the way ``adatree bench`` and ``adatree compare`` send them: the user
message through the target's chat template as text (``ChatFormatter``), then SGLang's own
``tokenizer(text)``; without a chat template (or with ``chat_template=False``) the message is
sent as it is.

Answers are greedy, in fp32 (the precision the suite's servers run), generated in batches with
left padding by the data generator's ``TargetRunner`` (its attention reads the shared K/V heads
in place); an answer ends with the first end-of-sequence token (kept, as SGLang keeps it in
``output_ids``) or at ``max_new_tokens``. The teacher-forced pass then runs the target over
prompt and answer in one forward and keeps the final hidden state after the final norm (what
SGLang captures for an EAGLE head), and counts the answer tokens that pass would not pick
greedily: batched generation and one long forward round differently, and a near-tie can break
the other way (0 of 512 tokens on 8 MT-bench prompts with the bundled target).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from sglang_adatree.models.datagen import TargetRunner

# Prompts per batched generation: a batch of 8 generated 2x faster than one at a time on the
# 2-core CPU; prompts of similar length are batched together to waste little on padding.
GENERATE_BATCH = 16


class TargetPass:
    """The target in transformers, fp32, with its tokenizer."""

    def __init__(self, target: Path) -> None:
        self.runner = TargetRunner(target, "float32")
        self.tokenizer = self.runner.tokenizer
        self.model = self.runner.model
        self.eos_id = self.runner.eos_id

    def prompt_ids(self, message: str, chat_template: bool = True) -> list[int]:
        """The tokens the server sees for one user message."""
        text = message
        if chat_template and self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
            )
        return list(self.tokenizer(text)["input_ids"])

    def answers(self, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy answers of tokenised prompts, in their order."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), GENERATE_BATCH):
            group = order[start : start + GENERATE_BATCH]
            answers = self.runner.generate([list(prompts[i]) for i in group], max_new_tokens)
            for i, answer in zip(group, answers, strict=True):
                out[i] = answer
        return out

    @torch.inference_mode()
    def teacher_forced(self, tokens: list[int], prompt_len: int) -> tuple[torch.Tensor, int]:
        """Post-norm final hidden states [len(tokens), hidden] fp32, and how many answer tokens
        the same forward would not pick greedily."""
        ids = torch.tensor([tokens])
        hidden = self.model.model(input_ids=ids).last_hidden_state[0]  # [len, hidden]
        greedy = self.model.lm_head(hidden[prompt_len - 1 : -1]).argmax(-1)  # [answer_len]
        mismatches = int((greedy != torch.tensor(tokens[prompt_len:])).sum())
        return hidden, mismatches
