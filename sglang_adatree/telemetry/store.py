"""Engines, sessions and the schema version of the telemetry database.

* ``get_engine(url)``: one engine per URL for the life of the process.
* ``session_scope(db)``: one managed session that commits, or rolls back on any error.
* ``check_schema_at_head(engine)``: every process that opens the store calls it and refuses to
  start on a missing or outdated schema, naming the fix command; nothing ever calls
  ``create_all`` on a real database.
* ``upgrade(url)``: runs the alembic migrations from code (``adatree db upgrade`` calls it), so
  an installed package migrates without an ``alembic.ini`` or the source tree.

SQLite (the default) gets WAL, a busy timeout, foreign keys and ``synchronous=NORMAL`` on every
connection. A SQLite file is opened read-write but never created here (``mode=rw``): only
``upgrade`` creates one, so a deleted or mistyped database fails loudly instead of coming back
empty. SQLite connections are not pooled, so every checkout sees the file as it is now
(deleted, restored, made read-only); opening one costs tens of microseconds. The URL's
``timeout`` (seconds, pysqlite's own parameter) sets the busy timeout, 5 s by default.
PostgreSQL URLs use psycopg 3 and a pre-pinged pool, so a restarted server is reconnected.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

DEFAULT_BUSY_TIMEOUT_S = 5.0
PG_CONNECT_TIMEOUT_S = 5

_INTERNAL_SQLITE_QUERY = ("mode", "uri")

_engines: dict[str, Engine] = {}
_engines_lock = threading.Lock()


class SchemaError(RuntimeError):
    """The database is missing, behind or ahead of this package's migrations."""


def normalize_url(url: str | URL) -> URL:
    """``postgresql://`` means psycopg 3 here (the driver the package installs)."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def sqlite_path(url: str | URL) -> Path | None:
    """The file of a SQLite URL (also of the ``file:`` form used internally); ``None`` for
    other databases and in-memory SQLite."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    if u.database.startswith("file:"):
        return Path(unquote(u.database.removeprefix("file:")))
    return Path(u.database).expanduser().absolute()


def user_url(url: str | URL) -> URL:
    """The URL as a user writes it: SQLite as ``sqlite:///<absolute path>``, not the internal
    read-write ``file:`` URI that ``get_engine`` builds."""
    u = normalize_url(url)
    path = sqlite_path(u)
    if path is None:
        return u
    query = {k: v for k, v in u.query.items() if k not in _INTERNAL_SQLITE_QUERY}
    return URL.create("sqlite", database=str(path), query=query)


def display_url(url: str | URL) -> str:
    """``user_url`` as text with the password hidden, for messages and the fix command."""
    return user_url(url).render_as_string(hide_password=True)


def get_engine(url: str | URL) -> Engine:
    """The process-wide engine for ``url`` (created on first use)."""
    key = user_url(url).render_as_string(hide_password=False)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = _create_engine(url)
        return engine


def _create_engine(url: str | URL) -> Engine:
    u = user_url(url)
    path = sqlite_path(u)
    if path is not None:
        busy_timeout_s = float(u.query.get("timeout", DEFAULT_BUSY_TIMEOUT_S))
        # mode=rw: open an existing file read-write, never create one (see module docstring).
        rw = URL.create(
            "sqlite+pysqlite",
            database=f"file:{quote(str(path))}",
            query={**u.query, "mode": "rw", "uri": "true"},
        )
        engine = create_engine(rw, poolclass=NullPool, connect_args={"check_same_thread": False})
        _install_sqlite_pragmas(engine, busy_timeout_s)
        return engine
    if u.get_backend_name() == "postgresql":
        return create_engine(
            u,
            pool_pre_ping=True,
            connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S},
        )
    return create_engine(u)


def _install_sqlite_pragmas(engine: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        # WAL lets the dashboard read while the writer writes; NORMAL is durable across
        # application crashes (not power loss) and keeps commits off fsync.
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = NORMAL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()


@contextmanager
def session_scope(db: str | URL | Engine) -> Iterator[Session]:
    """A session that commits when the block ends and rolls back if it raises."""
    engine = db if isinstance(db, Engine) else get_engine(db)
    session = Session(engine, expire_on_commit=False)
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


# ---- schema version and migrations -------------------------------------------------------------


def migrations_dir() -> Path:
    """The alembic script directory: the ``sglang_adatree.migrations`` package."""
    from sglang_adatree import migrations

    # __path__, not __file__: an editable install may expose the package as a namespace.
    for entry in migrations.__path__:
        if (Path(entry) / "env.py").is_file():
            return Path(entry)
    raise SchemaError(f"no alembic env.py in the migrations package at {list(migrations.__path__)}")


def alembic_config() -> Config:
    """An alembic ``Config`` built in code, so no ``alembic.ini`` or source tree is needed."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    return cfg


@cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The revision this package's code expects."""
    heads = _script().get_heads()
    assert len(heads) == 1, f"migrations must have exactly one head, found {heads}"
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    """The database's alembic revision; ``None`` for a database never migrated."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def fix_command(url: str | URL) -> str:
    """The command that brings the database at ``url`` to head."""
    return f"adatree db upgrade --db {display_url(url)}"


def check_schema_at_head(engine: Engine) -> None:
    """Raise ``SchemaError`` naming the fix command unless the schema is at head."""
    shown = display_url(engine.url)
    path = sqlite_path(engine.url)
    if path is not None and not path.exists():
        raise SchemaError(
            f"telemetry database {shown} does not exist: run `{fix_command(engine.url)}`"
        )
    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    if current is None:
        raise SchemaError(
            f"telemetry database {shown} has no schema (this package expects revision {head}): "
            f"run `{fix_command(engine.url)}`"
        )
    if current not in {script.revision for script in _script().walk_revisions()}:
        raise SchemaError(
            f"telemetry database {shown} is at revision {current}, which this sglang-adatree "
            f"does not know (its head is {head}): the database is newer, upgrade the package"
        )
    raise SchemaError(
        f"telemetry database {shown} is at revision {current}, behind head {head}: "
        f"run `{fix_command(engine.url)}`"
    )


def upgrade(url: str | URL, revision: str = "head") -> str | None:
    """Migrate the database at ``url`` to ``revision`` (creating a SQLite file and its
    directory if needed); returns the revision it ends at."""
    return _migrate(url, lambda cfg: command.upgrade(cfg, revision))


def downgrade(url: str | URL, revision: str) -> str | None:
    """Migrate the database at ``url`` down to ``revision`` (``"base"`` drops everything)."""
    return _migrate(url, lambda cfg: command.downgrade(cfg, revision))


def _migrate(url: str | URL, run: Callable[[Config], None]) -> str | None:
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = _migration_engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            run(cfg)
        return current_revision(engine)
    finally:
        engine.dispose()


def _migration_engine(url: str | URL) -> Engine:
    """A one-off engine for migrations; on SQLite it may create the file, runs each migration
    in one real transaction (pysqlite on its own commits before DDL) and turns foreign keys off
    so that batch mode can copy and drop tables without cascading deletes."""
    u = user_url(url)
    if sqlite_path(u) is None:
        return create_engine(u, poolclass=NullPool)
    engine = create_engine(u, poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # the driver's own implicit transactions off
        dbapi_conn.execute("PRAGMA journal_mode = WAL")
        dbapi_conn.execute("PRAGMA foreign_keys = OFF")

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
