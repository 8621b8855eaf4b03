"""Train either draft on generated data: bf16 autocast (or fp32), time-budgeted, resumable.

Both drafts learn the target's *distribution*, not only its greedy token: the loss is the
cross-entropy against ``softmax(lm_head(f))`` where ``f`` is the target's stored hidden state
at the predicted position (self-distillation, as EAGLE trains), cut to its ``teacher_top_k``
most likely tokens and renormalised. The EAGLE head adds EAGLE's
feature regression (smooth L1 to ``f``), which keeps its own output usable as the next step's
input, and trains ``steps`` unrolled draft steps at once (``eagle.EagleHead.forward``).

The EAGLE head's logits cover only the hot vocabulary (the most frequent target tokens of the
training data), exactly as SGLang serves it with ``--speculative-token-map``; the standalone
draft's cover the whole vocabulary, since SGLang's STANDALONE path has no token map.

A checkpoint (weights, optimizer, step, elapsed time) is written every few minutes and at the
end; a restarted run resumes from it. The best checkpoint by validation top-1 agreement (a
held-out slice of the training data, never the evaluation sets) is what gets exported.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from sglang_adatree.models import eagle, standalone
from sglang_adatree.models.data import (
    Batch,
    SequenceSet,
    batches,
    load_sequences,
    make_batch,
    split_validation,
)
from sglang_adatree.models.datagen import LEGACY_DEFAULTS, read_manifest
from sglang_adatree.models.paths import EAGLE_NAME, STANDALONE_NAME, ModelPaths, shipped_weights

CHECKPOINT_EVERY_S = 600.0
CPU = torch.device("cpu")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of one run; stored with its checkpoints."""

    draft: str  # eagle | standalone
    data: tuple[str, ...] = ("train",)  # data sets under <home>/datagen/, in this order
    # a weights folder (as ``export_best`` writes it) to start from instead of the usual start;
    # its training.json becomes the summary's "init", so a card can name the whole lineage
    init_from: str | None = None
    seed: int = 0
    epochs: float = 4.0
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.0
    tokens_per_batch: int = 4096
    steps: int = 3  # eagle: unrolled draft steps
    step_decay: float = 0.7  # eagle: loss weight of step s is step_decay ** (s - 1)
    reg_weight: float = 1.0  # eagle: smooth L1 to the target's hidden state
    input_noise: float = 0.05  # eagle: uniform noise on the target hidden state (augmentation)
    hot_vocab: int = 16384  # eagle: size of the token map
    teacher_top_k: int = 32  # the loss's teacher: the target's k most likely next tokens
    # eagle: target layer the head's layer starts from, or None for a random start (layer 29's
    # MLP writes outputs of norm ~540 onto the head's residual stream: the loss explodes)
    init_layer: int | None = None
    source_layers: tuple[int, ...] = (0, 29)  # standalone: target layers it starts from
    val_every: int = 200
    # compute precision: bf16 autocast (fast with AMX or on a GPU), or float32 (no autocast):
    # on an AVX2-only CPU bf16 is emulated and a bf16 matmul took 7x an fp32 one
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class Losses:
    """One batch's scalar results: loss, and top-1 agreement per draft step."""

    loss: torch.Tensor
    agreement: tuple[float, ...]
    counts: tuple[int, ...]


def hot_token_ids(data: SequenceSet, size: int, vocab_size: int) -> torch.Tensor:
    """The token map: every greedy target token of the data (most frequent first, if there
    are more than ``size``), then the lowest ids up to ``size``; ascending ids.

    The training data alone is too narrow for held-out prompts (one 13k-token shard held 1.4k
    distinct tokens and covered 74% of MT-bench answer tokens). A byte-level BPE numbers its
    merges in the order it learned them, so low ids are the tokenizer corpus's frequent tokens:
    the first 16k ids alone cover 96% of MT-bench answer tokens.
    """
    counts = torch.bincount(data.answer_labels(), minlength=vocab_size).float()
    # Seen tokens rank by count; unseen ones after them, by id (a tiny decreasing bonus).
    score = counts + (counts == 0) * (1.0 - torch.arange(vocab_size) / vocab_size) * 0.5
    return torch.topk(score, min(size, vocab_size)).indices.sort().values


