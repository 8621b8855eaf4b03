"""``adatree bench`` end to end on tiny models: two real SGLang servers, one after the other,
a JSONL prompt file, a closed-loop and a Poisson load; the JSON rows, the HTML report and the
clean shutdown of every server process are checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_adatree.core.policy import DecisionSource
from sglang_adatree.core.shapes import parse_candidates
from sglang_adatree.tools.bench.results import ROW_FIELDS

pytestmark = pytest.mark.slow

CANDIDATES = "0;1,1,2;3,1,4;2,2,4"
MAX_NEW_TOKENS = 12
PROMPTS = ["The capital of France is", "Write a haiku about rain.", "def add(a, b):"]


def processes_with_env(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (SGLang renames its processes, so
    the command line does not tell servers apart; the inherited environment does)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ.split(b"\0"):
            pids.append(int(proc.name))
    return pids


@pytest.mark.timeout(900)
def test_bench_runs_two_policies_and_writes_rows(tiny_models, tmp_path):
    prompts = tmp_path / "tiny-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out, html, work = tmp_path / "rows.json", tmp_path / "report.html", tmp_path / "work"
    command = [
        str(Path(sys.executable).parent / "adatree"),
        "bench",
        "--target", str(tiny_models.target),
        "--draft", str(tiny_models.draft),
        "--policies", "ar,adatree",
        "--candidate-shapes", CANDIDATES,
        "--prompts", str(prompts),
        "--loads", "c1,r4",
        "--num-requests", "3",
        "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--warmup-requests", "0",
        "--max-total-tokens", "4096",
        "--work-dir", str(work),
        "--out", str(out),
        "--html", str(html),
        "--quiet",
    ]  # fmt: skip
    marker = f"ADATREE_BENCH_TEST={tmp_path}"
    env = {**os.environ, "ADATREE_BENCH_TEST": str(tmp_path)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=840, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    rows = json.loads(out.read_text())
    assert [(r["policy"], r["load"]) for r in rows] == [
        ("ar", "c1"), ("ar", "r4"), ("adatree", "c1"), ("adatree", "r4"),
    ]  # fmt: skip
    candidates = {str(s) for s in parse_candidates(CANDIDATES)}
    for row in rows:
        assert set(ROW_FIELDS) <= set(row)
        assert row["workload"] == "tiny-prompts" and row["num_requests"] == 3
        assert row["errors"] == 0
        assert 0 < row["output_tokens"] <= 3 * MAX_NEW_TOKENS
        assert row["goodput_tok_s"] > 0 and row["ttft_ms_p50"] > 0
        assert 0 < row["tpot_ms_p50"] <= row["tpot_ms_p99"]
        assert row["speedup_vs_ar"] == pytest.approx(
            row["goodput_tok_s"] / next(
                r["goodput_tok_s"] for r in rows if r["policy"] == "ar" and r["load"] == row["load"]
            )
        )  # fmt: skip
    for ar, ada in zip(rows[:2], rows[2:], strict=True):
        # Greedy decoding: both generate the same tokens, so the same number of them.
        assert ar["output_tokens"] == ada["output_tokens"]
        assert ar["accept_len_mean"] == 1.0 and ar["speedup_vs_ar"] == 1.0
        assert ar["num_steps"] == 0 and ar["shapes"] == {}
        # adatree's rows carry its telemetry: the shapes it ran and why.
        assert ada["num_steps"] > 0 and set(ada["shapes"]) <= candidates
        assert sum(ada["shapes"].values()) == ada["num_steps"]
        assert set(ada["decision_sources"]) <= {str(s) for s in DecisionSource}
        assert ada["accept_len_steps"] >= 1.0 and ada["accept_len_mean"] >= 1.0

    meta = json.loads(out.with_suffix(".meta.json").read_text())
    assert set(meta["server_startup_s"]) == {"ar", "adatree"} and meta["failures"] == {}
    page = html.read_text()
    assert "goodput" in page and "shapes chosen over time" in page
    assert "adatree" in done.stdout and "worst point" in done.stdout
    # Every server process (launchers, schedulers, detokenizers) is gone.
    assert processes_with_env(marker) == []
