"""Training and evaluation data: the target's own answers with its hidden states, as shards.

Each shard holds whole conversations (chat template applied, the target's answer appended)
and, for every position, what the drafts learn from, computed by one teacher-forced forward of
the target over the finished sequence:

* ``hidden``: the target's final hidden state *after* its final RMSNorm, the tensor that
  SGLang's ``LlamaForCausalLM`` hands to the logits processor and captures for EAGLE
  (``CaptureHiddenMode``; llama passes no ``hidden_states_before_norm``). fp16 on disk.
* ``target_ids``: the target's greedy next token at that position (argmax of its logits).

Answers are generated greedily in batches with left padding and a KV cache. Evaluation sets
run the target in fp32, its weights' own precision, so their text is the fp32 target's greedy
continuation, and features and labels are exact. Training sets run it with ``bfloat16``
weights by default: on a CPU with AMX that is about 3x faster, and on a 2-core machine data
volume is what limits the drafts (on an AVX2-only CPU bf16 is emulated: ``dtype`` float32
there, 5x faster). The price, measured: bf16 hidden states are within 2.3%
(relative L2) of fp32 ones and the greedy token agrees with fp32's at 98.3% of positions, so a
draft sees slightly noisier features (EAGLE adds noise of that size on purpose) and about 1.7%
of labels that the fp32 target would break the other way.

Resumable: shard ``k`` is written to a temporary file and renamed, then recorded by its own
``shard-k.info.json`` (written atomically, last); a restarted run skips every recorded shard.
``manifest.json`` holds the settings, and a run with other settings refuses the folder. Prompts of
shard ``k`` are a pure function of the seed, ``k`` and already written shards (self-instructed
prompts, follow-ups and passages are harvested from shard ``k - 2``), so a resumed run produces the
same data as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from sglang_adatree.models.prompts import (
    Prompt,
    clean_instruction,
    followup_prompt,
    load_eval_prompts,
    passage_prompt,
    real_prompts,
    seed_prompts,
)

MANIFEST = "manifest.json"
# Passage prompts: answers of at least this many characters, cut to at most the second.
PASSAGE_CHARS = (200, 1600)
# Tokens per teacher-forced micro-batch (padding included): bounds the pass's memory.
TF_TOKENS_PER_BATCH = 4096


@dataclass(frozen=True)
class DatagenConfig:
    """One data set's generation settings; stored in manifest.json and checked on resume."""

    name: str = "train"
    seed: int = 0
    prompts_per_shard: int = 64
    num_meta: int = 8
    num_followup: int = 6
    num_passage: int = 8  # 0 in data sets made before passages existed (train..train-c)
    num_detailed_meta: int = 8  # detailed meta prompts per shard (0 before they existed)
    num_real: int = 4  # real benchmark questions per shard (0 before they existed)
    batch_size: int = 32
    max_new_tokens: int = 320
    meta_max_new_tokens: int = 64
    dtype: str = "bfloat16"  # of the target's weights and compute: float32 for evaluation sets
    eval_set: str | None = None  # mtbench | gsm8k | humaneval: a held-out set instead
    eval_limit: int | None = None


# The value of each later-added setting that data sets made before it were generated with.
LEGACY_DEFAULTS: dict[str, object] = {"num_passage": 0, "num_detailed_meta": 0, "num_real": 0}

# Held-out sets: all 80 MT-bench first turns, the first 40 GSM8K and HumanEval problems.
EVAL_LIMITS: dict[str, int | None] = {"mtbench": None, "gsm8k": 40, "humaneval": 40}


def eval_config(eval_set: str, limit: int | None = None) -> DatagenConfig:
    """The settings of a held-out set's data: fp32, answers of at most 256 tokens."""
    return DatagenConfig(
        name=f"eval-{eval_set}",
        prompts_per_shard=40,
        batch_size=20,
        max_new_tokens=256,
        num_passage=0,
        num_detailed_meta=0,
        num_real=0,
        dtype="float32",
        eval_set=eval_set,
        eval_limit=limit if limit is not None else EVAL_LIMITS[eval_set],
    )


