"""What the benchmark sends: prompt sets, the transition workload and the warm-up prompts.

A workload is an ordered list of user messages, each with a phase label. Named prompt sets
come from the installed packages the held-out evaluation uses (``models.prompts``):
``mtbench`` (first turns of MT-bench's 80 questions), ``gsm8k`` (GSM8K test questions) and
``humaneval`` (HumanEval's 164 function stubs); any other name is read as a JSONL file with a
``prompt`` field per line. Prompts are drawn in a seeded shuffle, repeated if the set is smaller
than the request count.

``transition`` alternates low- and high-acceptance phases (low, high, low, high), as SGLang's
``benchmark/bench_adaptive_speculative.py --workload transition`` does: high-acceptance prompts
ask for long, repetitive, predictable output; low-acceptance prompts ask for varied, inventive
text. An adaptive policy must follow the switch; a fixed shape is right for one phase at most.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from sglang_adatree.models.prompts import EVAL_SETS, load_eval_prompts

TRANSITION = "transition"
WORKLOAD_NAMES = (*EVAL_SETS, TRANSITION)

HIGH_ACCEPTANCE_PROMPTS = (
    "Count from 1 to 300, one number per line, with no other text.",
    "Write the word 'hello' 150 times, separated by spaces, with no other text.",
    "List the letters of the English alphabet in order, then list them again in order, ten "
    "times in total, one letter per line.",
    "Repeat the sentence 'The cat sat on the mat.' 60 times, one per line.",
    "Write the multiplication table of 2 from 2 x 1 up to 2 x 100, one line per product.",
    "Print the days of the week in order, over and over, for 40 weeks, one day per line.",
)
LOW_ACCEPTANCE_PROMPTS = (
    "Invent twenty fictional cities. For each give an unusual name, its founding myth, its "
    "strangest law and its favourite food.",
    "Write a surreal short story in which a lighthouse keeper trades memories with a migrating "
    "whale, full of unexpected images.",
    "Describe thirty imaginary musical instruments, each made from a different unlikely "
    "material, and the sound each one makes.",
    "Write a dialogue between a medieval alchemist, a modern barista and a robot gardener who "
    "argue about the meaning of patience.",
    "Create fifteen riddles about ordinary household objects, each in a different poetic form.",
    "Write a travel diary of a botanist exploring a floating archipelago where every island has "
    "its own weather, language and plants.",
)
# Sent before any measured point so that no policy is measured cold; none is from a prompt set.
WARMUP_PROMPTS = (
    "Explain how a rainbow forms.",
    "Give three tips for learning to cook.",
    "Write a short poem about the sea.",
    "What is the difference between weather and climate?",
)


@dataclass(frozen=True)
class Workload:
    """Ordered user messages to send and the phase each belongs to ("" without phases)."""

    name: str
    prompts: tuple[str, ...]
    phases: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.phases):
            raise ValueError(f"{self.name}: {len(self.prompts)} prompts, {len(self.phases)} phases")
        if not self.prompts:
            raise ValueError(f"workload {self.name!r} has no prompts")

    def __len__(self) -> int:
        return len(self.prompts)


def _draw(pool: list[str], count: int, rng: random.Random) -> list[str]:
    """``count`` prompts from a seeded shuffle of ``pool``, cycling when it is too small."""
    order = list(pool)
    rng.shuffle(order)
    return [order[i % len(order)] for i in range(count)]


def read_jsonl_prompts(path: Path) -> list[str]:
    """The ``prompt`` field of every non-empty line of a JSONL file."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{number}: no string 'prompt' field")
        prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def workload_name(spec: str) -> str:
    """The name a workload is reported under: the set's name, or the JSONL file's stem."""
    return spec if spec in WORKLOAD_NAMES else Path(spec).stem


def load_workload(spec: str, num_requests: int, seed: int = 0) -> Workload:
    """``num_requests`` prompts of a named set, ``transition``, or a JSONL file's prompts."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(f"{seed}:{spec}")
    if spec == TRANSITION:
        return transition_workload(num_requests, rng)
    if spec in EVAL_SETS:
        pool = [p.text for p in load_eval_prompts(spec)]
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(
                f"--prompts {spec!r}: neither a named set ({', '.join(WORKLOAD_NAMES)}) nor a "
                "JSONL file"
            )
        pool = read_jsonl_prompts(path)
    prompts = _draw(pool, num_requests, rng)
    return Workload(workload_name(spec), tuple(prompts), ("",) * num_requests)


def transition_workload(num_requests: int, rng: random.Random) -> Workload:
    """Phases low-1, high-1, low-2, high-2 of (nearly) equal size, in that order."""
    labels = ("low-1", "high-1", "low-2", "high-2")
    sizes = [num_requests // 4 + (1 if i < num_requests % 4 else 0) for i in range(4)]
    prompts: list[str] = []
    phases: list[str] = []
    for label, size in zip(labels, sizes, strict=True):
        pool = LOW_ACCEPTANCE_PROMPTS if label.startswith("low") else HIGH_ACCEPTANCE_PROMPTS
        prompts += _draw(list(pool), size, rng)
        phases += [label] * size
    return Workload(TRANSITION, tuple(prompts), tuple(phases))
