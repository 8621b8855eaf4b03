"""``adatree profile --concurrency --profile-out`` end to end on tiny models: one real SGLang
server cycling through the shapes at concurrency 1 then 2, its step log (with each batch's
summed context) and the measured step-time profile built from it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_adatree.core.shapes import parse_candidates
from sglang_adatree.lab.profiles import TableProfile
from sglang_adatree.tools.profile import STEP_LOG, parse_concurrency

SHAPES = "0;1,1,2;2,2,4"
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "def add(a, b):"]


def test_concurrency_levels_are_parsed():
    assert parse_concurrency("1,2,4") == (1, 2, 4)
    assert parse_concurrency("3") == (3,)
    for bad in ("0,1", "", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_concurrency(bad)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_profile_at_two_concurrencies_writes_a_measured_profile(tiny_models, tmp_path):
    prompts = tmp_path / "tiny-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    work, out, profile_out = tmp_path / "work", tmp_path / "served.json", tmp_path / "cpu.json"
    command = [
        str(Path(sys.executable).parent / "adatree"), "profile",
        "--target", str(tiny_models.target), "--draft", str(tiny_models.draft),
        "--prompts", str(prompts), "--requests", "3", "--new-tokens", "12",
        "--shapes", SHAPES, "--concurrency", "1,2", "--threads", "1",
        "--work-dir", str(work), "--out", str(out), "--profile-out", str(profile_out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=840, env=os.environ)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "concurrency 2:" in done.stdout and "step-time profile:" in done.stdout

    # The batch-size-1 report is as before; the settings name the concurrencies.
    served = json.loads(out.read_text())
    assert {s["shape"] for s in served["shapes"]} == {"0,1,1", "1,1,2", "2,2,4"}
    assert served["settings"]["concurrency"] == [1, 2]
    # Every logged step carries its batch's summed context.
    steps = [json.loads(line) for line in (work / STEP_LOG).read_text().splitlines()]
    assert all(s["sum_context_len"] >= s["batch_size"] for s in steps)
    assert {s["batch_size"] for s in steps} == {1, 2}

    profile = TableProfile.load(profile_out)
    assert profile.source == "measured" and profile.name == "cpu"
    assert profile.made_by.startswith("adatree profile --target")
    assert "--concurrency 1,2" in profile.made_by and "--profile-out" in profile.made_by
    assert profile.shapes == parse_candidates(SHAPES)
    assert profile.batch_sizes == (1, 2)
    notes = profile.notes
    assert notes["rows"] > 0 and notes["cells_measured"] > 0
    assert notes["threads"] == 1 and notes["step_log"] == STEP_LOG
