"""``adatree demo`` end to end with a small request count: models, SGLang, dashboard, summary."""

from __future__ import annotations

import socket
import sys

import pytest
from sglang_servers import free_port, run_to_exit

pytestmark = pytest.mark.slow


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_demo_runs_end_to_end_and_leaves_nothing_running(tmp_path):
    port, admin_port = free_port(), free_port()
    env = {
        "ADATREE_DB_URL": f"sqlite:///{tmp_path / 'demo.sqlite'}",
        "ADATREE_ADMIN_TOKEN": "demo-test-token",
    }
    command = [
        sys.executable, "-m", "sglang_adatree.cli", "demo", "--requests", "3",
        "--max-new-tokens", "16", "--no-wait", "--port", str(port),
        "--admin-port", str(admin_port),
    ]  # fmt: skip
    result = run_to_exit(command, env=env, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert f"dashboard: http://127.0.0.1:{admin_port}/  token: demo-test-token" in out
    assert "adatree demo summary" in out and "shapes used" in out
    summary = out[out.index("adatree demo summary") :]
    assert "requests            3" in summary
    assert "acceptance length" in summary and "goodput" in summary
    assert not _listening(port) and not _listening(admin_port)
