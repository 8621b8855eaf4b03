"""A throw-away PostgreSQL cluster for the tests and ``adatree soak --db postgresql``: Debian's
binaries, a data directory under a temporary folder, listening on loopback only, trust
authentication.

PostgreSQL refuses to run as root, so when the tests run as root the server's files belong to
an unprivileged account (``postgres`` if the package created it, else ``nobody``) and its
commands run through ``runuser``. ``PostgresServer.find()`` returns ``None`` when the binaries
are absent (``make test`` installs them); tests then skip with that reason.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

SUPERUSER = "adatree"


def find_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<major>/bin`` with ``initdb``, or ``None``."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parent.parent.name),
    )
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """``start()``, ``stop()``, ``create_database()``; ``url(db)`` for SQLAlchemy (psycopg 3)."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="adatree-pg-"))
        self.data_dir = self.root / "data"
        self.log_file = self.root / "server.log"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres" if _has_user("postgres") else "nobody"
            entry = pwd.getpwnam(self._user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._pg(
            "initdb",
            "-D",
            str(self.data_dir),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
            "--no-instructions",
        )

    @classmethod
    def find(cls) -> PostgresServer | None:
        bin_dir = find_bin_dir()
        return cls(bin_dir) if bin_dir is not None else None

    def _pg(self, program: str, *args: str, timeout: float = 60.0) -> str:
        cmd = [str(self.bin_dir / program), *args]
        if self._user is not None:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root, check=False
        )
        if done.returncode != 0:
            log = self.log_file.read_text() if self.log_file.exists() else ""
            raise RuntimeError(f"{program} failed: {done.stdout}{done.stderr}\n{log[-2000:]}")
        return done.stdout

    def start(self) -> None:
        # Loopback TCP only; the socket directory is ours too, so nothing touches /var/run.
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._pg(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_file),
            "-o",
            options,
            "-w",
            "start",
        )

    def stop(self) -> None:
        """Fast shutdown: open client connections are cut, as in a real outage."""
        self._pg("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")

    def is_running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new, empty database; returns its URL."""
        name = "t_" + uuid.uuid4().hex[:12]
        self._pg(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            SUPERUSER,
            "-d",
            "postgres",
            "-q",
            "-c",
            f"CREATE DATABASE {name}",
        )
        return self.url(name)

    def close(self) -> None:
        if self.is_running():
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
