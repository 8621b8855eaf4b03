"""Training prompts: deterministic, varied, and disjoint from the held-out evaluation sets."""

import re

import pytest

from sglang_adatree.models import prompts
from sglang_adatree.models.prompts import EVAL_SETS, clean_instruction, load_eval_prompts

SHINGLE = 6  # words


def _shingles(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + SHINGLE]) for i in range(len(words) - SHINGLE + 1)}


def _training_texts() -> list[str]:
    texts = [p.text for shard in range(40) for p in prompts.seed_prompts(0, shard, 56, 8)]
    texts += list(prompts.FOLLOWUPS) + list(prompts.META_TEMPLATES)
    texts += [t.format(text="") for t in prompts.PASSAGE_TASKS]
    texts += [t for group in prompts.TEMPLATES.values() for t in group]
    return texts


def test_no_training_prompt_shares_a_phrase_with_the_evaluation_sets():
    held_out = set()
    for name in EVAL_SETS:
        for p in load_eval_prompts(name):
            held_out |= _shingles(p.text)
    shared = {s for text in _training_texts() for s in _shingles(text)} & held_out
    assert not shared, sorted(shared)[:5]


def test_evaluation_sets_load_from_their_packages():
    assert len(load_eval_prompts("mtbench")) == 80
    assert len(load_eval_prompts("gsm8k", limit=40)) == 40
    first = load_eval_prompts("humaneval", limit=1)[0]
    assert first.kind == "humaneval" and "def has_close_elements" in first.text
    with pytest.raises(ValueError, match="unknown"):
        load_eval_prompts("sharegpt")


def test_seed_prompts_are_deterministic_and_varied():
    a = prompts.seed_prompts(0, 3, 56, 8)
    assert a == prompts.seed_prompts(0, 3, 56, 8)
    assert a != prompts.seed_prompts(0, 4, 56, 8) and a != prompts.seed_prompts(1, 3, 56, 8)
    assert [p.kind for p in a].count("meta") == 8
    texts = [p.text for shard in range(20) for p in prompts.seed_prompts(0, shard, 56, 0)]
    assert len(set(texts)) > 0.8 * len(texts)
    assert any(t.startswith("Write a Python function") for t in texts)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            'Sure! Here is one: "How do volcanoes form under the ocean?"',
            "How do volcanoes form under the ocean?",
        ),
        ("Sure! I can write a question for you about that.", None),
        (
            'A student might ask: "How do volcanoes form under the ocean?"',
            "How do volcanoes form under the ocean?",
        ),
        (
            "Question: What makes the sky look blue at noon?\nBecause...",
            "What makes the sky look blue at noon?",
        ),
        (
            "Write a haiku about autumn leaves falling.",
            "Write a haiku about autumn leaves falling.",
        ),
        ("What's the most interesting", None),  # cut off: no final punctuation
        ("Why?", None),  # too short to be a request
    ],
)
def test_clean_instruction(answer, expected):
    assert clean_instruction(answer) == expected


def test_a_passage_prompt_holds_the_whole_passage_once():
    import random

    passage = "Bees carry pollen between flowers.\nThey live in colonies."
    a = prompts.passage_prompt(random.Random(0), passage + "\n")
    assert a == prompts.passage_prompt(random.Random(0), passage)
    assert a.kind == "passage" and len(a.messages) == 1 and a.text.count(passage) == 1
    tasks = {prompts.passage_prompt(random.Random(i), passage).text for i in range(200)}
    assert len(tasks) == len(prompts.PASSAGE_TASKS)
