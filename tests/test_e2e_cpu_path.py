"""The CPU path with the bundled SmolLM2 target: adatree's greedy output is SGLang's.

Both worker kinds, the STANDALONE-style small draft and the EAGLE-style head, run on the pure
torch path (no Triton interpreter, no CUDA kernels). Shapes are forced with pins: a chain, a
tree with topk > 1, and, unpinned, a mixed batch of requests at different lengths while the
warm-up cycles every candidate (its steps without speculation as the target's plain decode).
"""

from __future__ import annotations

import time

import pytest
from sglang_servers import adatree_command, free_port, reference_command, sglang_server
from sqlalchemy import insert, update
from transformers import AutoTokenizer

from sglang_adatree.config import load_config
from sglang_adatree.models.paths import ModelPaths
from sglang_adatree.models.prepare import prepare_all
from sglang_adatree.telemetry.models import PinRow
from sglang_adatree.telemetry.store import get_engine, upgrade

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn leaves."]
MIXED = [
    ("Hi!", 20),
    ("Explain, in a few sentences, why the sky looks blue during the day.", 32),
    ("List three uses of copper, then name the country that mines the most of it.", 12),
]
CANDIDATES = "0;3,1,4;3,2,6"
CHAIN, TREE = (3, 1, 4), (3, 2, 6)


@pytest.fixture(scope="module")
def bundled() -> ModelPaths:
    paths = ModelPaths(load_config().home_dir)
    prepare_all(paths)
    return paths


def _texts(paths: ModelPaths, prompts: list[str]) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(paths.target_dir)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def _run(server, texts: list[str], max_new_tokens: list[int]) -> list[list[int]]:
    out = []
    # One request per distinct length limit, all in flight together, so they share batches.
    payload = {
        "text": texts,
        "sampling_params": [{"max_new_tokens": n, "temperature": 0} for n in max_new_tokens],
    }
    for r in server.generate(payload):
        out.append(r["output_ids"])
    return out


@pytest.fixture(scope="module")
def reference(bundled, tmp_path_factory):
    log = tmp_path_factory.mktemp("ref") / "server.log"
    with sglang_server(reference_command(bundled.target_dir, free_port()), log) as server:
        questions = _run(server, _texts(bundled, QUESTIONS), [32, 32])
        mixed = _run(server, _texts(bundled, [p for p, _ in MIXED]), [n for _, n in MIXED])
    return {"questions": questions, "mixed": mixed}


def _pin(db_url: str, shape: tuple[int, int, int] | None) -> None:
    with get_engine(db_url).begin() as conn:
        conn.execute(
            update(PinRow)
            .where(PinRow.cleared_at.is_(None))
            .values(cleared_at=time.time(), cleared_by="pytest")
        )
        if shape is not None:
            conn.execute(
                insert(PinRow).values(
                    steps=shape[0], topk=shape[1], num_draft_tokens=shape[2],
                    reason="cpu path test", created_at=time.time(), created_by="pytest",
                )
            )  # fmt: skip
    time.sleep(1.0)  # polled every 0.2 s


def _check_server(draft, bundled, reference, tmp_path, extra=()):
    db_url = f"sqlite:///{tmp_path / 'adatree.sqlite'}"
    upgrade(db_url)
    env = {
        "ADATREE_DB_URL": db_url,
        "ADATREE_WARMUP_STEPS": "100000",
        "ADATREE_CONTROL_POLL_S": "0.2",
    }
    command = adatree_command(
        bundled.target_dir, draft, free_port(), "--candidate-shapes", CANDIDATES, *extra
    )
    with sglang_server(command, tmp_path / "server.log", env=env) as server:
        questions = _texts(bundled, QUESTIONS)
        for shape in (CHAIN, TREE):
            _pin(db_url, shape)
            assert _run(server, questions, [32, 32]) == reference["questions"], shape
        _pin(db_url, None)
        mixed = _run(server, _texts(bundled, [p for p, _ in MIXED]), [n for _, n in MIXED])
        assert mixed == reference["mixed"]
        # The warm-up's steps without speculation ran as the target's plain decode, batches of
        # requests at different lengths included.
        state = server.server_info()["internal_states"][0]
        assert state["adatree_plain_decode_steps"] > 0
        # The draft's confidence reached the policy: its speculative steps taught the bins.
        assert sum(b["steps"] for b in state["adatree_draft_confidence"]) > 0


def test_standalone_draft_matches_greedy(bundled, reference, tmp_path):
    _check_server(bundled.standalone_dir, bundled, reference, tmp_path)


def test_eagle_head_matches_greedy(bundled, reference, tmp_path):
    extra = []
    if bundled.eagle_token_map.is_file():
        extra = ["--speculative-token-map", str(bundled.eagle_token_map)]
    _check_server(bundled.eagle_dir, bundled, reference, tmp_path, extra)
