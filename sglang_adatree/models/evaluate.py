"""How often a draft agrees with the target's greedy tokens, on held-out prompts.

Measured the way SGLang uses each draft, on the target's own fp32 greedy answers:

* EAGLE head, step 1: teacher-forced on the target's hidden states (what the head reads after
  every verify pass). Steps 2..S: the head reads its own previous output and the next token of
  the path, attending to its ancestors (``EagleHead.forward``), with logits restricted to the
  hot vocabulary as served with ``--speculative-token-map``.
* Standalone draft: a token-only model, so its depth-``s`` guess from position ``i`` on the
  target's path is its teacher-forced prediction at ``i + s - 1``.

For every start position the evaluation records the rank of the target's greedy token among
the draft's logits at each depth (``ranks``: ``[positions, depth]``, 0 = the draft's top-1).
Greedy verification accepts a chain while the ranks are 0, and a tree that keeps the top
``k_d`` children at depth ``d`` while ``rank_d < k_d``; emitted tokens = accepted + 1 bonus.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_adatree.models import breakeven, eagle, standalone
from sglang_adatree.models.data import SequenceSet, batches, load_sequences, make_batch
from sglang_adatree.models.paths import EAGLE_NAME, STANDALONE_NAME, ModelPaths, shipped_weights

NOT_RANKED = 1 << 30  # the target's token is outside the draft's (hot) vocabulary
CHAIN_DEPTHS = (1, 2, 3, 4, 5)
# Per-depth branching of a few static trees: (topk at depth 1, at depth 2, ...).
TREES = ((2, 1), (4, 1), (2, 2), (2, 2, 1), (4, 1, 1), (4, 2, 1), (2, 2, 2, 1))


@dataclass(frozen=True)
class Agreement:
    """Agreement figures of one draft on one data set."""

    data: str
    num_positions: int
    top1: float  # depth 1: the draft's top-1 is the target's greedy token
    top4: float
    conditional_top1: tuple[float, ...]  # depth s, given depths < s were all top-1
    chain_emitted: dict[int, float]  # chain depth -> expected emitted tokens per verify step
    tree_emitted: dict[str, float]  # "4-2-1" -> expected emitted tokens per verify step


def token_ranks(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Rank of each label among its row of logits (0 = argmax); NOT_RANKED for label -1.

    logits: [N, V], labels: [N] (an index into V, or -1). Ties count in the label's favour.
    """
    assert logits.ndim == 2 and labels.shape == logits.shape[:1], (logits.shape, labels.shape)
    picked = logits.gather(1, labels.clamp(min=0)[:, None])  # [N, 1]
    ranks = (logits > picked).sum(1)
    return torch.where(labels >= 0, ranks, torch.full_like(ranks, NOT_RANKED))


def emitted_tokens(ranks: torch.Tensor, branching: tuple[int, ...]) -> float:
    """Mean emitted tokens of a tree keeping ``branching[d]`` children at depth d.

    ranks: [positions, depth >= len(branching)]. A chain is branching (1, 1, ...).
    """
    assert ranks.ndim == 2 and ranks.shape[1] >= len(branching), (ranks.shape, branching)
    inside = ranks[:, : len(branching)] < torch.tensor(branching)  # [P, D]
    accepted = inside.int().cumprod(dim=1).sum(dim=1)  # leading depths on the target's path
    return float(accepted.float().mean()) + 1.0


def summarize(name: str, ranks: torch.Tensor) -> Agreement:
    """Figures from a ranks matrix [positions, depth]."""
    depth = ranks.shape[1]
    top1 = ranks == 0
    cond = []
    for s in range(depth):
        given = top1[:, :s].all(dim=1)
        cond.append(float(top1[given, s].float().mean()) if given.any() else 0.0)
    chains = {d: emitted_tokens(ranks, (1,) * d) for d in CHAIN_DEPTHS if d <= depth}
    trees = {"-".join(map(str, t)): emitted_tokens(ranks, t) for t in TREES if len(t) <= depth}
    return Agreement(
        name,
        int(ranks.shape[0]),
        float(top1[:, 0].float().mean()),
        float((ranks[:, 0] < 4).float().mean()),
        tuple(cond),
        chains,
        trees,
    )


