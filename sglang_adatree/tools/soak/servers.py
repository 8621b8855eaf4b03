"""The processes a soak runs: the adatree server and the reference ``ar`` server, launched as
``adatree bench`` launches its configurations (``bench.configurations``) so that the reference
is the same SGLang on the same CPU path without speculation, and the dashboard
(``adatree admin``). They start side by side; each is stopped with its whole process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_adatree.tools.bench.configurations import (
    Models,
    ServerSettings,
    detect_draft_kind,
    parse_configuration,
)
from sglang_adatree.tools.bench.servers import (
    ServerError,
    free_port,
    stop_process_group,
    wait_healthy,
)

START_TIMEOUT_S = 900.0


@dataclass
class Process:
    """A launched server: its URL, process, log, and whether ``/health`` (or the dashboard's
    ``/login``) answered."""

    name: str
    url: str
    process: subprocess.Popen
    log: Path
    health_path: str = "/health"
    error: str | None = None

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until healthy; raises ``ServerError`` with the log's tail if it is not."""
        try:
            wait_healthy(self.url, self.process, self.log, timeout_s, self.health_path)
        except ServerError as exc:
            self.error = str(exc)
            raise

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        stop_process_group(self.process)


def launch(
    name: str,
    command: list[str],
    env: dict[str, str],
    port: int,
    log: Path,
    health_path: str = "/health",
) -> Process:
    """Start ``command`` in its own session; returns at once (``wait_ready`` waits)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    return Process(name, f"http://127.0.0.1:{port}", process, log, health_path)


@dataclass(frozen=True)
class ServerPlan:
    """Both SGLang servers' commands for the bundled pair."""

    models: Models
    settings: ServerSettings
    candidates: str

    @classmethod
    def for_models(cls, target: Path, draft: Path, threads: int, candidates: str) -> ServerPlan:
        models = Models(target, draft, detect_draft_kind(draft))
        # --enable-metrics on both: the adatree series are part of what the soak watches, and
        # the reference pays for the same HTTP metrics path.
        settings = ServerSettings(threads=threads, extra_args=("--enable-metrics",))
        return cls(models, settings, candidates)

    def start(self, name: str, work: Path, db_url: str | None, env: dict[str, str]) -> Process:
        """``name`` is ``ar`` or ``adatree``."""
        from sglang_adatree.core.shapes import parse_candidates

        config = parse_configuration(
            name, self.models.draft_kind, parse_candidates(self.candidates)
        )[0]
        port = free_port()
        command = config.command(self.models, self.settings, port, db_url)
        return launch(
            name, command, {**config.env(self.settings), **env}, port, work / f"{name}.log"
        )


def start_dashboard(db_url: str, token: str, work: Path) -> Process:
    port = free_port()
    command = [sys.executable, "-m", "sglang_adatree.cli", "admin", "--db", db_url,
               "--host", "127.0.0.1", "--port", str(port), "--threads", "8"]  # fmt: skip
    return launch(
        "dashboard",
        command,
        {"ADATREE_ADMIN_TOKEN": token, "PYTHONUNBUFFERED": "1"},
        port,
        work / "dashboard.log",
        health_path="/login",
    )
