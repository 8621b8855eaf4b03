"""Generated data in memory: concatenated sequences and padded batches for the drafts.

Index conventions (``n`` tokens in a sequence, ``P`` of them the prompt):

* ``target_ids[j]`` is the target's greedy token after position ``j``, so the answer is
  ``tokens[P:]`` and ``target_ids[P-1:n-1]`` are the target's predictions of it.
* A draft's first real prediction is token ``P + 1``: the target itself emits token ``P`` when
  it finishes the prompt, and drafting starts from there. Positions that predict tokens before
  ``P + 1`` are context only: they carry no loss and do not count in agreement.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_adatree.models.datagen import load_shard, read_manifest


@dataclass(frozen=True)
class SequenceSet:
    """All sequences of one or more generated data sets, concatenated."""

    tokens: torch.Tensor  # [num_tokens] int64
    target_ids: torch.Tensor  # [num_tokens] int64
    hidden: torch.Tensor  # [num_tokens, hidden_size] fp16
    starts: torch.Tensor  # [num_seqs] int64, first token of each sequence
    lengths: torch.Tensor  # [num_seqs] int64
    prompt_lens: torch.Tensor  # [num_seqs] int64

    @property
    def num_seqs(self) -> int:
        return int(self.lengths.numel())

    @property
    def num_answer_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens).sum())

    def answer_labels(self) -> torch.Tensor:
        """[num_answer_tokens] the target's greedy predictions of the answer tokens."""
        spans = zip(
            self.starts.tolist(), self.lengths.tolist(), self.prompt_lens.tolist(), strict=True
        )
        return torch.cat([self.target_ids[s + p - 1 : s + n - 1] for s, n, p in spans])

    def subset(self, seqs: list[int]) -> SequenceSet:
        """The chosen sequences only (their token rows stay shared, no copy)."""
        index = torch.tensor(seqs, dtype=torch.long)
        return SequenceSet(
            self.tokens,
            self.target_ids,
            self.hidden,
            self.starts[index],
            self.lengths[index],
            self.prompt_lens[index],
        )


def load_sequences(data_dirs: list[Path], max_answer_tokens: int | None = None) -> SequenceSet:
    """Load every shard of the given data sets (in manifest order), up to a token budget."""
    tokens, target_ids, hidden, starts, lengths, prompt_lens = [], [], [], [], [], []
    base = answer = 0
    for data_dir in data_dirs:
        shards = sorted(read_manifest(data_dir)["shards"], key=lambda s: s["index"])
        if not shards:
            raise FileNotFoundError(f"no generated shards in {data_dir}")
        for info in shards:
            if max_answer_tokens is not None and answer >= max_answer_tokens:
                break
            shard = load_shard(data_dir, info)
            tokens.append(shard.tokens.long())
            target_ids.append(shard.target_ids.long())
            hidden.append(shard.hidden)
            offsets = shard.offsets.long()
            starts.append(offsets[:-1] + base)
            lengths.append(offsets[1:] - offsets[:-1])
            prompt_lens.append(shard.prompt_lens.long())
            base += int(offsets[-1])
            answer += info["num_response_tokens"]
    return SequenceSet(
        torch.cat(tokens),
        torch.cat(target_ids),
        torch.cat(hidden),
        torch.cat(starts),
        torch.cat(lengths),
        torch.cat(prompt_lens),
    )


def split_validation(data: SequenceSet) -> tuple[SequenceSet, SequenceSet]:
    """Every 50th sequence for validation (every 20th of a small set, the last one of a set
    under 20), the rest for training."""
    if data.num_seqs < 2:
        raise ValueError(f"{data.num_seqs} sequence(s): too few to hold one out for validation")
    every = 50 if data.num_seqs >= 500 else 20
    val = list(range(every - 1, data.num_seqs, every)) or [data.num_seqs - 1]
    held = set(val)
    return data.subset([i for i in range(data.num_seqs) if i not in held]), data.subset(val)


@dataclass(frozen=True)
class Batch:
    """Right-padded sequences. Padding rows repeat token 0 and are masked out."""

    tokens: torch.Tensor  # [B, L] int64
    target_ids: torch.Tensor  # [B, L] int64
    hidden: torch.Tensor  # [B, L, hidden_size] fp16
    lengths: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64

    def to(self, device: torch.device) -> Batch:
        """The same batch on ``device`` (batches are cut on the CPU, trained on anywhere)."""
        return Batch(
            *(t.to(device, non_blocking=True) for t in (self.tokens, self.target_ids, self.hidden)),
            self.lengths.to(device),
            self.prompt_lens.to(device),
        )

    def positions(self) -> torch.Tensor:
        batch, length = self.tokens.shape
        return torch.arange(length, device=self.tokens.device).expand(batch, length)

    def predicts_answer(self, offset: int) -> torch.Tensor:
        """[B, L] bool: position ``i`` predicts token ``i + offset``, an answer token after P
        whose target label ``target_ids[i + offset - 1]`` lies inside the sequence."""
        pos = self.positions() + offset
        return (pos >= (self.prompt_lens + 1)[:, None]) & (pos <= (self.lengths - 1)[:, None])


def make_batch(data: SequenceSet, seqs: list[int]) -> Batch:
    lengths = data.lengths[seqs]
    width = int(lengths.max())
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    target_ids = torch.zeros(len(seqs), width, dtype=torch.long)
    hidden = torch.zeros(len(seqs), width, data.hidden.shape[1], dtype=data.hidden.dtype)
    for row, i in enumerate(seqs):
        start, n = int(data.starts[i]), int(data.lengths[i])
        tokens[row, :n] = data.tokens[start : start + n]
        target_ids[row, :n] = data.target_ids[start : start + n]
        hidden[row, :n] = data.hidden[start : start + n]
    return Batch(tokens, target_ids, hidden, lengths, data.prompt_lens[seqs])


def batches(data: SequenceSet, tokens_per_batch: int, seed: int | None) -> Iterator[list[int]]:
    """Sequence index lists of similar length (little padding), in shuffled order if seeded."""
    order = sorted(range(data.num_seqs), key=lambda i: int(data.lengths[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and int(data.lengths[i]) * (len(current) + 1) > tokens_per_batch:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    if seed is not None:
        random.Random(seed).shuffle(groups)
    yield from groups
