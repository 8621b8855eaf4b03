"""``scripts/gpu_step_profile.py`` runs: with ``--tiny`` on this CPU, in a subprocess (scripts are
never imported), and writes a measured profile of the default shapes that loads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, TreeShape
from sglang_adatree.core.step_profile import TableProfile

REPO = Path(__file__).resolve().parent.parent


def test_the_gpu_script_writes_a_profile_on_a_cpu(tmp_path):
    out = tmp_path / "tiny.json"
    # A KV cache of 64 tokens holds a request of context 48 plus 16 new tokens, not two: the
    # passes of batch size 2 at context 48 are not measured but scaled from batch size 1.
    command = [sys.executable, "scripts/gpu_step_profile.py", "--tiny", "--repeats", "3",
               "--kv-tokens", "64", "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "passes measured" in done.stdout

    profile = TableProfile.load(out)
    assert profile.source == "measured"
    assert profile.made_by.startswith("python scripts/gpu_step_profile.py --tiny --repeats 3")
    assert "cpu" in profile.made_by
    assert profile.shapes == DEFAULT_CANDIDATES
    assert profile.batch_sizes == (1, 2) and profile.context_lens == (16, 48)
    notes = profile.notes
    assert notes["device"] == "cpu" and notes["graphs"] is False
    # Every pass a default shape needs (8 verify sizes, 3 draft, 7 extend) at each grid point.
    passes = {(kind, b, t, c): ms for kind, b, t, c, ms in notes["pass_ms"]}
    assert len(passes) == 2 * 2 * (8 + 3 + 7)
    assert {t for k, _, t, _ in passes if k == "draft"} == {1, 2, 4}
    assert notes["passes_measured"] == 72 - 18 and notes["passes_filled"] == 18
    for kind, b, t, c in passes:
        if (b, c) == (2, 48):
            assert passes[kind, b, t, c] == pytest.approx(2 * passes[kind, 1, t, c], rel=1e-3)
    # The deepest tree runs seven passes and the tree's kernels to the plain step's one pass
    # (a looser check than every shape: other processes share this CPU's timings).
    deep = profile.ms[profile.shapes.index(TreeShape(6, 4, 16))]
    assert np.all(deep > profile.ms[profile.shapes.index(NO_SPEC)])