@torch.no_grad()
def eagle_ranks(
    head: eagle.EagleHead,
    embed: torch.Tensor,  # [vocab, H]
    hot_ids: torch.Tensor | None,  # [V_hot]
    data: SequenceSet,
    depth: int,
) -> torch.Tensor:
    """[positions, depth] ranks of the target's greedy tokens along its own path."""
    w = embed if hot_ids is None else embed[hot_ids]  # [V, H] lm_head as served
    index = torch.arange(embed.shape[0])
    if hot_ids is not None:
        index = torch.full((embed.shape[0],), -1, dtype=torch.long)
        index[hot_ids] = torch.arange(hot_ids.numel())
    out = []
    for seqs in batches(data, 4096, seed=None):
        batch = make_batch(data, seqs)
        shifted = [torch.zeros_like(batch.tokens) for _ in range(depth)]
        labels = [torch.zeros_like(batch.tokens) for _ in range(depth)]
        for s in range(1, depth + 1):
            shifted[s - 1][:, :-s] = batch.tokens[:, s:]
            labels[s - 1][:, :-s] = batch.target_ids[:, s:]
        key_valid = batch.positions() <= (batch.lengths - 2)[:, None]
        hidden = batch.hidden.float()
        outs = head(embed, torch.stack(shifted), hidden, batch.positions(), key_valid)
        # The first guess is an answer token after P and the deepest one is inside the answer.
        mask = batch.predicts_answer(2) & batch.predicts_answer(depth + 1)
        ranks = [token_ranks(outs[s][mask] @ w.T, index[labels[s][mask]]) for s in range(depth)]
        out.append(torch.stack(ranks, dim=1))
    return torch.cat(out)


@torch.no_grad()
def standalone_ranks(model: torch.nn.Module, data: SequenceSet, depth: int) -> torch.Tensor:
    """[positions, depth] ranks: depth s from position i is the prediction at i + s - 1."""
    out = []
    for seqs in batches(data, 1024, seed=None):  # [tokens, vocab] logits: keep batches small
        batch = make_batch(data, seqs)
        valid = batch.positions() < batch.lengths[:, None]
        logits = model(input_ids=batch.tokens, attention_mask=valid.long()).logits  # [B, L, V]
        flat = token_ranks(logits.flatten(0, 1), batch.target_ids.flatten()).view_as(valid)
        mask = batch.predicts_answer(1) & batch.predicts_answer(depth)
        per_depth = []
        for s in range(depth):
            r = torch.full_like(flat, NOT_RANKED)
            r[:, : flat.shape[1] - s] = flat[:, s:]
            per_depth.append(r[mask])
        out.append(torch.stack(per_depth, dim=1))
    return torch.cat(out)


def evaluate_draft(
    paths: ModelPaths, draft: str, data_names: list[str], weights: Path | None, depth: int
) -> list[Agreement]:
    """Agreement of a draft (shipped weights unless ``weights``) on each data set."""
    from safetensors.torch import load_file

    results = []
    if draft == "eagle":
        head, hot_ids = eagle.load(weights or shipped_weights(EAGLE_NAME))
        embed = load_file(paths.target_dir / "model.safetensors")[standalone.EMBED_KEY].float()
    else:
        model = standalone.load(weights or shipped_weights(STANDALONE_NAME), paths.target_dir)
    for name in data_names:
        data = load_sequences([paths.datagen_dir(name)])
        if draft == "eagle":
            ranks = eagle_ranks(head, embed, hot_ids, data, depth)
        else:
            ranks = standalone_ranks(model, data, depth)
        results.append(summarize(name, ranks))
    return results


