"""Real SGLang servers for the end-to-end tests: start, wait until healthy, stop every process.

Servers run in their own process group so that stopping one also stops SGLang's scheduler,
tokenizer and detokenizer children. Their output goes to a log file whose tail is shown when a
server fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# KV pool and model settings shared by every CPU server in the suite: small pools keep several
# servers (and CI's 24 GB) apart.
CPU_FLAGS = (
    "--device",
    "cpu",
    "--disable-cuda-graph",
    "--sleep-on-idle",
    "--dtype",
    "float32",
    "--max-total-tokens",
    "8192",
    "--mem-fraction-static",
    "0.1",
    "--log-level",
    "warning",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Server:
    url: str
    log: Path
    process: subprocess.Popen

    def generate(self, payload: dict, timeout: float = 600) -> list[dict] | dict:
        response = requests.post(f"{self.url}/generate", json=payload, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def server_info(self) -> dict:
        response = requests.get(f"{self.url}/server_info", timeout=30)
        response.raise_for_status()
        return response.json()


def tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@contextmanager
def sglang_server(
    command: Sequence[str],
    log: Path,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> Iterator[Server]:
    """Start ``command`` (which must include ``--port``), wait for ``/health``, yield, stop."""
    port = command[list(command).index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    full_env = {**os.environ, **(env or {})}
    with open(log, "w") as out:
        process = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            cwd=REPO,
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {process.returncode} during start-up:\n{tail(log)}"
                )
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout}s:\n{tail(log)}")
            time.sleep(2)
        yield Server(url=url, log=log, process=process)
    finally:
        _stop(process)


def reference_command(model: Path, port: int) -> list[str]:
    """SGLang's own non-speculative CPU server (torch_native attention, upstream path)."""
    return [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--port",
        str(port),
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        *CPU_FLAGS,
    ]


def adatree_command(target: Path, draft: Path, port: int, *extra: str) -> list[str]:
    """``adatree serve`` on the CPU with the suite's pool settings."""
    return [
        str(VENV_BIN / "adatree"),
        "serve",
        "--model-path",
        str(target),
        "--speculative-draft-model-path",
        str(draft),
        "--port",
        str(port),
        *CPU_FLAGS,
        *extra,
    ]


def run_to_exit(
    command: Sequence[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run a command that is expected to stop by itself (a refused start-up)."""
    return subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=REPO,
        start_new_session=True,
    )
