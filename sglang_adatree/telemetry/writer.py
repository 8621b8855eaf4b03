"""The background telemetry writer: ``record(StepRecord)`` from the decode loop, batched inserts on
a thread of its own.

Hot path: ``record`` appends the frozen record to a bounded ``collections.deque`` and returns; it
does no I/O and takes no lock that the writer holds across I/O. On a full queue it
**drops the newest record** (the one being offered) and counts the drop per run: the queue then
always holds the oldest unwritten steps of each run, gap-free, so a dashboard sees one hole at the
end of an outage instead of holes scattered through it. Several producers may race past the
length check together, so the queue can exceed its bound by at most the number of producers.

Writer thread: writes every ``flush_s`` while rows are queued, and at once when ``record`` has
filled a batch (the one time it signals the thread); each batch of up to ``batch_size`` rows is
one transaction (``executemany`` of plain tuples; ``COPY`` on PostgreSQL). It shares the
serving process's cores with the decode loop, so it sleeps between writes instead of checking
the queue, and on SQLite it keeps one idle connection open while writes succeed: the last
connection to a WAL database checkpoints the WAL into the database file and deletes it as it
closes, which would make every batch pay for a checkpoint.
Drop and reject counts, and the decode steps that never finished (``count_unfinished``), go into
``runs.dropped_steps`` / ``runs.rejected_steps`` / ``runs.unfinished_steps`` in the same
transaction as the next batch, so they survive the process. While the database is locked,
read-only, missing or down, writes fail; the writer keeps the failed batch, retries with capped
exponential backoff, lets the queue fill to its bound (at most ``queue_size + batch_size`` records
are held) and catches up once the database is back. Rows the database refuses for good
(constraint or data errors) are retried one by one; the refused ones are counted as rejected.

``close()`` (and interpreter exit, through ``atexit``) flushes what is left, retrying until its
timeout; records still unwritten then are counted as lost and logged.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, insert, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError

from sglang_adatree.config import DEFAULTS, AdaTreeConfig
from sglang_adatree.telemetry import retention
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.records import (
    STEP_COLUMNS,
    RunRecord,
    StepRecord,
    config_json,
    step_row,
)
from sglang_adatree.telemetry.store import (
    check_schema_at_head,
    display_url,
    get_engine,
    sqlite_path,
)

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.05
ROLLUP_EVERY_S = 600.0
# Whether the write check can ask as the process's effective user (the one that opens files).
EFFECTIVE_IDS = os.access in os.supports_effective_ids
# Errors that one bad row causes; anything else (locked, read-only, missing, down, no schema)
# is the database's state and is retried.
ROW_ERRORS = (IntegrityError, DataError)


@dataclass(frozen=True)
class WriterStats:
    """Counters since the writer started. Every record offered to ``record()`` is, at any
    moment, exactly one of: queued, written, dropped, rejected or lost."""

    queued: int  # records held, not yet written: the queue and the batch being written
    written: int  # rows committed
    dropped: int  # records dropped on a full queue (or after close)
    rejected: int  # records the database refused (constraint / data errors)
    lost: int  # records close() could not write before its timeout
    failures: int  # failed write attempts, each retried after a backoff
    last_error: str | None
    down: bool = False  # the latest write attempt failed and none has succeeded since


class TelemetryWriter:
    """Bounded queue + background batch writer for ``steps`` rows; see the module docstring."""

    def __init__(
        self,
        db: str | Engine,
        *,
        queue_size: int = DEFAULTS["telemetry_queue_size"],
        batch_size: int = DEFAULTS["telemetry_batch_size"],
        flush_s: float = DEFAULTS["telemetry_flush_s"],
        backoff_max_s: float = 5.0,
        retention_hours: float | None = None,
    ) -> None:
        """Raises ``store.SchemaError`` (naming the fix command) unless the schema is at head."""
        assert queue_size >= 1 and batch_size >= 1 and flush_s > 0 and backoff_max_s > 0
        self._engine = db if isinstance(db, Engine) else get_engine(db)
        check_schema_at_head(self._engine)
        self._queue: deque[StepRecord] = deque()
        self._queue_size = queue_size
        self._batch_size = batch_size
        self._flush_s = flush_s
        self._backoff_max_s = backoff_max_s
        self._retention_s = None if retention_hours is None else retention_hours * 3600.0
        self._next_rollup = time.monotonic()
        self._insert_sql = steps_insert_sql(self._engine)
        self._copy_sql = steps_copy_sql(self._engine)
        # Producer side: drops and unfinished steps per run not yet handed to the writer thread.
        self._drops: dict[int, int] = {}
        self._unfinished: dict[int, int] = {}
        self._drops_lock = threading.Lock()
        # Writer side: the batch being written and counts not yet persisted. _move_lock makes
        # "queue -> batch" atomic for flush(), which must not see a record in neither.
        self._batch: list[StepRecord] = []
        self._move_lock = threading.Lock()
        self._unsaved_drops: dict[int, int] = {}
        self._unsaved_rejects: dict[int, int] = {}
        self._unsaved_unfinished: dict[int, int] = {}
        self._written = self._dropped = self._rejected = self._lost = self._failures = 0
        self._last_error: str | None = None
        self._down_since: float | None = None
        self._closed = False
        self._close_deadline = 0.0
        self._flush_requested = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        # SQLite: an idle connection held while writes succeed, so that no batch's connection
        # is the last to close (``_hold_open``), and the file it opened (device, inode).
        self._path = sqlite_path(self._engine.url)
        self._keeper: Any = None
        self._kept_file: tuple[int, int] | None = None
        self._thread = threading.Thread(target=self._run, name="adatree-telemetry", daemon=True)
        self._thread.start()
        self._atexit_hook = _close_at_exit_hook(self)
        atexit.register(self._atexit_hook)

    @classmethod
    def from_config(cls, config: AdaTreeConfig) -> TelemetryWriter:
        """A writer for ``config.resolved_db_url`` sized by the ``telemetry_*`` settings."""
        return cls(
            config.resolved_db_url,
            queue_size=config.telemetry_queue_size,
            batch_size=config.telemetry_batch_size,
            flush_s=config.telemetry_flush_s,
            retention_hours=config.retention_hours,
        )

    # ---- decode loop ---------------------------------------------------------------------------

    def record(self, rec: StepRecord) -> bool:
        """Queue one step record; ``False`` if it was dropped. Never blocks, never raises."""
        queue = self._queue
        if len(queue) < self._queue_size and not self._closed:
            queue.append(rec)
            if len(queue) == self._batch_size:
                self._wake.set()
            return True
        with self._drops_lock:
            self._drops[rec.run_id] = self._drops.get(rec.run_id, 0) + 1
            self._dropped += 1
        return False

    def count_unfinished(self, run_id: int, count: int) -> None:
        """Count decode steps of ``run_id`` that were launched but never finished (their
        outcome never came back, so they have no row). Never blocks, never raises."""
        with self._drops_lock:
            self._unfinished[run_id] = self._unfinished.get(run_id, 0) + count

    # ---- start-up and shutdown -----------------------------------------------------------------

    def start_run(self, run: RunRecord) -> int:
        """Insert the ``runs`` row for this server start and return its id (raises if the
        database is unreachable: a server should not start without its telemetry)."""
        values: dict[str, Any] = {
            "started_at": time.time() if run.started_at is None else run.started_at,
            "target_model": run.target_model,
            "draft_model": run.draft_model,
            "device": run.device,
            "sglang_version": run.sglang_version,
            "package_version": run.package_version,
            "config": config_json(run.config),
            "node": run.node,
            "rank": run.rank,
            "dropped_steps": 0,
            "rejected_steps": 0,
            "unfinished_steps": 0,
        }
        with self._engine.begin() as conn:
            return int(conn.execute(insert(Run).values(values).returning(Run.id)).scalar_one())

    def stop_run(self, run_id: int, timeout: float = 10.0) -> bool:
        """Flush, then set ``stopped_at``; ``False`` (and a warning) if the database refused."""
        drained = self.flush(timeout)
        try:
            with self._engine.begin() as conn:
                conn.execute(update(Run).where(Run.id == run_id).values(stopped_at=time.time()))
        except Exception as exc:
            log.warning("telemetry: could not mark run %s stopped: %s", run_id, exc)
            return False
        return drained

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything queued so far; ``True`` if done within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        self._flush_requested = True
        self._wake.set()
        while not self._drained():
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 10.0) -> WriterStats:
        """Stop accepting records, write what is queued (retrying up to ``timeout`` s) and stop
        the thread. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close_deadline = time.monotonic() + timeout
            self._stop.set()
            self._wake.set()
            atexit.unregister(self._atexit_hook)
        self._thread.join(timeout + 1.0)
        return self.stats()

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def queue_size(self) -> int:
        return self._queue_size

    @property
    def queued(self) -> int:
        """Records waiting in the queue now."""
        return len(self._queue)

    def stats(self) -> WriterStats:
        """A consistent snapshot of the counters. It waits at most for a batch to move from
        the queue (never for I/O); ``record()`` never waits for it."""
        with self._move_lock, self._drops_lock:
            return WriterStats(
                queued=len(self._queue) + len(self._batch),
                written=self._written,
                dropped=self._dropped,
                rejected=self._rejected,
                lost=self._lost,
                failures=self._failures,
                last_error=self._last_error,
                down=self._down_since is not None,
            )

    def __enter__(self) -> TelemetryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- writer thread -------------------------------------------------------------------------

    def _drained(self) -> bool:
        with self._move_lock:
            return not (
                self._queue
                or self._batch
                or self._drops
                or self._unfinished
                or self._unsaved_drops
                or self._unsaved_rejects
                or self._unsaved_unfinished
            )

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._let_go()

    def _loop(self) -> None:
        delay = 0.0
        last_write = time.monotonic()
        while True:
            closing = self._stop.is_set()
            now = time.monotonic()
            due = (
                closing
                or self._flush_requested
                or len(self._queue) >= self._batch_size
                or (now - last_write >= self._flush_s and not self._drained())
            )
            if due:
                self._flush_requested = False
                try:
                    self._write_pending()
                except Exception as exc:
                    self._let_go()
                    self._failed(exc)
                    delay = min(max(2 * delay, BACKOFF_MIN_S), self._backoff_max_s)
                    if closing and time.monotonic() + delay > self._close_deadline:
                        self._give_up()
                        return
                    self._wake.wait(delay)
                    self._wake.clear()
                    continue
                delay = 0.0
                last_write = time.monotonic()
                if closing:
                    return
                self._hold_open()
                if self._retention_s is not None and last_write >= self._next_rollup:
                    self._rollup()
            # Until the next write is due; ``record`` wakes the thread when a batch is full.
            # Checked after the clear, so a wake between the check and the wait is not lost.
            wait = last_write + self._flush_s - time.monotonic()
            self._wake.wait(wait if wait > 0 else self._flush_s)
            self._wake.clear()

    def _write_pending(self) -> None:
        """Write batches until the queue is empty; raises on a database that cannot take them."""
        self._check_kept()
        with self._engine.connect() as conn:
            while True:
                self._fill_batch()
                if not (
                    self._batch
                    or self._unsaved_drops
                    or self._unsaved_rejects
                    or self._unsaved_unfinished
                ):
                    return
                try:
                    with conn.begin():
                        if self._batch:
                            self._insert_batch(conn, [step_row(r) for r in self._batch])
                        self._save_counts(conn)
                except ROW_ERRORS:
                    self._write_one_by_one(conn)
                    continue
                self._counts_saved()
                self._recovered()  # before the batch leaves: a drained writer is not down
                with self._move_lock:
                    self._written += len(self._batch)
                    self._batch.clear()

    def _hold_open(self) -> None:
        """On SQLite, open the idle connection if it is not open (after a successful write).

        It has read the database (its connect pragmas), so it holds the WAL index open, and a
        batch's connection closing is no longer the last: the WAL is checkpointed as it grows
        (``wal_autocheckpoint``), not at every batch. It holds no transaction, so it blocks
        neither checkpoints nor other writers. ``_check_kept`` lets it go before a batch
        whenever the file is no longer the one it opened, or no longer writable."""
        if self._keeper is not None or self._path is None:
            return
        try:
            st = os.stat(self._path)
            self._keeper = self._engine.raw_connection()
        except Exception as exc:  # only a cost: each batch then checkpoints as it closes
            log.debug("telemetry: no idle connection held: %s", exc)
            return
        self._kept_file = (st.st_dev, st.st_ino)

    def _check_kept(self) -> None:
        """Let the idle connection go unless the database file is still the one it opened and
        still writable: then the batch's own connection is the only one, and a database made
        read-only, deleted or replaced fails it as it would without the idle one (SQLite lets
        a second connection of the process write through the first one's file however the
        file's permissions changed since)."""
        if self._keeper is None:
            return
        assert self._path is not None
        try:
            st = os.stat(self._path)
            same = (st.st_dev, st.st_ino) == self._kept_file and os.access(
                self._path, os.W_OK, effective_ids=EFFECTIVE_IDS
            )
        except OSError:
            same = False
        if not same:
            self._let_go()

    def _let_go(self) -> None:
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            try:
                keeper.close()
            except Exception as exc:
                log.debug("telemetry: closing the idle connection: %s", exc)

    def _insert_batch(self, conn: Connection, rows: list[tuple[Any, ...]]) -> None:
        if self._copy_sql is None:
            conn.exec_driver_sql(self._insert_sql, rows)
            return
        # PostgreSQL: COPY costs the serving process about a third of the CPU per row that
        # executemany does. It runs on the raw driver connection, inside the same transaction,
        # so its errors are translated to SQLAlchemy's classes here (ROW_ERRORS among them).
        dbapi_error = self._engine.dialect.loaded_dbapi.Error
        try:
            with conn.connection.driver_connection.cursor() as cur, cur.copy(self._copy_sql) as cp:
                for row in rows:
                    cp.write_row(row)
        except dbapi_error as exc:
            raise DBAPIError.instance(self._copy_sql, None, exc, dbapi_error) from exc

    def _fill_batch(self) -> None:
        """Move up to a batch of records, and the producers' drop counts, to the writer side."""
        with self._move_lock:
            batch, queue = self._batch, self._queue
            for _ in range(min(self._batch_size - len(batch), len(queue))):
                batch.append(queue.popleft())
            with self._drops_lock:
                drops, self._drops = self._drops, {}
                unfinished, self._unfinished = self._unfinished, {}
            for run_id, n in drops.items():
                self._unsaved_drops[run_id] = self._unsaved_drops.get(run_id, 0) + n
            for run_id, n in unfinished.items():
                self._unsaved_unfinished[run_id] = self._unsaved_unfinished.get(run_id, 0) + n

    def _write_one_by_one(self, conn: Connection) -> None:
        """A batch with a bad row: write the rows singly so that only bad rows are lost."""
        batch = self._batch
        while batch:
            rec = batch[0]
            try:
                with conn.begin():
                    conn.exec_driver_sql(self._insert_sql, step_row(rec))
                written = True
                self._recovered()
            except ROW_ERRORS as exc:
                written = False
                self._unsaved_rejects[rec.run_id] = self._unsaved_rejects.get(rec.run_id, 0) + 1
                log.error(
                    "telemetry: database refused step %s of run %s: %s",
                    rec.step_index,
                    rec.run_id,
                    exc.orig,
                )
            with self._move_lock:
                batch.pop(0)
                if written:
                    self._written += 1
                else:
                    self._rejected += 1
        with conn.begin():
            self._save_counts(conn)
        self._counts_saved()

    def _save_counts(self, conn: Connection) -> None:
        for column, counts in (
            (Run.dropped_steps, self._unsaved_drops),
            (Run.rejected_steps, self._unsaved_rejects),
            (Run.unfinished_steps, self._unsaved_unfinished),
        ):
            for run_id, n in counts.items():
                conn.execute(update(Run).where(Run.id == run_id).values({column: column + n}))

    def _counts_saved(self) -> None:
        """After the transaction holding ``_save_counts`` committed (never before)."""
        with self._move_lock:
            self._unsaved_drops.clear()
            self._unsaved_rejects.clear()
            self._unsaved_unfinished.clear()

    def _failed(self, exc: Exception) -> None:
        self._failures += 1
        self._last_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "telemetry: cannot write to %s (%s); buffering up to %d records and retrying",
                display_url(self._engine.url),
                self._last_error,
                self._queue_size,
            )

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.warning(
                "telemetry: database writable again after %.1f s (%d records dropped so far)",
                time.monotonic() - self._down_since,
                self._dropped,
            )
            self._down_since = None

    def _give_up(self) -> None:
        with self._move_lock:
            self._lost = len(self._batch) + len(self._queue)
            self._batch.clear()
            self._queue.clear()
        log.error(
            "telemetry: closing with %d step records unwritten to %s: %s",
            self._lost,
            display_url(self._engine.url),
            self._last_error,
        )

    def _rollup(self) -> None:
        assert self._retention_s is not None
        self._next_rollup = time.monotonic() + ROLLUP_EVERY_S
        try:
            retention.rollup(self._engine, older_than_s=self._retention_s)
        except Exception as exc:
            log.warning("telemetry: roll-up failed, retrying in %.0f s: %s", ROLLUP_EVERY_S, exc)


