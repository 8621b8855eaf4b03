"""Where speculation pays on this CPU: measured pass times against measured agreement.

One EAGLE decode step of shape ``(steps, topk, num_draft_tokens)`` in SGLang 0.5.23 runs
``steps - 1`` draft passes over ``topk`` tokens (``EAGLEWorkerV2.draft_forward``; the first
draft tokens come from the previous step), one target verify pass over ``num_draft_tokens``
tokens, and one draft-extend pass over ``num_draft_tokens`` tokens. So, per request::

    step_time = T_target(n) + (steps - 1) * T_draft(topk) + T_draft(n)
    speedup   = expected emitted tokens * T_target(1) / step_time

Pass times come from transformers on this CPU, each after a cached context of ``context``
tokens, as the median over interleaved rounds (every configuration once per round, so load
from other processes spreads evenly). The EAGLE head is timed as what SGLang runs for it: fc,
one decoder layer and an lm_head over the hot vocabulary.

Those pass times are transformers', not the served path's (SGLang with this package's CPU
path computes a verify pass over a few tokens faster). ``load_served`` and ``served_gains``
take the served side from ``adatree profile --out``: median step times at batch size 1 of an
adatree server cycling through the shapes, each against that server's steps without
speculation (the same timer around both), and the tokens its steps emitted.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_adatree.core.shapes import NO_SPEC, TreeShape
from sglang_adatree.models.hardware import cpu_name

TOKEN_COUNTS = (1, 2, 3, 4, 5, 6, 8, 16, 24)


@dataclass(frozen=True)
class PassTimes:
    """Median milliseconds of one forward pass over ``n`` new tokens, per model."""

    context: int
    threads: int
    rounds: int
    target_ms: dict[int, float]
    eagle_ms: dict[int, float]
    standalone_ms: dict[int, float]
    cpu: str = ""  # the CPU's model name ("" where unknown, and in figures before it was kept)


@dataclass(frozen=True)
class ShapeGain:
    """Predicted effect of one shape: emitted tokens, step time and speedup over no-spec."""

    name: str
    steps: int
    topk: int
    num_draft_tokens: int
    emitted: float
    step_ms: float
    speedup: float
    break_even_emitted: float  # emitted tokens needed to match plain decoding


def _cached_runner(model, context: int, vocab: int) -> Callable[[int], None]:
    """A function running ``n`` new tokens after a cached context, leaving the cache as is."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, context)), past_key_values=cache)

    def run(n: int) -> None:
        with torch.inference_mode():
            model(
                input_ids=torch.randint(0, vocab, (1, n)),
                past_key_values=cache,
                position_ids=torch.arange(context, context + n)[None],
            )
        cache.crop(context)

    return run