def served_profile(args: argparse.Namespace, paths: ModelPaths) -> breakeven.ServedSteps | None:
    """The ``--served`` profile, checked before the evaluation's long pass; None without it.

    Raises ValueError for a profile that cannot describe this card's draft."""
    if not getattr(args, "served", None):
        return None
    if not args.card:
        raise ValueError("--served adds served step times to the model card: use it with --card")
    if args.weights:
        raise ValueError("--served profiles the bundled draft's server: not with --weights")
    served = breakeven.load_served(Path(args.served))
    expected = paths.eagle_dir if args.draft == "eagle" else paths.standalone_dir
    if Path(served.draft).name != expected.name:
        raise ValueError(
            f"{args.served} profiled the draft {served.draft}, not the bundled {args.draft} "
            f"draft ({expected}): run `adatree profile --draft {args.draft} ...`"
        )
    return served


def evaluate_command(args: argparse.Namespace, paths: ModelPaths) -> int:
    weights = Path(args.weights) if args.weights else None
    try:
        served = served_profile(args, paths)
    except ValueError as exc:
        print(f"adatree models evaluate: {exc}")
        return 2
    results = evaluate_draft(paths, args.draft, args.data, weights, args.steps)
    for r in results:
        cond = ", ".join(f"{c:.2f}" for c in r.conditional_top1)
        chains = ", ".join(f"{d}: {e:.2f}" for d, e in r.chain_emitted.items())
        print(
            f"{args.draft} on {r.data} ({r.num_positions} positions): "
            f"top-1 agreement: {r.top1:.2f}, top-4 agreement: {r.top4:.2f}; "
            f"per-step top-1 given earlier steps right: {cond}; "
            f"emitted tokens per chain depth: {chains}"
        )
    figures: dict = {"agreement": [asdict(r) for r in results]}
    if args.card:
        figures.update(_write_card(args, paths, weights, results, served))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


def _write_card(
    args: argparse.Namespace,
    paths: ModelPaths,
    weights: Path | None,
    results: list[Agreement],
    served: breakeven.ServedSteps | None = None,
) -> dict:
    """Time the passes, compute where speculation pays and write MODEL_CARD.md."""
    from sglang_adatree.models import card

    name = EAGLE_NAME if args.draft == "eagle" else STANDALONE_NAME
    folder = weights or shipped_weights(name)
    _, hot_ids = eagle.load(shipped_weights(EAGLE_NAME))
    model = standalone.load(shipped_weights(STANDALONE_NAME), paths.target_dir)
    hot_vocab = int(hot_ids.numel()) if hot_ids is not None else model.config.vocab_size
    times = breakeven.measure_pass_times(paths.target_dir, model, hot_vocab)
    headline = next(r for r in results if r.data == card.HEADLINE_SET)
    gains = breakeven.shape_gains(times, args.draft, headline.chain_emitted, headline.tree_emitted)
    for g in gains:
        print(f"{g.name}: emitted {g.emitted:.2f}, step {g.step_ms:.1f} ms, {g.speedup:.2f}x")
    served_gains: list[breakeven.ShapeGain] = []
    if served is not None:
        served_gains = breakeven.served_gains(served, list(headline.chain_emitted))
        for g in served_gains:
            print(
                f"served {g.name}: emitted {g.emitted:.2f}, step {g.step_ms:.1f} ms, "
                f"{g.speedup:.2f}x"
            )
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    extra = {
        "hot_vocab": hot_vocab,
        "num_params": sum(t.numel() for t in tensors.values()),
        "file_mb": (folder / "model.safetensors").stat().st_size / 1e6,
    }
    training = json.loads((folder / "training.json").read_text())
    command = (
        f"adatree models evaluate {args.draft} --data {' '.join(args.data)} "
        f"--steps {args.steps} --card"
    )
    if served is not None:
        command += f" --served {Path(args.served).name}"
    title = f"{name}: {'EAGLE head' if args.draft == 'eagle' else 'standalone draft'}"
    figures = {"pass_times": asdict(times), "gains": [asdict(g) for g in gains]}
    section = None
    if served is not None:
        figures["served"] = {**asdict(served), "gains": [asdict(g) for g in served_gains]}
        section = card.ServedSection(served, served_gains, Path(args.served).name)
    text = card.render(args.draft, title, training, results, times, gains, command, extra, section)
    card.write(folder, text, {"agreement": [asdict(r) for r in results], **figures})
    print(f"wrote {folder / 'MODEL_CARD.md'}")
    return figures