def steps_insert_sql(engine: Engine) -> str:
    """A positional ``INSERT INTO steps`` for the engine's driver: executemany with plain
    tuples is about three times faster than SQLAlchemy's per-row dict processing."""
    dialect = engine.dialect
    mark = {"qmark": "?", "format": "%s", "pyformat": "%s"}[dialect.paramstyle]
    quote = dialect.identifier_preparer.quote
    columns = ", ".join(quote(c) for c in STEP_COLUMNS)
    marks = ", ".join([mark] * len(STEP_COLUMNS))
    return f"INSERT INTO {quote(Step.__tablename__)} ({columns}) VALUES ({marks})"


def steps_copy_sql(engine: Engine) -> str | None:
    """``COPY steps (...) FROM STDIN`` on PostgreSQL with psycopg 3; ``None`` elsewhere."""
    if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
        return None
    quote = engine.dialect.identifier_preparer.quote
    columns = ", ".join(quote(c) for c in STEP_COLUMNS)
    return f"COPY {quote(Step.__tablename__)} ({columns}) FROM STDIN"


def _close_at_exit_hook(writer: TelemetryWriter) -> Any:
    """An ``atexit`` hook that flushes the writer without keeping it alive."""
    ref = weakref.ref(writer)

    def hook() -> None:
        live = ref()
        if live is not None:
            live.close(timeout=5.0)

    return hook