def _teacher_top(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` most likely tokens and their probabilities renormalised over them:
    ([N, k] float32, [N, k] int64). No gradient."""
    with torch.no_grad():
        values, index = teacher_logits.topk(min(k, teacher_logits.shape[-1]), dim=-1)
        return torch.softmax(values.float(), dim=-1), index


def _top_ce(logits: torch.Tensor, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [N, V] against the sparse teacher (probs, index) [N, k].

    ``-sum_k p_k log q_k`` with ``log q`` from one fused log-softmax in the logits' own dtype
    (bf16 under autocast; the CPU kernel accumulates in fp32), gathered at the teacher's k
    tokens. Passes over [N, V] are most of a training step here, not the matmuls: against
    ``logsumexp`` over an fp32 copy (a copy, a subtraction, an exp, then the same again and two
    casts in the backward), one unembedding, loss and backward of 3600 x 16384 took 1.7 s
    instead of 2.7 s on one thread (median of 4), with the gradient within 0.35% of an fp64
    one (0.30% before; the bf16 matmul dominates both). A dense fp32 teacher, its
    log-softmax and their product took about a quarter of a step before the sparse teacher:
    the top 32 of SmolLM2's next-token distribution hold 95% of its mass on average (83% at
    the 10th percentile; its own answers).
    """
    log_q = torch.log_softmax(logits, dim=-1)  # [N, V]
    return -(probs * log_q.gather(1, index).float()).sum(-1).mean()


def _agreement(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of rows whose label holds the top logit (label -1: a miss). ``amax`` and a gather
    rather than ``argmax``, which is ten times slower on bf16 here; a tie counts as a hit."""
    with torch.no_grad():
        own = logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]
        hit = (own >= logits.amax(-1)) & (labels >= 0)
        return float(hit.float().mean()) if hit.numel() else 0.0


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, i + s] at position i (zero beyond the end). x: [B, L, ...]."""
    out = torch.zeros_like(x)
    out[:, : x.shape[1] - s] = x[:, s:]
    return out


class EagleTask:
    """Loss and agreement of the EAGLE head on one batch."""

    def __init__(
        self,
        cfg: TrainConfig,
        target_state: dict,
        hot_ids: torch.Tensor,
        device: torch.device = CPU,
    ) -> None:
        self.cfg = cfg
        self.embed = target_state[standalone.EMBED_KEY].to(device)  # [vocab, H], frozen
        self.hot_ids = hot_ids  # [V_hot]
        self.w_hot = self.embed[hot_ids.to(device)]  # [V_hot, H]: lm_head rows SGLang keeps
        hot_index = torch.full((self.embed.shape[0],), -1, dtype=torch.long)
        hot_index[hot_ids] = torch.arange(hot_ids.numel())
        self.hot_index = hot_index.to(device)  # [vocab]

    def __call__(self, head: eagle.EagleHead, batch: Batch, train: bool) -> Losses:
        cfg = self.cfg
        hidden = batch.hidden.float()  # [B, L, H]
        step_tokens = torch.stack([_shift(batch.tokens, s) for s in range(1, cfg.steps + 1)])
        key_valid = batch.positions() <= (batch.lengths - 2)[:, None]
        x_in = hidden
        if train and cfg.input_noise > 0:
            x_in = hidden + (torch.rand_like(hidden) * 2 - 1) * cfg.input_noise
        out = head(self.embed, step_tokens, x_in, batch.positions(), key_valid)  # [S, B, L, H]
        # The teacher at position j serves every step whose label sits at j: compute it once.
        pos = batch.positions()
        labelled = (pos >= batch.prompt_lens[:, None]) & (pos <= (batch.lengths - 2)[:, None])
        row = torch.full_like(pos, -1)
        row[labelled] = torch.arange(int(labelled.sum()), device=pos.device)
        probs, index = _teacher_top(hidden[labelled] @ self.w_hot.T, cfg.teacher_top_k)
        total = torch.zeros((), device=hidden.device)
        agreement, counts = [], []
        for s in range(1, cfg.steps + 1):
            mask = batch.predicts_answer(s + 1)  # position i predicts token i + s + 1
            h = out[s - 1][mask]  # [N, H]
            feat = _shift(hidden, s)[mask]  # target hidden state f_{i+s}
            labels = self.hot_index[_shift(batch.target_ids, s)[mask]]  # [N], -1 if not hot
            logits = h @ self.w_hot.T  # [N, V_hot]
            rows = _shift(row, s)[mask]  # [N]: the target's distribution at the label
            ce = _top_ce(logits, probs[rows], index[rows])
            loss = ce + cfg.reg_weight * F.smooth_l1_loss(h.float(), feat)
            total = total + cfg.step_decay ** (s - 1) * loss
            agreement.append(_agreement(logits, labels))
            counts.append(int(mask.sum()))
        return Losses(total, tuple(agreement), tuple(counts))


class StandaloneTask:
    """Loss and agreement of the standalone draft on one batch (full vocabulary)."""

    def __init__(self, cfg: TrainConfig, target_state: dict, device: torch.device = CPU) -> None:
        self.cfg = cfg
        self.embed = target_state[standalone.EMBED_KEY].to(device)  # [vocab, H], tied lm_head

    def __call__(self, model: torch.nn.Module, batch: Batch, train: bool) -> Losses:
        valid = batch.positions() < batch.lengths[:, None]
        h = model.model(input_ids=batch.tokens, attention_mask=valid.long()).last_hidden_state
        mask = batch.predicts_answer(1)
        logits = h[mask] @ self.embed.T  # [N, vocab]
        teacher = batch.hidden[mask].float() @ self.embed.T  # [N, vocab]
        probs, index = _teacher_top(teacher, self.cfg.teacher_top_k)
        loss = _top_ce(logits, probs, index)
        agree = _agreement(logits, batch.target_ids[mask])
        return Losses(loss, (agree,), (int(mask.sum()),))


def _lr(cfg: TrainConfig, step: int, total_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return cfg.lr * (
        cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


@torch.no_grad()
def validate(
    model: torch.nn.Module,
    task,
    data: SequenceSet,
    tokens_per_batch: int,
    device: torch.device = CPU,
    autocast: bool = True,
) -> list[float]:
    """Top-1 agreement per draft step over a whole data set (teacher-forced; bf16 autocast
    unless ``autocast`` is off)."""
    model.eval()
    hits: list[float] = []
    counts: list[int] = []
    for seqs in batches(data, tokens_per_batch, seed=None):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            res = task(model, make_batch(data, seqs).to(device), train=False)
        if not hits:
            hits, counts = [0.0] * len(res.counts), [0] * len(res.counts)
        for s, (a, c) in enumerate(zip(res.agreement, res.counts, strict=True)):
            hits[s] += a * c
            counts[s] += c
    model.train()
    return [h / max(c, 1) for h, c in zip(hits, counts, strict=True)]


def _init_weights(
    model: torch.nn.Module, draft: str, folder: Path, target_dir: Path
) -> dict | None:
    """Load a draft's exported weights into ``model``; return that folder's training summary.

    The EAGLE head's token map is not taken over: the head's layers compute a hidden state of
    the target's, whatever rows of the lm_head are kept, so the map is rebuilt from the data.
    """
    if not folder.is_dir():
        raise FileNotFoundError(f"--init-from {folder}: no such weights folder")
    if draft == "eagle":
        head, _ = eagle.load(folder)
        model.load_state_dict(head.state_dict())
    else:
        model.load_state_dict(standalone.load(folder, target_dir).state_dict())
    summary = folder / "training.json"
    return json.loads(summary.read_text()) if summary.is_file() else None


def train(
    cfg: TrainConfig,
    paths: ModelPaths,
    time_budget_s: float,
    max_answer_tokens: int | None = None,
    device: str = "cpu",
) -> dict:
    """Train one draft; return a summary. Resumes from ``<home>/train/<draft>/last.pt``.

    ``device`` is where the draft and each batch live (``cuda`` on a GPU); the data stays in
    CPU memory and batches are cut there. A run may resume on another device than it began.
    """
    dev = torch.device(device)
    torch.manual_seed(cfg.seed)
    out_dir = paths.train_dir(cfg.draft)
    out_dir.mkdir(parents=True, exist_ok=True)
    data_names = list(cfg.data)
    data = load_sequences([paths.datagen_dir(n) for n in data_names], max_answer_tokens)
    train_set, val_set = split_validation(data)
    target_state = load_file(paths.target_dir / "model.safetensors")
    if cfg.draft == "eagle":
        hot_ids = hot_token_ids(
            train_set, cfg.hot_vocab, target_state[standalone.EMBED_KEY].shape[0]
        )
        target_config = json.loads((paths.target_dir / "config.json").read_text())
        model = eagle.EagleHead(eagle.HeadConfig.from_target(target_config))
        if cfg.init_layer is not None:
            model.init_from_target(target_state, cfg.init_layer)
        task = EagleTask(cfg, target_state, hot_ids, dev)
    else:
        hot_ids = None
        model = standalone.build_draft(paths.target_dir, cfg.source_layers)
        task = StandaloneTask(cfg, target_state, dev)
    init = None
    if cfg.init_from:
        init = _init_weights(model, cfg.draft, Path(cfg.init_from), paths.target_dir)
    model.to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    per_epoch = sum(1 for _ in batches(train_set, cfg.tokens_per_batch, seed=None))
    total_steps = max(1, int(per_epoch * cfg.epochs))
    state = {"step": 0, "elapsed": 0.0, "best": -1.0, "history": []}
    last = out_dir / "last.pt"
    if last.is_file():
        ckpt = torch.load(last, weights_only=False, map_location=dev)
        if ckpt["config"] == asdict(cfg):
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            state = ckpt["state"]
    model.train()
    start = time.perf_counter() - state["elapsed"]
    last_save = time.perf_counter()

    def save(name: str) -> None:
        state["elapsed"] = time.perf_counter() - start
        torch.save(
            {
                "config": asdict(cfg),
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "state": state,
                "hot_ids": hot_ids,
            },
            out_dir / name,
        )

    bar = tqdm(total=total_steps, initial=state["step"], desc=f"train {cfg.draft}", unit="batch")
    stop = False
    while not stop and state["step"] < total_steps:
        epoch = state["step"] // per_epoch
        order = list(batches(train_set, cfg.tokens_per_batch, seed=cfg.seed * 1000 + epoch))
        for seqs in order[state["step"] % per_epoch :]:
            for group in opt.param_groups:
                group["lr"] = _lr(cfg, state["step"], total_steps)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
                res = task(model, make_batch(train_set, seqs).to(dev), train=True)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state["step"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{res.loss.item():.3f}", top1=f"{res.agreement[0]:.3f}")
            if state["step"] % cfg.val_every == 0 or state["step"] == total_steps:
                val = validate(
                    model, task, val_set, cfg.tokens_per_batch, dev, cfg.dtype == "bfloat16"
                )
                state["history"].append(
                    {
                        "step": state["step"],
                        "elapsed_s": round(time.perf_counter() - start),
                        "val_top1": [round(v, 4) for v in val],
                    }
                )
                tqdm.write(json.dumps(state["history"][-1]))
                if val[0] > state["best"]:
                    state["best"] = val[0]
                    save("best.pt")
            if time.perf_counter() - last_save > CHECKPOINT_EVERY_S:
                save("last.pt")
                last_save = time.perf_counter()
            if time.perf_counter() - start > time_budget_s or state["step"] >= total_steps:
                stop = True
                break
    bar.close()
    save("last.pt")
    manifests = [read_manifest(paths.datagen_dir(n)) for n in data_names]
    shards = [s for m in manifests for s in m["shards"]]
    data_cfgs = [m["config"] for m in manifests]
    # Where each set's target ran (shard infos written before devices were recorded: the CPU).
    devices = [sorted({s.get("device", "cpu") for s in m["shards"]}) for m in manifests]
    return {
        "draft": cfg.draft,
        "data": {
            "names": data_names,
            "sequences": data.num_seqs,
            "answer_tokens": data.num_answer_tokens,
            "hours": round(sum(s["seconds"] for s in shards) / 3600, 2),
            "max_new_tokens": max(c["max_new_tokens"] for c in data_cfgs),
            "sets": [
                {
                    **{k: c[k] for k in ("name", "seed", "batch_size", "max_new_tokens", "dtype")},
                    **{k: c.get(k, LEGACY_DEFAULTS[k]) for k in LEGACY_DEFAULTS},
                    "devices": d,
                }
                for c, d in zip(data_cfgs, devices, strict=True)
            ],
        },
        "init": init,
        "device": dev.type,
        "steps": state["step"],
        "train_seconds": round(state["elapsed"]),
        "train_answer_tokens": train_set.num_answer_tokens,
        "val_answer_tokens": val_set.num_answer_tokens,
        "best_val_top1": state["best"],
        "history": state["history"],
        "config": asdict(cfg),
    }


def export_best(paths: ModelPaths, draft: str, summary: dict) -> Path:
    """Write the shipped weights folder from ``best.pt`` (and the training summary)."""
    ckpt = torch.load(paths.train_dir(draft) / "best.pt", weights_only=False, map_location="cpu")
    cfg = config_from_dict(ckpt["config"])
    target_config = json.loads((paths.target_dir / "config.json").read_text())
    if draft == "eagle":
        out_dir = shipped_weights(EAGLE_NAME)
        head = eagle.EagleHead(eagle.HeadConfig.from_target(target_config))
        head.load_state_dict(ckpt["model"])
        eagle.export(head, ckpt["hot_ids"], target_config, out_dir)
    else:
        out_dir = shipped_weights(STANDALONE_NAME)
        model = standalone.build_draft(paths.target_dir, cfg.source_layers)
        model.load_state_dict(ckpt["model"])
        standalone.export_trained(model, paths.target_dir, out_dir)
    (out_dir / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return out_dir


def config_from_dict(stored: dict) -> TrainConfig:
    """A config back from its ``asdict`` form (checkpoints and JSON hold lists, not tuples)."""
    tuples = {k: tuple(stored[k]) for k in ("data", "source_layers") if k in stored}
    return TrainConfig(**{**stored, **tuples})


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The training config of an ``adatree models train`` call."""
    return TrainConfig(
        draft=args.draft,
        data=tuple(args.data),
        init_from=args.init_from,
        seed=args.seed,
        epochs=args.epochs,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        tokens_per_batch=args.tokens_per_batch,
        steps=args.unroll,
        val_every=args.val_every,
        dtype=args.dtype,
    )


def train_command(args: argparse.Namespace, paths: ModelPaths) -> int:
    cfg = config_from_args(args)
    summary = train(cfg, paths, args.time_budget_min * 60, args.tokens, args.device)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}))
    if args.export:
        print(f"exported to {export_best(paths, args.draft, summary)}")
    return 0
