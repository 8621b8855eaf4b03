"""MODEL_CARD.md of a shipped draft, written from measured figures only.

``adatree models evaluate DRAFT --card`` measures agreement on the held-out sets and pass
times on this machine, then renders the card from those figures and the training summary
(``training.json`` beside the weights), so every number in a card has a command behind it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sglang_adatree.models import prompts
from sglang_adatree.models.breakeven import NO_SPEC_KEY, PassTimes, ServedSteps, ShapeGain
from sglang_adatree.models.datagen import LEGACY_DEFAULTS
from sglang_adatree.models.evaluate import Agreement

HEADLINE_SET = "eval-mtbench"


@dataclass(frozen=True)
class ServedSection:
    """The card's served figures: a profile, the chains it measured, the file it came from."""

    steps: ServedSteps
    gains: list[ShapeGain]
    file: str


ARCHITECTURE = {
    "eagle": (
        "An EAGLE head in the checkpoint format of SGLang 0.5.23's `LlamaForCausalLMEagle`: "
        "`fc` (Linear 1152 -> 576, with bias) over [token embedding; target hidden state], then "
        "one Llama decoder layer without its input RMSNorm (hidden 576, 9 query / 3 KV heads of "
        "64, MLP 1536, RoPE theta 1e5), no final norm. The embedding and the lm_head are the "
        "target's, lent at load time (`set_embed_and_head`), so the file holds only `fc.*` and "
        "`layers.0.*`. The lm_head is cut to the {hot} tokens of `token_map.pt` "
        "(`--speculative-token-map`). The hidden state it reads is the target's final hidden "
        "state *after* its final RMSNorm (what SGLang's llama captures for EAGLE); from the "
        "second draft step on, its own output before the lm_head."
    ),
    "standalone": (
        "A 2-layer Llama (`LlamaForCausalLM`, hidden 576, 9 query / 3 KV heads, MLP 1536) with "
        "the target's vocabulary and tokenizer, served by SGLang's STANDALONE worker as an "
        "ordinary model. Its layers started as target layers {layers}; its embedding is the "
        "target's, tied to its lm_head and frozen in training, so the shipped file holds only "
        "the layers and the final norm and `adatree models prepare` writes the servable folder "
        "with the target's embedding added."
    ),
}


def _agreement_table(results: list[Agreement]) -> list[str]:
    depth = max(len(r.conditional_top1) for r in results)
    head = "| held-out set | positions | top-1 | top-4 | " + " | ".join(
        f"step {s + 1} given 1..{s}" for s in range(1, depth)
    )
    lines = [head + " |", "|" + "---|" * (4 + depth - 1)]
    for r in results:
        cond = " | ".join(f"{c:.2f}" for c in r.conditional_top1[1:])
        lines.append(f"| {r.data} | {r.num_positions} | {r.top1:.2f} | {r.top4:.2f} | {cond} |")
    return lines


def _gain_table(gains: list[ShapeGain]) -> list[str]:
    lines = [
        "| shape | steps, topk, draft tokens | emitted tokens / step | step ms | "
        "break-even emitted | speedup |",
        "|---|---|---|---|---|---|",
    ]
    for g in gains:
        lines.append(
            f"| {g.name} | {g.steps}, {g.topk}, {g.num_draft_tokens} | {g.emitted:.2f} | "
            f"{g.step_ms:.1f} | {g.break_even_emitted:.2f} | {g.speedup:.2f}x |"
        )
    return lines