@dataclass(frozen=True)
class ShardInfo:
    """One written shard, as recorded in its info file."""

    index: int
    file: str
    num_seqs: int
    num_tokens: int
    num_response_tokens: int
    seconds: float
    generate_match: float  # share of answer tokens the teacher-forced pass also picks greedily
    device: str = "cpu"  # where the target ran (info files written before this read as cpu)


@dataclass(frozen=True)
class Shard:
    """A loaded shard. Sequences are concatenated; ``offsets`` delimit them."""

    tokens: torch.Tensor  # [num_tokens] int32
    target_ids: torch.Tensor  # [num_tokens] int32, the target's greedy next token
    hidden: torch.Tensor  # [num_tokens, hidden_size] fp16, post-final-norm hidden state
    offsets: torch.Tensor  # [num_seqs + 1] int64
    prompt_lens: torch.Tensor  # [num_seqs] int32, tokens before the answer


def read_manifest(out_dir: Path) -> dict:
    """The data set's config and its finished shards (by index), read from disk."""
    path = out_dir / MANIFEST
    config = json.loads(path.read_text())["config"] if path.is_file() else None
    shards = [json.loads(p.read_text()) for p in sorted(out_dir.glob("shard-*.info.json"))]
    return {"config": config, "shards": sorted(shards, key=lambda s: s["index"])}


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def load_shard(out_dir: Path, info: dict) -> Shard:
    t = load_file(out_dir / info["file"])
    return Shard(t["tokens"], t["target_ids"], t["hidden"], t["offsets"], t["prompt_lens"])


def load_texts(out_dir: Path, index: int) -> list[dict]:
    return json.loads((out_dir / f"shard-{index:05d}.json").read_text())


def _prompts_for_shard(cfg: DatagenConfig, index: int, out_dir: Path) -> list[Prompt] | None:
    """Prompts of shard ``index``, or None when an evaluation set is exhausted."""
    if cfg.eval_set is not None:
        prompts = load_eval_prompts(cfg.eval_set, cfg.eval_limit)
        chunk = prompts[index * cfg.prompts_per_shard : (index + 1) * cfg.prompts_per_shard]
        return chunk or None
    harvested: list[Prompt] = []
    if index >= 2:
        rng = random.Random(f"{cfg.seed}:followup:{index}")
        rows = load_texts(out_dir, index - 2)
        for row in rows:
            if row["kind"] == "meta" and (text := clean_instruction(row["answer"])):
                harvested.append(Prompt("self", (("user", text),)))
        answered = [r for r in rows if r["kind"] in ("templated", "self", "real") and r["finished"]]
        for row in rng.sample(answered, min(cfg.num_followup, len(answered))):
            harvested.append(followup_prompt(rng, row["messages"][-1][1], row["answer"]))
        # Own stream: adding passages left the follow-ups of a seed as they were.
        rng = random.Random(f"{cfg.seed}:passage:{index}")
        texts = [r["answer"] for r in answered if PASSAGE_CHARS[0] <= len(r["answer"])]
        for text in rng.sample(texts, min(cfg.num_passage, len(texts))):
            harvested.append(passage_prompt(rng, _cut(text, PASSAGE_CHARS[1])))
    real = real_prompts(cfg.seed, index, cfg.num_real)
    num_meta = cfg.num_meta + cfg.num_detailed_meta
    num_templated = max(0, cfg.prompts_per_shard - num_meta - len(real) - len(harvested))
    seeded = seed_prompts(cfg.seed, index, num_templated, cfg.num_meta, cfg.num_detailed_meta)
    return seeded + real + harvested


def _cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at a line or sentence end where one is."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind("\n"), head.rfind(". ") + 1)
    return head[:end] if end > limit // 2 else head


# transformers' own SDPA path copies every K/V head 3x (``repeat_kv``, the target has 9 query
# and 3 KV heads) whenever a mask is passed, which left padding always does; on a 2-core CPU
# that copy took 63% of a datagen worker's time. SDPA's ``enable_gqa`` reads the shared heads
# in place (same result: a [64, 9, 1, 64] query over 600 keys differed by 0.0, 14x faster).
GQA_ATTENTION = "adatree_sdpa_gqa"


