"""``kill -9`` of a real adatree server while its telemetry writer commits rows every few
milliseconds: the SQLite file still passes ``PRAGMA integrity_check``, every row written
before the kill is whole, and the next start records a new run and goes on writing.

SQLite in WAL mode with ``synchronous=NORMAL`` (``telemetry.store``) is durable across
application crashes: a transaction the kill cut short is rolled back when the file is next
opened, and the committed ones are there.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time

import pytest
import requests
from sglang_servers import adatree_command, free_port, sglang_server

from sglang_adatree.telemetry.store import sqlite_path, upgrade

pytestmark = pytest.mark.slow

# A flush every 10 ms in batches of 4: the writer is inside a transaction much of the time.
ENV = {
    "ADATREE_TELEMETRY_FLUSH_S": "0.01",
    "ADATREE_TELEMETRY_BATCH_SIZE": "4",
    "ADATREE_CONTROL_POLL_S": "0.2",
}
PROMPT = "Once upon a time, in a quiet village by the sea,"


def _count(path, sql: str, *args) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute(sql, args).fetchone()[0])


def _keep_generating(url: str, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            requests.post(
                f"{url}/generate",
                json={"text": PROMPT, "sampling_params": {"max_new_tokens": 64, "temperature": 0}},
                timeout=60,
            )
        except requests.RequestException:
            return  # the server is gone


def _wait_rows(path, run_id: int, at_least: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        n = _count(path, "SELECT count(*) FROM steps WHERE run_id = ?", run_id)
        if n >= at_least:
            return n
        assert time.monotonic() < deadline, f"run {run_id} wrote {n} rows, wanted {at_least}"
        time.sleep(0.1)


def test_kill_9_while_writing_leaves_a_sound_database(tiny_models, tmp_path):
    url = f"sqlite:///{tmp_path / 'adatree.sqlite'}"
    upgrade(url)
    path = sqlite_path(url)
    env = {**ENV, "ADATREE_DB_URL": url}

    def command():
        return adatree_command(tiny_models.target, tiny_models.draft, free_port())

    with sglang_server(command(), tmp_path / "first.log", env=env) as server:
        first_run = server.server_info()["internal_states"][0]["adatree_run_id"]
        stop = threading.Event()
        clients = [
            threading.Thread(target=_keep_generating, args=(server.url, stop)) for _ in range(2)
        ]
        for t in clients:
            t.start()
        try:
            _wait_rows(path, first_run, 200)
            # Every process of the server at once, as the kernel's OOM killer or a power
            # switch would: no handler, atexit hook or flush runs.
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=30)
        finally:
            stop.set()
            for t in clients:
                t.join(timeout=90)

    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        rows_before = conn.execute(
            "SELECT count(*), count(DISTINCT step_index) FROM steps WHERE run_id = ?",
            (first_run,),
        ).fetchone()
        stopped = conn.execute("SELECT stopped_at FROM runs WHERE id = ?", (first_run,))
        assert stopped.fetchone()[0] is None  # killed: never marked stopped
    assert rows_before[0] == rows_before[1] >= 200  # no duplicate or torn rows

    with sglang_server(command(), tmp_path / "second.log", env=env) as server:
        second_run = server.server_info()["internal_states"][0]["adatree_run_id"]
        assert second_run > first_run
        server.generate({"text": PROMPT, "sampling_params": {"max_new_tokens": 16}})
        _wait_rows(path, second_run, 1, timeout=30)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    assert _count(path, "SELECT count(*) FROM steps WHERE run_id = ?", first_run) == rows_before[0]