def _served_lines(section: ServedSection, agreement_emitted: dict[int, float]) -> list[str]:
    st = section.steps.settings
    profile_command = (
        f"adatree profile --draft {st.get('draft', '?')} --shapes '{st.get('shapes', '?')}' "
        f"--requests {st.get('requests', '?')} --new-tokens {st.get('new_tokens', '?')} "
        f"--threads {st.get('threads', '?')} --out {section.file}"
    )
    where = f" of an {st['cpu']}" if st.get("cpu") else ""
    lines = [
        "### Served by SGLang on this CPU",
        "",
        f"The passes above are transformers'. Served by SGLang 0.5.23 with this package's CPU "
        f"path ({st.get('threads', '?')} threads{where}): median step times at batch size 1 and "
        f"the mean emitted tokens of an adatree server cycling through the shapes one step at a "
        f"time on {st.get('prompts', 'MT-bench')} prompts (`{profile_command}`), against that "
        f"server's own steps without speculation ({section.steps.plain_ms:.1f} ms over "
        f"{section.steps.steps.get(NO_SPEC_KEY, 0)} steps, less the draft's extend, which the "
        "profile runs on them to keep the draft's cache whole); speedup = emitted x plain step "
        "/ step. The emitted tokens the held-out agreement above predicts are beside them:",
        "",
    ]
    if not section.gains:
        return [*lines, "The profile measured none of the chains above.", ""]
    lines += [
        "| shape | steps, topk, draft tokens | emitted tokens / step (served) | predicted by "
        "agreement | step ms | break-even emitted | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in section.gains:
        predicted = agreement_emitted.get(g.steps)
        lines.append(
            f"| {g.name} | {g.steps}, {g.topk}, {g.num_draft_tokens} | {g.emitted:.2f} | "
            f"{'-' if predicted is None else f'{predicted:.2f}'} | {g.step_ms:.1f} | "
            f"{g.break_even_emitted:.2f} | {g.speedup:.2f}x |"
        )
    best = max(section.gains, key=lambda g: g.speedup)
    return [
        *lines,
        "",
        f"Best served chain: {best.name} at {best.speedup:.2f}x. SGLang's trees keep the best "
        "nodes of each layer rather than k children per node, so they are not the trees above; "
        "`adatree bench` measures them served.",
        "",
    ]


def train_command_line(
    draft: str, cfg: dict, init_label: str | None = None, device: str = "cpu"
) -> str:
    """The ``adatree models train`` call that reproduces a training config."""
    flags = f"--epochs {cfg['epochs']:g} --lr {cfg['lr']:g} --warmup-steps {cfg['warmup_steps']}"
    flags += f" --tokens-per-batch {cfg['tokens_per_batch']} --val-every {cfg['val_every']}"
    flags += f" --seed {cfg['seed']}"
    if draft == "eagle":
        flags += f" --unroll {cfg['steps']}"
    data = cfg.get("data") or ["train"]
    if list(data) != ["train"]:
        flags += " --data " + " ".join(data)
    if cfg.get("init_from"):
        flags += f" --init-from {init_label or cfg['init_from']}"
    flags += _dtype_flag(cfg)
    where = "" if device == "cpu" else f"--device {device} "
    return f"adatree models {where}train {draft} {flags} --export"


def _datagen_commands(data: dict) -> str:
    """The ``adatree models datagen`` calls that made the data sets (older summaries: none)."""
    sets = data.get("sets")
    if not sets:
        return ""
    # Sets made alike but for name and seed share one command line.
    groups: dict[str, list[dict]] = {}
    for s in sets:
        where = "".join(f"--device {d} " for d in _devices(s) if d != "cpu")
        line = (
            f"adatree models --threads 1 {where}datagen --name {{name}} --seed {{seed}} "
            f"--batch-size {s['batch_size']} --max-new-tokens {s['max_new_tokens']} "
            f"--num-passage {_setting(s, 'num_passage')} "
            f"--num-detailed-meta {_setting(s, 'num_detailed_meta')} "
            f"--num-real {_setting(s, 'num_real')}{_dtype_flag(s)} --worker w/2"
        )
        groups.setdefault(line, []).append(s)
    calls = []
    for line, members in groups.items():
        if len(members) == 1:
            calls.append(f"`{line.format(name=members[0]['name'], seed=members[0]['seed'])}`")
        else:
            each = ", ".join(f"{m['name']}/{m['seed']}" for m in members)
            calls.append(f"`{line.format(name='NAME', seed='SEED')}` for each NAME/SEED of {each}")
    return ", by " + " and ".join(calls) + " (w = 0, 1)"


def _dtype_flag(settings: dict) -> str:
    """The ``--dtype`` a data set or a training run used, always spelled out: the default
    (auto) depends on the machine (summaries written before the option: bf16)."""
    return f" --dtype {settings.get('dtype', 'bfloat16')}"


def _precisions(data: dict) -> str:
    """The target's weights' precision over the data sets, in words."""
    names = {"bfloat16": "bf16", "float32": "fp32"}
    found = sorted({names.get(s.get("dtype", "bfloat16"), "?") for s in data.get("sets") or ()})
    return " or ".join(found or ["bf16"])


def _devices(data_set: dict) -> list[str]:
    """Where a data set's target ran (summaries written before devices were recorded: cpu)."""
    return data_set.get("devices") or ["cpu"]


DEVICE_WORDS = {"cpu": "the CPU", "cuda": "a GPU (`--device cuda`)"}


def _where(device: str) -> str:
    return DEVICE_WORDS.get(device, f"`--device {device}`")


def _generated_on(data: dict) -> str:
    """How the data's generation ran, in words."""
    devices = sorted({d for s in data.get("sets") or () for d in _devices(s)} or {"cpu"})
    if devices == ["cpu"]:
        return "datagen processes of one thread each, up to two at once on 2 CPU cores"
    return (
        "datagen processes of one CPU thread each, two per data set, the target on "
        + " and ".join(_where(d) for d in devices)
    )


def _earlier_data(runs: list[dict]) -> list[str]:
    """A paragraph on the data sets only earlier runs of a lineage trained on (if any)."""
    latest = {s["name"] for s in runs[-1]["data"].get("sets") or ()}
    earlier: dict[str, dict] = {}
    for run in runs[:-1]:
        for s in run.get("data", {}).get("sets") or ():
            if s["name"] not in latest:
                earlier.setdefault(s["name"], s)
    if not earlier:
        return []
    sets = list(earlier.values())
    return [
        f"Earlier runs of the lineage (below) also trained on {len(sets)} other data set(s) "
        f"({_generated_on({'sets': sets})})" + _datagen_commands({"sets": sets}) + ".",
        "",
    ]


def _compute(runs: list[dict]) -> str:
    """The runs' compute precision in words (runs before the option: bf16 autocast)."""
    words = {"bfloat16": "bf16 autocast", "float32": "fp32"}
    found = sorted({words[r["config"].get("dtype", "bfloat16")] for r in runs})
    return found[0] if len(found) == 1 else " or ".join(found) + "; each run's command says which"


def _training_time(runs: list[dict]) -> str:
    """Minutes of training per device over a lineage, in words."""
    minutes: dict[str, float] = {}
    for run in runs:
        device = run.get("device", "cpu")
        minutes[device] = minutes.get(device, 0.0) + run["train_seconds"] / 60
    return " and ".join(f"{m:.0f} min on {_where(d)}" for d, m in minutes.items())


def _setting(data_set: dict, key: str) -> object:
    """A data set's datagen setting; a summary written before the setting existed reads as a
    set made without it."""
    return data_set.get(key, LEGACY_DEFAULTS[key])


def _later_kinds(data: dict) -> str:
    """The prompt kinds added after the first data sets, in words, for the sets that have them."""
    sets = data.get("sets") or ()
    words = []
    if any(_setting(s, "num_passage") for s in sets):
        words.append(
            "in the sets made with `--num-passage`, also its own earlier answers handed back as "
            "a text to summarise, extract from, rewrite or quiz on"
        )
    if any(_setting(s, "num_detailed_meta") for s in sets):
        words.append(
            "in those made with `--num-detailed-meta`, requests it wrote when asked for a "
            "specific coding task, science or humanities question or writing task on "
            f"{sum(len(t) for t in prompts.SUBJECTS.values())} more advanced subjects"
        )
    if any(_setting(s, "num_real") for s in sets):
        words.append(
            f"in those made with `--num-real`, the {len(prompts.load_real_questions())} "
            "questions of GPQA Diamond and AIME 2025 (benchmarks this project never evaluates on)"
        )
    return "".join(f"; {w}" for w in words)


def _runs(training: dict) -> list[dict]:
    """The training runs that made the weights, earliest first (``init`` links them)."""
    runs = [training]
    while runs[0].get("init"):
        runs.insert(0, runs[0]["init"])
    return runs


def _training_commands(draft: str, training: dict) -> str:
    """How to repeat the runs that made the weights."""
    runs = _runs(training)
    if len(runs) == 1:
        line = train_command_line(draft, training["config"], None, training.get("device", "cpu"))
        return f"Command: `{line}`"
    parts = []
    for i, run in enumerate(runs, 1):
        label = f"<run {i - 1} weights>" if i > 1 else None
        line = train_command_line(draft, run["config"], label, run.get("device", "cpu"))
        parts.append(
            f"run {i}: `{line}`"
            f" ({run['steps']} steps, {run['train_seconds'] / 60:.0f} min, "
            f"best validation {run['best_val_top1']:.3f})"
        )
    return (
        f"Trained in {len(runs)} runs, each starting from the exported weights of the one "
        "before (`--init-from` a copy of that folder): " + "; ".join(parts)
    )


def render(
    draft: str,
    title: str,
    training: dict,
    results: list[Agreement],
    times: PassTimes,
    gains: list[ShapeGain],
    command: str,
    extra: dict,
    served: ServedSection | None = None,
) -> str:
    """The card's Markdown."""
    headline = next(r for r in results if r.data == HEADLINE_SET)
    runs = _runs(training)
    cfg = training["config"]
    draft_ms = times.eagle_ms if draft == "eagle" else times.standalone_ms
    arch = ARCHITECTURE[draft].format(
        hot=extra.get("hot_vocab"), layers=", ".join(map(str, cfg["source_layers"]))
    )
    best = max(gains, key=lambda g: g.speedup)
    lines = [
        f"# {title}",
        "",
        f"A draft model for SmolLM2-135M-Instruct (the target), trained by sglang-adatree on "
        f"the target's own greedy answers. On MT-bench first turns (held out): "
        f"**top-1 agreement: {headline.top1:.2f}** (top-4 agreement: {headline.top4:.2f}).",
        "",
        "## Architecture",
        "",
        arch,
        "",
        f"Trained parameters: {extra['num_params'] / 1e6:.2f} M, stored in bf16 "
        f"({extra['file_mb']:.1f} MB).",
        "",
        "## Data",
        "",
        f"Prompts from `sglang_adatree/models/prompts.py`: instruction templates over "
        f"{sum(len(t) for t in prompts.TOPICS.values())} topics (explain, write, advise, "
        "role-play, compare), arithmetic word problems, small reasoning puzzles, code tasks in "
        f"{len(set(prompts.CODE_LANGUAGES))} languages and extraction, requests the target "
        "wrote itself when asked for one, and follow-up turns after its own answers"
        f"{_later_kinds(training['data'])}. "
        f"Answers: the target's greedy continuations ({_precisions(training['data'])} "
        "weights, at most "
        f"{training['data']['max_new_tokens']} tokens), with its hidden states and greedy labels "
        "from a teacher-forced pass. MT-bench, GSM8K and HumanEval are never trained on: they "
        "are the held-out sets below (their answers generated in fp32).",
        "",
        f"Training data: {training['data']['sequences']} conversations, "
        f"{training['train_answer_tokens']} answer tokens for training and "
        f"{training['val_answer_tokens']} for validation (held-out conversations); "
        f"generated in {training['data']['hours']:.1f} h, the sum of the shards' own times "
        f"({_generated_on(training['data'])})" + _datagen_commands(training["data"]) + ".",
        "",
        *_earlier_data(runs),
        "## Training",
        "",
        f"{sum(r['steps'] for r in runs)} optimizer steps in {_training_time(runs)} "
        f"({_compute(runs)}), AdamW lr {cfg['lr']} (cosine), batches of about "
        f"{cfg['tokens_per_batch']} tokens, loss: cross-entropy against the target's "
        "distribution"
        + (
            f" (its {cfg['teacher_top_k']} most likely tokens, renormalised)"
            if cfg.get("teacher_top_k")
            else ""
        )
        + (
            f" plus smooth-L1 to its hidden state (weight {cfg['reg_weight']}), over "
            f"{cfg['steps']} unrolled draft steps (weights {cfg['step_decay']}^(s-1))."
            if draft == "eagle"
            else "."
        )
        + f" Best validation top-1 agreement: {training['best_val_top1']:.3f}. "
        + _training_commands(draft, training)
        + " (the time budget aside, every other setting at its default).",
        "",
        "## Agreement with the target's greedy tokens (held out)",
        "",
        "Teacher-forced on the target's fp32 greedy answers to the first turns; step s > 1 "
        "counts only positions where steps 1..s-1 were right (the draft consumes its own "
        "output there, as at inference).",
        "",
        *_agreement_table(results),
        "",
        f"Reproduce: `{command}`",
        "",
        "## Where speculation pays on this CPU",
        "",
        f"Median forward times (transformers, fp32, {times.threads} threads"
        f"{f' of an {times.cpu}' if times.cpu else ''}, after a {times.context}-token context, "
        f"{times.rounds} interleaved rounds), ms:",
        "",
        "| new tokens | " + " | ".join(str(n) for n in times.target_ms) + " |",
        "|---|" + "---|" * len(times.target_ms),
        "| target | " + " | ".join(f"{v:.1f}" for v in times.target_ms.values()) + " |",
        "| this draft | " + " | ".join(f"{v:.1f}" for v in draft_ms.values()) + " |",
        "",
        "Step time = target verify over the draft tokens + (steps - 1) draft passes over topk "
        "tokens + one draft-extend pass; emitted tokens from the measured MT-bench agreement. "
        "Trees keep the top-k children per node at each depth (k per depth in the name); "
        "speedup = emitted x target(1) / step time:",
        "",
        *_gain_table(gains),
        "",
        f"Best here: {best.name} at {best.speedup:.2f}x. A shape pays when its emitted tokens "
        "exceed its break-even column.",
        "",
        *(_served_lines(served, headline.chain_emitted) if served is not None else []),
    ]
    return "\n".join(lines)


def write(folder: Path, text: str, figures: dict) -> None:
    (folder / "MODEL_CARD.md").write_text(text)
    (folder / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
