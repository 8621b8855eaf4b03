"""Where a scenario's traces and step-time profile come from, by name (``lab.scenarios``).

Exact traces are built once per (pair, prompts, shapes, answer length) and cached under the data
directory (``<home>/lab/traces``); parametric ones are drawn from a seed derived from the
scenario's trace source, so every run of a scenario replays the same requests.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.core.step_profile import StepTimeProfile, TableProfile
from sglang_adatree.lab.scenarios import (
    DATA_DIR,
    PARAMETRIC_PAIRS,
    PARAMETRIC_SETS,
    TRANSITION_PHASE,
    Scenario,
)
from sglang_adatree.lab.traces import TraceSet, parametric_traces

BUNDLED_DRAFTS = ("eagle-smollm2", "draft-smollm2")
PARAMETRIC_REQUESTS = 64
CPU_PROFILE = "cpu-2core"


class SourceError(ValueError):
    """A trace source or profile name that does not resolve; the message says what does."""


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def load_traces(
    source: str,
    shapes: Sequence[TreeShape],
    answer_tokens: int,
    home: Path,
    progress: bool = True,
    num_prompts: int = 32,
) -> TraceSet:
    """The trace set ``source`` names (``pair:set``), over ``shapes``; exact sets replay
    ``num_prompts`` prompts of the set (parametric ones ``PARAMETRIC_REQUESTS`` requests)."""
    pair, _, prompts = source.partition(":")
    if not prompts:
        raise SourceError(f"trace source {source!r}: expected PAIR:PROMPTS")
    if pair in PARAMETRIC_PAIRS:
        if prompts not in PARAMETRIC_SETS:
            known = ", ".join(PARAMETRIC_SETS)
            raise SourceError(f"parametric prompt set {prompts!r}: known {known}")
        return _parametric(pair, prompts, tuple(shapes), answer_tokens)
    if pair in BUNDLED_DRAFTS:
        return _exact(pair, prompts, tuple(shapes), answer_tokens, home, progress, num_prompts)
    known = ", ".join((*BUNDLED_DRAFTS, *PARAMETRIC_PAIRS))
    raise SourceError(f"trace source {source!r}: unknown pair {pair!r}; known {known}")


def _parametric(
    pair: str, prompts: str, shapes: tuple[TreeShape, ...], answer_tokens: int
) -> TraceSet:
    spec = PARAMETRIC_PAIRS[pair]
    classes = PARAMETRIC_SETS[prompts]
    hazards = {c: spec.classes[c] for c in classes}
    if prompts == "transition":
        # Phases of TRANSITION_PHASE requests per class, in turn (the scenario keeps the order).
        order = [
            classes[(i // TRANSITION_PHASE) % len(classes)] for i in range(PARAMETRIC_REQUESTS)
        ]
        sets = [
            parametric_traces(
                prompts, spec.description, shapes, {c: hazards[c]}, num_requests=1,
                answer_len=answer_tokens, seed=_seed(f"{pair}:{prompts}:{i}"),
            ).requests[0]
            for i, c in enumerate(order)
        ]  # fmt: skip
        return TraceSet(prompts, spec.description, "parametric", shapes, tuple(sets))
    return parametric_traces(
        prompts,
        spec.description,
        shapes,
        hazards,
        num_requests=PARAMETRIC_REQUESTS,
        answer_len=answer_tokens,
        seed=_seed(f"{pair}:{prompts}"),
    )


def _exact(
    draft: str,
    prompts: str,
    shapes: tuple[TreeShape, ...],
    answer_tokens: int,
    home: Path,
    progress: bool,
    num_prompts: int,
) -> TraceSet:
    from sglang_adatree.lab.tracegen import build_traces
    from sglang_adatree.models.paths import ModelPaths
    from sglang_adatree.models.prepare import prepare_all
    from sglang_adatree.tools.bench.workloads import load_workload

    paths = ModelPaths(home)
    prepare_all(paths)  # the bundled target and drafts in the data directory, once
    draft_dir = paths.eagle_dir if draft == "eagle-smollm2" else paths.standalone_dir
    # The prompts `adatree bench --prompts SET --num-requests N` sends (the same seeded draw),
    # so a served run and its replay see the same requests.
    workload = load_workload(prompts, num_prompts)
    return build_traces(
        list(dict.fromkeys(workload.prompts)),
        name=workload.name,
        target=paths.target_dir,
        draft=draft_dir,
        shapes=shapes,
        max_new_tokens=answer_tokens,
        cache_dir=home / "lab" / "traces",
        progress=progress,
    )


def load_profile(name: str, shapes: Sequence[TreeShape]) -> StepTimeProfile:
    """The step-time profile ``name`` names (``lab.scenarios``), or the profile file at that
    path (``*.json``, as ``adatree profile --profile-out`` writes), covering ``shapes``."""
    if name.startswith("db:"):
        from sglang_adatree.lab.measured import profile_from_telemetry

        return profile_from_telemetry(name[3:], shapes=tuple(shapes))
    from sglang_adatree.lab.hardware import GPUS, analytic_gpu_profile

    if name.endswith(".json"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise SourceError(f"profile file {name}: not found")
    else:
        path = DATA_DIR / f"{name}.json"  # a committed profile
    if path.is_file():
        try:
            return _covering(TableProfile.load(path), shapes)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise SourceError(f"profile file {name}: not a step-time profile ({exc!r})") from exc
    if name in GPUS:
        return _covering(analytic_gpu_profile(name, tuple(shapes)), shapes)
    known = sorted({p.stem for p in DATA_DIR.glob("*.json")} | set(GPUS))
    raise SourceError(f"profile {name!r}: known {', '.join(known)}, db:URL or a FILE.json")


def _covering(profile: TableProfile, shapes: Sequence[TreeShape]) -> TableProfile:
    missing = profile.missing(shapes)
    if missing:
        named = ", ".join(str(s) for s in missing)
        raise SourceError(f"profile {profile.name} has no step times for {named}")
    return profile


def scenario_key(scenario: Scenario) -> str:
    """A stable digest of what a scenario replays, for caching results."""
    payload = {
        "traces": scenario.traces,
        "profile": scenario.profile,
        "answer": scenario.answer_tokens,
        "shapes": [str(s) for s in scenario.candidates],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# A profiled start's profile was made at another time than the run it prices: the whole
# profile is this much slower than the run's machine (the residual correction's drift, common to
# every shape, takes it up in the first steps).
PROFILED_LEVEL = 1.15


def profiled_start(profile: StepTimeProfile, sigma: float, seed: int) -> TableProfile:
    """``profile`` as a profile sweep of the deployment would have measured it: each shape's
    step times off by its own log-normal factor of ``sigma`` (drawn from ``seed``), all of them
    by ``PROFILED_LEVEL``. What a server started with ``step_time_profile`` would be given."""
    if not isinstance(profile, TableProfile):
        raise SourceError(f"profile {profile.name}: a profiled start needs a tabulated profile")
    if not 0.0 <= sigma <= 1.0:
        raise SourceError(f"a profiled start's error must be in [0, 1], got {sigma}")
    rng = np.random.default_rng(_seed(f"profiled-start:{profile.name}:{seed}"))
    error = np.exp(rng.normal(0.0, sigma, len(profile.shapes)))  # [shapes]
    return TableProfile(
        f"{profile.name}, profiled ({sigma:.0%} a shape)",
        profile.source,
        profile.made_by,
        profile.shapes,
        profile.batch_sizes,
        profile.context_lens,
        profile.ms * error[:, None, None] * PROFILED_LEVEL,
        profile.padding,
        profile.notes,
    )
