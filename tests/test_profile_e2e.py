"""``adatree profile --concurrency --profile-out`` end to end on tiny models: one real SGLang
server cycling through the shapes at concurrency 1 then 2, its step log (with each batch's
summed context) and the measured step-time profile built from it; then an adatree server
started with that profile as its ``step_time_profile``: it prices its steps by the profile and
its greedy answers are SGLang's non-speculative ones."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_servers import adatree_command, free_port, reference_command, sglang_server
from sqlalchemy import select

from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.shapes import TreeShape, parse_candidates
from sglang_adatree.core.step_profile import TableProfile
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.store import get_engine, upgrade
from sglang_adatree.tools.profile import STEP_LOG, parse_concurrency

SHAPES = "0;1,1,2;2,2,4"
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "def add(a, b):"]


def test_concurrency_levels_are_parsed():
    assert parse_concurrency("1,2,4") == (1, 2, 4)
    assert parse_concurrency("3") == (3,)
    for bad in ("0,1", "", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_concurrency(bad)


@pytest.fixture(scope="module")
def profiled(tiny_models, tmp_path_factory) -> tuple[Path, Path, Path, str]:
    """``adatree profile`` run once: (work dir, report, profile file, its stdout)."""
    tmp_path = tmp_path_factory.mktemp("profile")
    prompts = tmp_path / "tiny-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    work, out, profile_out = tmp_path / "work", tmp_path / "served.json", tmp_path / "cpu.json"
    command = [
        str(Path(sys.executable).parent / "adatree"), "profile",
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--prompts", str(prompts), "--requests", "3", "--new-tokens", "24",
        "--shapes", SHAPES, "--concurrency", "1,2", "--threads", "1", "--run-steps", "3",
        "--work-dir", str(work), "--out", str(out), "--profile-out", str(profile_out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=840, env=os.environ)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work, out, profile_out, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_profile_at_two_concurrencies_writes_a_measured_profile(profiled):
    work, out, profile_out, stdout = profiled
    assert "concurrency 2:" in stdout and "step-time profile:" in stdout

    # The batch-size-1 report is as before; the settings name the concurrencies.
    served = json.loads(out.read_text())
    assert {s["shape"] for s in served["shapes"]} == {"0,1,1", "1,1,2", "2,2,4"}
    assert served["settings"]["concurrency"] == [1, 2]
    # Every logged step carries its batch's summed context.
    steps = [json.loads(line) for line in (work / STEP_LOG).read_text().splitlines()]
    assert all(s["sum_context_len"] >= s["batch_size"] for s in steps)
    assert {s["batch_size"] for s in steps} == {1, 2}
    # Steps without speculation run as the server serves them: the target's plain decode, the
    # draft's extend skipped (one forward, none of the draft's), a catch-up step after each run.
    plain = [s for s in steps if s["shape"] == "0,1,1" and s["source"] != "catch-up"]
    assert plain and all(s["forward_calls"] == 1 and s["draft_forward_ms"] == 0 for s in plain)
    assert any(s["source"] == "catch-up" for s in steps)
    # Each shape runs three steps in a row; the first of each run, right after another shape,
    # is left out of the report and the profile.
    assert any(s["previous_shape"] == s["shape"] for s in steps[1:])
    assert all(s["previous_shape"] is not None for s in steps[1:])

    profile = TableProfile.load(profile_out)
    assert profile.source == "measured" and profile.name == "cpu"
    assert profile.made_by.startswith("adatree profile --target")
    assert "--concurrency 1,2" in profile.made_by and "--profile-out" in profile.made_by
    assert profile.shapes == parse_candidates(SHAPES)
    assert profile.batch_sizes == (1, 2)
    notes = profile.notes
    assert notes["rows"] > 0 and notes["cells_measured"] > 0
    assert notes["threads"] == 1 and notes["run_steps"] == 3 and notes["step_log"] == STEP_LOG


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_server_started_with_the_profile_prices_its_steps_by_it(profiled, tiny_models, tmp_path):
    profile_out = profiled[2]
    profile = TableProfile.load(profile_out)
    request = {
        "text": PROMPTS,
        "sampling_params": {"max_new_tokens": 16, "temperature": 0},
    }
    with sglang_server(
        reference_command(tiny_models.target, free_port()), tmp_path / "reference.log"
    ) as server:
        reference = [r["output_ids"] for r in server.generate(request)]
    url = f"sqlite:///{tmp_path / 'adatree.sqlite'}"
    upgrade(url)
    env = {"ADATREE_DB_URL": url, "ADATREE_TELEMETRY_FLUSH_S": "0.05"}
    command = adatree_command(
        tiny_models.target,
        tiny_models.draft,
        free_port(),
        "--candidate-shapes",
        SHAPES,
        "--step-time-profile",
        str(profile_out),
    )
    log = tmp_path / "adatree.log"
    with sglang_server(command, log, env=env) as server:
        answers = [r["output_ids"] for r in server.generate(request)]
    assert answers == reference
    with get_engine(url).connect() as conn:
        run = conn.execute(select(Run)).one()
        first = conn.execute(
            select(Step).where(Step.decision_source != "catch-up").order_by(Step.step_index)
        ).first()
    assert run.config["step_time_profile"] == str(profile_out)
    # The first decision is priced before any step was measured: the profile's own time.
    features = StepFeatures(
        first.batch_size, first.padded_batch_size, first.sum_context_len, first.max_context_len
    )
    shape = TreeShape(first.steps, first.topk, first.num_draft_tokens)
    assert first.predicted_step_ms == pytest.approx(profile.step_ms(features, shape), rel=1e-6)