def _eagle_runner(target_config: dict, hot_vocab: int, context: int) -> Callable[[int], None]:
    """Same shapes as the served head: fc, a 1-layer Llama with a hot-vocab lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {k: v for k, v in target_config.items() if not k.startswith("_")}
    cfg.update(num_hidden_layers=1, vocab_size=hot_vocab, tie_word_embeddings=False)
    twin = LlamaForCausalLM(LlamaConfig.from_dict(cfg)).eval()
    hidden = target_config["hidden_size"]
    fc = torch.nn.Linear(2 * hidden, hidden)
    run_layer = _cached_runner(twin, context, hot_vocab)

    def run(n: int) -> None:
        with torch.inference_mode():
            fc(torch.randn(1, n, 2 * hidden))
        run_layer(n)

    return run


def measure_pass_times(
    target_dir: Path,
    standalone_model: torch.nn.Module,
    hot_vocab: int,
    context: int = 256,
    rounds: int = 15,
) -> PassTimes:
    """Median forward times of the target, the EAGLE head and the standalone draft."""
    import json

    from transformers import AutoModelForCausalLM

    target_config = json.loads((target_dir / "config.json").read_text())
    vocab = target_config["vocab_size"]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    runners = {
        "target": _cached_runner(target, context, vocab),
        "eagle": _eagle_runner(target_config, hot_vocab, context),
        "standalone": _cached_runner(standalone_model.eval(), context, vocab),
    }
    samples: dict[tuple[str, int], list[float]] = {
        (m, n): [] for m in runners for n in TOKEN_COUNTS
    }
    for key in samples:  # warm-up: first calls allocate
        runners[key[0]](key[1])
    for _ in range(rounds):
        for (name, n), times in samples.items():
            start = time.perf_counter()
            runners[name](n)
            times.append((time.perf_counter() - start) * 1000)
    med = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    return PassTimes(
        context,
        torch.get_num_threads(),
        rounds,
        {n: med[("target", n)] for n in TOKEN_COUNTS},
        {n: med[("eagle", n)] for n in TOKEN_COUNTS},
        {n: med[("standalone", n)] for n in TOKEN_COUNTS},
        cpu_name(),
    )


def _interp(table: dict[int, float], n: int) -> float:
    """Linear between measured token counts (and past the last two)."""
    if n in table:
        return table[n]
    keys = sorted(table)
    above = [k for k in keys if k > n]
    hi = above[0] if above else keys[-1]
    lo = max(k for k in keys if k < hi) if above else keys[-2]
    return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


def step_ms(times: PassTimes, draft: str, steps: int, topk: int, num_draft_tokens: int) -> float:
    draft_ms = times.eagle_ms if draft == "eagle" else times.standalone_ms
    return (
        _interp(times.target_ms, num_draft_tokens)
        + (steps - 1) * _interp(draft_ms, topk)
        + _interp(draft_ms, num_draft_tokens)
    )


def shape_gains(
    times: PassTimes, draft: str, chain_emitted: dict[int, float], tree_emitted: dict[str, float]
) -> list[ShapeGain]:
    """Chains (steps = depth, topk 1) and static trees named by per-depth branching."""
    shapes = [(f"chain {d}", d, 1, d + 1, e) for d, e in chain_emitted.items()]
    for name, emitted in tree_emitted.items():
        branching = [int(k) for k in name.split("-")]
        nodes, width = 1, 1
        for k in branching:
            width *= k
            nodes += width
        shapes.append((f"tree {name}", len(branching), branching[0], nodes, emitted))
    out = []
    for name, steps, topk, n, emitted in shapes:
        ms = step_ms(times, draft, steps, topk, n)
        base = times.target_ms[1]
        out.append(
            ShapeGain(
                name,
                steps,
                topk,
                n,
                round(emitted, 3),
                round(ms, 2),
                round(emitted * base / ms, 3),
                round(ms / base, 3),
            )
        )
    return out


@dataclass(frozen=True)
class ServedSteps:
    """Median step times at batch size 1 of a served draft, from ``adatree profile --out``."""

    draft: str  # the draft folder the server ran
    plain_ms: float  # steps without speculation, less the draft's extend (catch-ups left out)
    step_ms: dict[str, float]  # speculative shape "S,K,N" -> ms
    emitted: dict[str, float]  # speculative shape -> mean emitted tokens a step, as served
    steps: dict[str, int]  # measured steps behind each median, the plain one under NO_SPEC_KEY
    settings: dict  # what ``adatree profile`` ran with (shapes, requests, new_tokens, ...)


NO_SPEC_KEY = str(NO_SPEC)  # how a profile names steps without speculation


def load_served(path: Path) -> ServedSteps:
    """Read a profile written by ``adatree profile --out``; ValueError says what is missing."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the served profile {path}: {exc}") from exc
    rows = data.get("shapes") if isinstance(data, dict) else None
    if not rows or "draft" not in data:
        raise ValueError(f"{path} is not an `adatree profile --out` file (no draft, no shapes)")
    by_shape = {r["shape"]: r for r in rows}
    if NO_SPEC_KEY not in by_shape:
        raise ValueError(
            f"{path} has no steps without speculation to compare with: profile with shape 0 "
            "among --shapes"
        )
    speculative = {k: r for k, r in by_shape.items() if k != NO_SPEC_KEY}
    unmeasured = [k for k, r in speculative.items() if r.get("emitted") is None]
    if unmeasured:
        raise ValueError(
            f"{path} has no emitted tokens for {', '.join(unmeasured)} (a profile from before "
            "they were logged): run `adatree profile` again"
        )
    return ServedSteps(
        draft=data["draft"],
        plain_ms=float(
            by_shape[NO_SPEC_KEY].get("step_less_draft_ms") or by_shape[NO_SPEC_KEY]["step_ms"]
        ),
        step_ms={k: float(r["step_ms"]) for k, r in speculative.items()},
        emitted={k: float(r["emitted"]) for k, r in speculative.items()},
        steps={k: int(r["steps"]) for k, r in by_shape.items()},
        settings=dict(data.get("settings") or {}),
    )


def served_gains(served: ServedSteps, depths: Sequence[int]) -> list[ShapeGain]:
    """The chains of these depths that the profile measured, as served: step times and
    emitted tokens both from the server.

    Only chains: SGLang's trees keep the best nodes of each layer, not ``k`` children per node,
    so the static trees ``shape_gains`` names are not shapes a server runs.
    """
    out = []
    for depth in depths:
        key = str(TreeShape(depth, 1, depth + 1))
        if key not in served.step_ms:
            continue
        ms, emitted = served.step_ms[key], served.emitted[key]
        out.append(
            ShapeGain(
                f"chain {depth}",
                depth,
                1,
                depth + 1,
                round(emitted, 3),
                round(ms, 2),
                round(emitted * served.plain_ms / ms, 3),
                round(ms / served.plain_ms, 3),
            )
        )
    return out
