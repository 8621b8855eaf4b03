"""``adatree compare`` end to end on tiny models: three real SGLang servers side by side (plain
decoding, SGLang's STANDALONE worker at 3,1,4 and adatree pinned to 3,1,4 through a pin in its
own telemetry database), the prompts sent to each in turn; the answers must be identical and
the pinned server must have run the pinned shape on every step; SGLang's stage clock is read
from each server. And one pinned configuration on two servers (``--instances 2``): each with its
own database and pin, the second's answers identical to the first's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select
from test_bench_e2e import processes_with_env

from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.store import session_scope

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "def add(a, b):"]


def compare(tiny_models, tmp_path, prompts: list[str], *arguments: str):
    """Run ``adatree compare`` on the tiny models with ``arguments``; its process, its JSON
    result, the work directory and the marker its servers' environment carries."""
    prompt_file = tmp_path / "tiny-prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out, work = tmp_path / "compare.json", tmp_path / "work"
    command = [
        str(Path(sys.executable).parent / "adatree"),
        "compare",
        "--target", str(tiny_models.target),
        "--draft", str(tiny_models.draft),
        "--candidate-shapes", "0;1,1,2;3,1,4",
        "--prompts", str(prompt_file),
        "--num-requests", str(len(prompts)),
        "--new-tokens", str(NEW_TOKENS),
        "--warmup-requests", "1",
        "--max-total-tokens", "4096",
        "--work-dir", str(work),
        "--out", str(out),
        "--quiet",
        *arguments,
    ]  # fmt: skip
    env = {**os.environ, "ADATREE_COMPARE_TEST": str(tmp_path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=840, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text()), work, f"ADATREE_COMPARE_TEST={tmp_path}"


@pytest.mark.timeout(900)
def test_compare_serves_side_by_side_and_answers_match(tiny_models, tmp_path):
    done, result, work, marker = compare(
        tiny_models,
        tmp_path,
        PROMPTS,
        "--policies",
        "ar,static:3,1,4,adatree@3,1,4",
        "--stage-clock",
    )
    names = [s["name"] for s in result["summary"]]
    assert names == ["ar", "static:3,1,4", "adatree@3,1,4"]
    samples = result["samples"]
    assert len(samples) == 3 * len(PROMPTS)
    # Each prompt went to all three before the next; the order reversed every prompt.
    assert [s["configuration"] for s in samples[:6]] == [*names, *names[::-1]]
    for s in samples:
        assert s["error"] is None and s["output_tokens"] == NEW_TOKENS  # EOS ignored
        assert s["tpot_ms"] > 0 and s["ttft_ms"] > 0
    texts = {(s["configuration"], s["prompt"]): s["text"] for s in samples}
    for p in range(len(PROMPTS)):
        assert texts[("ar", p)] and len({texts[(n, p)] for n in names}) == 1
    ar, static, pinned = result["summary"]
    assert ar["tpot_ratio"] == 1.0 and ar["accept_len"] is None
    for s in (static, pinned):
        assert s["identical"] == s["compared"] == 3 and s["errors"] == 0 and s["prompts"] == 3
        assert s["tpot_ratio"] > 0 and s["accept_len"] >= 1.0
    assert "TPOT / ar" in done.stdout and "adatree@3,1,4" in done.stdout
    # SGLang's stage clock of every server over the prompts: every stage but idle was read as
    # a cost per generated token, largest first, the forward among them. Which stage is the
    # largest is a matter of timing: with the tiny models, polling for requests can cost more
    # per token than the forward.
    clocks = result["stage_clock_ms_per_token"]
    assert list(clocks) == names
    for ms in clocks.values():
        assert ms["run_batch"] > 0
        assert "idle" not in ms and all(v >= 0 for v in ms.values())
        assert list(ms.values()) == sorted(ms.values(), reverse=True)
    assert "stage clock, ms/token" in done.stdout

    # The pinned server read its pin from its own database and ran 3,1,4 on every step.
    with session_scope(f"sqlite:///{work / 'telemetry-adatree@3,1,4.sqlite'}") as session:
        steps = session.execute(
            select(Step.steps, Step.topk, Step.num_draft_tokens, Step.decision_source)
        ).all()
    assert steps and set(steps) == {(3, 1, 4, "pin")}
    assert not (work / "telemetry.sqlite").exists()
    # Its estimates over the prompts, from that database: the warm-up's steps left out, every
    # step's runner-up one of the other candidates, which a pinned server never runs.
    estimates = result["estimates"]
    assert list(estimates) == ["adatree@3,1,4"]
    (shape,) = estimates["adatree@3,1,4"]["shapes"]
    assert shape["shape"] == "3,1,4" and 0 < shape["steps"] < len(steps)
    assert shape["predicted_accept_len"] >= 1.0 and shape["measured_step_ms"] > 0
    rivals = estimates["adatree@3,1,4"]["runner_ups"]
    assert {r["runner_up"] for r in rivals} <= {"0,1,1", "1,1,2"}
    assert sum(r["steps"] for r in rivals) == shape["steps"]
    assert all(r["measured_accept_len"] is None for r in rivals)
    assert "adatree@3,1,4's estimates over the prompts" in done.stdout
    assert processes_with_env(marker) == []


@pytest.mark.timeout(900)
def test_two_servers_of_one_pinned_configuration_each_keep_their_own_pin(tiny_models, tmp_path):
    done, result, work, marker = compare(
        tiny_models, tmp_path, PROMPTS[:2], "--policies", "adatree@3,1,4", "--instances", "2"
    )
    names = [s["name"] for s in result["summary"]]
    assert names == ["adatree@3,1,4", "adatree@3,1,4#2"]
    twin = result["summary"][1]
    assert twin["identical"] == twin["compared"] == 2 and twin["errors"] == 0
    assert "adatree@3,1,4: 2 servers, TPOT / adatree@3,1,4" in done.stdout
    for db in ("telemetry-adatree@3,1,4.sqlite", "telemetry-adatree@3,1,4-2.sqlite"):
        with session_scope(f"sqlite:///{work / db}") as session:
            steps = session.execute(
                select(Step.steps, Step.topk, Step.num_draft_tokens, Step.decision_source)
            ).all()
        assert steps and set(steps) == {(3, 1, 4, "pin")}, db
    assert processes_with_env(marker) == []
