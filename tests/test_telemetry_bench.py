"""scripts/bench_telemetry.py in its short mode: runs, loses nothing, ends with the exact line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_telemetry.py"
LAST_LINE = re.compile(r"telemetry: rows_per_s=(\d+) enqueue_p99_us=(\d+\.\d+) dropped=(\d+)")


def test_bench_short_mode_prints_the_exact_last_line():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--seconds", "1", "--flood-seconds", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    rows_per_s, _p99, dropped = int(match[1]), float(match[2]), int(match[3])
    assert rows_per_s > 0 and dropped == 0
    assert "1000 steps at 1000/s, 1000 rows in the database" in done.stdout
