"""Training prompts: deterministic, varied, and disjoint from the held-out evaluation sets."""

import re

import pytest

from sglang_adatree.models import prompts
from sglang_adatree.models.prompts import EVAL_SETS, clean_instruction, load_eval_prompts

SHINGLE = 6  # words


def _shingles(text: str, size: int = SHINGLE) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + size]) for i in range(len(words) - size + 1)}


def _training_texts() -> list[str]:
    texts = [p.text for shard in range(40) for p in prompts.seed_prompts(0, shard, 48, 8, 8)]
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


def test_no_real_question_is_a_near_copy_of_an_evaluation_prompt():
    # Other people's questions share common 6-word phrases with the held-out sets ("what is
    # the area of the", "1 2 3 4 5 6"); a copied or paraphrased item would share a long span.
    size = 10
    held_out = set()
    for name in EVAL_SETS:
        for p in load_eval_prompts(name):
            held_out |= _shingles(p.text, size)
    shared = {s for q in prompts.load_real_questions() for s in _shingles(q, size)} & held_out
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


def test_detailed_meta_prompts_leave_a_seed_s_other_prompts_as_they_were():
    before = prompts.seed_prompts(0, 3, 40, 8)
    after = prompts.seed_prompts(0, 3, 40, 8, 8)
    assert after[: len(before)] == before and len(after) == len(before) + 8
    detailed = [p.text for p in after[len(before) :]]
    assert all(p.kind == "meta" and "Only write the" in p.text for p in after[len(before) :])
    assert all("{" not in t for t in detailed) and len(set(detailed)) > 4
    assert detailed != [p.text for p in prompts.seed_prompts(1, 3, 40, 8, 8)[len(before) :]]


def test_real_questions_come_from_the_packages_and_repeat_only_after_the_whole_pool():
    pool = prompts.load_real_questions()
    assert len(pool) == 226 and len(set(pool)) == len(pool)  # of 198 + 30: 2 too long
    assert max(len(q) for q in pool) <= prompts.REAL_MAX_CHARS
    assert any(q.startswith("Answer the following multiple choice question") for q in pool)
    assert any("Show your reasoning step by step." in q for q in pool)
    per_shard = 4
    shards = -(-len(pool) // per_shard)  # enough shards to use every question once
    seen = [p.text for k in range(shards) for p in prompts.real_prompts(7, k, per_shard)]
    assert set(seen) == set(pool) and len(seen) - len(pool) < per_shard
    assert all(p.kind == "real" for p in prompts.real_prompts(7, 0, per_shard))
    assert prompts.real_prompts(7, 0, per_shard) != prompts.real_prompts(8, 0, per_shard)
    assert prompts.real_prompts(7, 0, 0) == []


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
