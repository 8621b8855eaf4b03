"""One SGLang server at a time: start it, wait until it answers, read its state, stop it all.

A server runs in its own session (process group), so stopping it reaches SGLang's scheduler,
tokenizer and detokenizer children too: SIGTERM to the group, then SIGKILL to whatever is left
after a grace period. Its output goes to a log file whose tail is quoted when start-up fails.
Servers are stopped on every exit path, Ctrl-C included, so two never hold memory at once.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests


class ServerError(RuntimeError):
    """A server that exited or never became healthy; the message carries its log's tail."""


# Ports the kernel hands out for outgoing connections (Linux's default range): a server port
# chosen there can be taken by a client socket before the server binds it, which SGLang does
# only after loading its models; with several servers up and requests flowing, it happened.
EPHEMERAL_PORTS = (32768, 60999)
SERVER_PORTS = (20000, 32000)


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return EPHEMERAL_PORTS


def free_port() -> int:
    """A TCP port nothing listens on right now, outside the ephemeral range where possible."""
    lo, hi = ephemeral_range()
    candidates = [p for p in range(*SERVER_PORTS) if not lo <= p <= hi]
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # all taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What SGLang's launcher logs when the kernel killed one of its processes (signal 9).
_KILLED = "exit code -9"


def how_it_ended(process: subprocess.Popen, log: Path) -> str:
    """``exited with code N`` or ``ended by signal N``; a kill by signal 9 of the server or of
    a process it started (on Linux most often the out-of-memory killer, when the servers
    started together outgrow the machine's memory) says so."""
    code = process.returncode
    how = f"exited with code {code}" if code is None or code >= 0 else f"ended by signal {-code}"
    if code == -signal.SIGKILL or _KILLED in log_tail(log):
        how += (
            "; a process of it was killed by signal 9, on Linux most often by the "
            "out-of-memory killer: start fewer servers at once (fewer policies or --instances)"
        )
    return how


def exit_report(process: subprocess.Popen, log: Path) -> str:
    """How a server's process ended, and its log's tail."""
    return f"{how_it_ended(process, log)}; log {log}:\n{log_tail(log)}"


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


@dataclass(frozen=True)
class Server:
    """A healthy server: its URL, process and log."""

    url: str
    process: subprocess.Popen
    log: Path
    startup_s: float

    def check_alive(self, name: str) -> None:
        """Raise ``ServerError`` if the server's process has ended: a server that was healthy
        can still die later, as when another one started after it takes its memory."""
        if self.process.poll() is not None:
            raise ServerError(f"{name}: the server {exit_report(self.process, self.log)}")

    def info(self) -> dict[str, Any]:
        """``GET /server_info``: the resolved server arguments and ``internal_states``."""
        response = requests.get(f"{self.url}/server_info", timeout=60)
        response.raise_for_status()
        return response.json()

    def internal_state(self) -> dict[str, Any]:
        """The first data-parallel rank's live state (adatree's fields live here)."""
        states = self.info().get("internal_states") or [{}]
        return states[0]


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is still alive in it.

    The SIGKILL is sent even when the grace period is cut short (a second Ctrl-C, a SIGTERM
    from ``timeout`` after one from the user): the group must not outlive the caller.
    """
    try:
        if process.poll() is None:
            with suppress(ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=grace_s)
    finally:
        # The launcher may exit before its children: kill whatever is left in the group.
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    if process.poll() is None:
        process.wait(timeout=grace_s)


def wait_healthy(
    url: str, process: subprocess.Popen, log: Path, timeout_s: float, health_path: str = "/health"
) -> None:
    """Poll ``health_path`` until it answers 200; raise with the log's tail if the server dies."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise ServerError(f"during start-up the server {exit_report(process, log)}")
        try:
            if requests.get(f"{url}{health_path}", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            if "address already in use" in log_tail(log, 5):
                # SGLang logs the failed bind but its processes stay up: do not wait them out.
                raise ServerError(
                    f"{url}: the port was taken before the server could listen on it; "
                    f"log {log}:\n" + log_tail(log)
                ) from None
        if time.monotonic() > deadline:
            raise ServerError(
                f"server not healthy after {timeout_s:.0f} s; log {log}:\n" + log_tail(log)
            )
        time.sleep(1.0)


@contextmanager
def running_server(
    command: Sequence[str],
    env: Mapping[str, str],
    port: int,
    log: Path,
    timeout_s: float = 900.0,
    health_path: str = "/health",
) -> Iterator[Server]:
    """Start ``command`` (listening on ``port``), yield it once ``health_path`` answers 200
    (SGLang's ``/health``; the dashboard's ``/login``), always stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log, timeout_s, health_path)
        yield Server(url, process, log, time.monotonic() - started)
    finally:
        stop_process_group(process)
