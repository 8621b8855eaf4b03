"""Planned database outages: SQLite made read-only, then deleted and restored; PostgreSQL
stopped and started again.

SQLite, in three moves (``schedule.FaultWindow``):

1. *read-only*: the database file and its WAL are write-protected. File modes do not stop root,
   so as root the files are made immutable (``chattr +i``), which does; otherwise they are
   chmod 444. Every writer's next transaction fails ("attempt to write a readonly database").
2. *deleted*: the write-protected files are copied aside (nothing can change them now, so the
   copy is consistent and holds every committed row), unprotected and deleted: every open
   fails ("unable to open database file"; the store never creates a database, ``mode=rw``).
3. *restored*: the copies go back in place; SQLite replays the WAL on the next open.

A PostgreSQL cluster the soak started itself (``tools.postgres``) is stopped with a fast
shutdown for the whole window and started again. A PostgreSQL URL the soak did not start is
left alone (the report says the fault was skipped).

``heal()`` undoes whatever state a fault left, whatever happened: an interrupted soak must not
leave an immutable or missing database behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Protocol

SUFFIXES = ("", "-wal")  # what SQLite needs to reopen the database; -shm is rebuilt


class DatabaseFaults(Protocol):
    def heal(self) -> None: ...


def _chattr(flag: str, paths: list[Path]) -> bool:
    if not paths or shutil.which("chattr") is None:
        return False
    done = subprocess.run(
        ["chattr", flag, *map(str, paths)], capture_output=True, text=True, check=False
    )
    return done.returncode == 0


class SqliteFaults:
    """Read-only, deleted, restored; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.backup_dir = Path(tempfile.mkdtemp(prefix="adatree-soak-backup-"))
        self.how_read_only = "chattr +i" if os.geteuid() == 0 else "chmod 444"
        self._protected: list[Path] = []
        self._deleted = False

    def _files(self) -> list[Path]:
        return [p for s in SUFFIXES if (p := Path(f"{self.path}{s}")).exists()]

    def read_only(self) -> None:
        files = self._files()
        if os.geteuid() == 0:
            if not _chattr("+i", files):
                raise RuntimeError(
                    f"cannot make {self.path} read-only: chattr +i failed (root ignores file "
                    "modes, so the soak needs a file system with immutable files)"
                )
        else:
            for f in files:
                f.chmod(0o444)
        self._protected = files

    def _unprotect(self) -> None:
        if os.geteuid() == 0:
            _chattr("-i", self._protected)
        for f in self._protected:
            if f.exists():
                f.chmod(0o644)
        self._protected = []

    def delete(self) -> None:
        for f in self._files():
            shutil.copy2(f, self.backup_dir / f.name)
        self._unprotect()
        self._deleted = True
        for s in (*SUFFIXES, "-shm"):
            Path(f"{self.path}{s}").unlink(missing_ok=True)

    def restore(self) -> None:
        if not self._deleted:
            self._unprotect()
            return
        # The WAL goes back before the database, each by an atomic rename: a reader that opens
        # the database finds its WAL beside it, never a database without its newest commits.
        for s in reversed(SUFFIXES):
            saved = self.backup_dir / f"{self.path.name}{s}"
            if saved.exists():
                staged = self.path.parent / f".{saved.name}.restoring"
                shutil.copy2(saved, staged)
                staged.chmod(0o644)
                os.replace(staged, Path(f"{self.path}{s}"))
        self._deleted = False

    def heal(self) -> None:
        self._unprotect()
        if (self._deleted or not self.path.exists()) and any(self.backup_dir.iterdir()):
            self.restore()
        shutil.rmtree(self.backup_dir, ignore_errors=True)


class PostgresFaults:
    """Stops the soak's own cluster for the window and starts it again."""

    def __init__(self, server) -> None:  # tools.postgres.PostgresServer
        self.server = server

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()

    def heal(self) -> None:
        if not self.server.is_running():
            self.server.start()
