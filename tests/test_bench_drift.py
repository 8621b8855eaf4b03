"""scripts/bench_drift.py, short: the served loop against the static shapes on one seed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_drift.py"
SUMMARY = re.compile(
    r"(with drift|without drift) +adatree / best static: median (\d\.\d+) \(min (\d\.\d+), "
    r"max (\d\.\d+)\); steps on the best static shape: median (\d+)%"
)


def test_short_run_reports_both_cost_models_against_the_best_static_shape():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--seeds", "1", "--steps", "600", "--drift", "0.2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    found = {m[1]: float(m[2]) for m in SUMMARY.finditer(done.stdout)}
    assert set(found) == {"with drift", "without drift"}, done.stdout
    # The simulation is seeded end to end (no clock is read): the loop, warm-up and
    # exploration included, stays close to the best static shape over 600 steps, never above
    # what the best fixed shape could do by more than noise.
    for ratio in found.values():
        assert 0.8 < ratio < 1.05, done.stdout
    assert "best static shapes: ['2,2,4']" in done.stdout