def _sdpa_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, Lq, D]
    key: torch.Tensor,  # [B, Hkv, Lk, D]
    value: torch.Tensor,  # [B, Hkv, Lk, D]
    attention_mask: torch.Tensor | None,  # [B, 1, Lq, Lk] bool or additive, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    # No mask: a prefill of unpadded rows over an empty cache (Lq == Lk), so causal is exact.
    causal = attention_mask is None and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, is_causal=causal,
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # [B, Lq, Hq, D]


def _register_gqa_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, _sdpa_gqa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_ATTENTION, sdpa_mask)


class TargetRunner:
    """The target in transformers: batched greedy generation and the teacher-forced pass."""

    def __init__(self, target_dir: Path, dtype: str, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        _register_gqa_attention()
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                target_dir, dtype=getattr(torch, dtype), attn_implementation=GQA_ATTENTION
            )
            .to(self.device)
            .eval()
        )
        self.eos_id: int = self.tokenizer.eos_token_id  # <|im_end|>: ends a ChatML turn

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.apply_chat_template(
            prompt.as_chat(), add_generation_prompt=True, tokenize=True, return_dict=False
        )

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy answers (ending with EOS when finished) for a batch of tokenised prompts."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.eos_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every answer starts at column `width`
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=self.eos_id,
            pad_token_id=self.eos_id,
        )
        answers = []
        for row in out[:, width:].tolist():
            end = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            answers.append(row[:end])
        return answers

    @torch.inference_mode()
    def teacher_forced(
        self, seqs: list[list[int]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sequence: post-norm hidden states [len, hidden] fp16 and greedy next ids [len]."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        hidden: list[torch.Tensor | None] = [None] * len(seqs)
        greedy: list[torch.Tensor | None] = [None] * len(seqs)
        start = 0
        while start < len(order):
            stop = start + 1
            while stop < len(order) and len(seqs[order[stop]]) * (stop + 1 - start) <= max(
                TF_TOKENS_PER_BATCH, len(seqs[order[start]])
            ):
                stop += 1
            group = order[start:stop]
            width = len(seqs[group[-1]])
            ids = torch.full((len(group), width), self.eos_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, i in enumerate(group):  # right padding keeps positions 0..len-1
                ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
                mask[row, : len(seqs[i])] = 1
            h = self.model.model(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device)
            ).last_hidden_state
            for row, i in enumerate(group):  # one row at a time: [len, vocab] logits only
                n = len(seqs[i])
                hidden[i] = h[row, :n].to(torch.float16).cpu()
                greedy[i] = self.model.lm_head(h[row, :n]).argmax(-1).to(torch.int32).cpu()
            start = stop
        return hidden, greedy  # type: ignore[return-value]


def _generate_shard(
    runner: TargetRunner, cfg: DatagenConfig, prompts: list[Prompt]
) -> tuple[dict[str, torch.Tensor], list[dict], float]:
    prompt_ids = [runner.prompt_ids(p) for p in prompts]
    answers: list[list[int] | None] = [None] * len(prompts)
    for is_meta in (True, False):
        todo = sorted(
            (i for i, p in enumerate(prompts) if (p.kind == "meta") == is_meta),
            key=lambda i: len(prompt_ids[i]),
        )
        limit = cfg.meta_max_new_tokens if is_meta else cfg.max_new_tokens
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start : start + cfg.batch_size]
            generated = runner.generate([prompt_ids[i] for i in batch], limit)
            for i, answer in zip(batch, generated, strict=True):
                answers[i] = answer
    seqs = [p + a for p, a in zip(prompt_ids, answers, strict=True)]  # type: ignore[operator]
    hidden, greedy = runner.teacher_forced(seqs)
    matches = total = 0
    for p, a, g in zip(prompt_ids, answers, greedy, strict=True):
        # greedy[j] predicts token j + 1: answer tokens are predicted from len(p) - 1 on.
        pred = g[len(p) - 1 : len(p) - 1 + len(a)]  # type: ignore[arg-type]
        matches += int((pred == torch.tensor(a, dtype=torch.int32)).sum())
        total += len(a)  # type: ignore[arg-type]
    offsets = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    tensors = {
        "tokens": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
        "target_ids": torch.cat(greedy),
        "hidden": torch.cat(hidden),
        "offsets": offsets.to(torch.int64),
        "prompt_lens": torch.tensor([len(p) for p in prompt_ids], dtype=torch.int32),
    }
    texts = [
        {
            "kind": p.kind,
            "messages": [list(m) for m in p.messages],
            "answer": runner.tokenizer.decode(a, skip_special_tokens=True),
            "finished": bool(a) and a[-1] == runner.eos_id,
        }
        for p, a in zip(prompts, answers, strict=True)
    ]
    return tensors, texts, matches / max(total, 1)


def run_datagen(
    target_dir: Path,
    out_dir: Path,
    cfg: DatagenConfig,
    max_response_tokens: int | None = None,
    time_budget_s: float | None = None,
    max_shards: int | None = None,
    worker: int = 0,
    num_workers: int = 1,
    log: Callable[[str], None] = print,
    device: str = "cpu",
) -> dict:
    """Generate shards until a budget is reached or the prompt source ends; resumable.

    ``num_workers`` processes (1 or 2) may share one data set, worker ``w`` taking the shard
    indices ``k`` with ``k % num_workers == w``; shard ``k`` harvests prompts from shard
    ``k - 2``, which is then always its own worker's earlier shard. ``device`` is where the
    target runs (``cuda`` on a GPU); each shard's info records it.
    """
    assert num_workers in (1, 2) and 0 <= worker < num_workers, (worker, num_workers)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / MANIFEST
    if config_path.is_file():
        # Settings added later take the value that reproduces data sets made before them.
        stored = {**LEGACY_DEFAULTS, **json.loads(config_path.read_text())["config"]}
        if stored != asdict(cfg):
            raise ValueError(
                f"{out_dir} holds data made with other settings {stored}; "
                "use another --name or delete the folder"
            )
    else:
        _write_json_atomic(config_path, {"config": asdict(cfg)})
    runner = TargetRunner(target_dir, cfg.dtype, device)
    start = time.perf_counter()

    def response_tokens() -> int:
        return sum(s["num_response_tokens"] for s in read_manifest(out_dir)["shards"])

    bar = tqdm(total=max_response_tokens, initial=response_tokens(), unit="tok", desc=cfg.name)
    index = worker
    while True:
        if max_response_tokens is not None and response_tokens() >= max_response_tokens:
            break
        if time_budget_s is not None and time.perf_counter() - start >= time_budget_s:
            log(f"time budget of {time_budget_s:.0f} s reached")
            break
        if max_shards is not None and index >= max_shards:
            break
        name = f"shard-{index:05d}"
        if (out_dir / f"{name}.info.json").is_file():
            index += num_workers
            continue
        prompts = _prompts_for_shard(cfg, index, out_dir)
        if prompts is None:
            break
        t0 = time.perf_counter()
        tensors, texts, match = _generate_shard(runner, cfg, prompts)
        tmp = out_dir / f"{name}.safetensors.tmp"
        save_file(tensors, tmp)
        os.replace(tmp, out_dir / f"{name}.safetensors")
        _write_json_atomic(out_dir / f"{name}.json", texts)  # type: ignore[arg-type]
        num_response = int(tensors["tokens"].numel() - tensors["prompt_lens"].sum())
        info = ShardInfo(
            index,
            f"{name}.safetensors",
            len(prompts),
            int(tensors["tokens"].numel()),
            num_response,
            round(time.perf_counter() - t0, 1),
            round(match, 4),
            runner.device.type,
        )
        # Written last: a shard counts as done only once its info file exists.
        _write_json_atomic(out_dir / f"{name}.info.json", asdict(info))
        bar.update(num_response)
        bar.set_postfix(shard=index, match=f"{match:.3f}")
        index += num_workers
    bar.close()
    return read_manifest(out_dir)
