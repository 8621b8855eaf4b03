"""Telemetry: every decode step recorded off the hot path, in SQLite or PostgreSQL.

* ``records``: ``StepRecord`` / ``RunRecord``, the frozen values the serving worker builds.
* ``writer``: ``TelemetryWriter``, a bounded queue drained by a background batch writer.
* ``models``: the schema (typed SQLAlchemy models); ``migrations/`` creates it under alembic.
* ``store``: engines, sessions, the schema-at-head check and ``upgrade``.
* ``control``: active pins and the active policy version, polled by the serving worker.
* ``retention``: old per-step rows rolled up into per-minute aggregates.
* ``commands``: ``adatree db upgrade | current | rollup``.
* ``bench``: the writer benchmark behind ``scripts/bench_telemetry.py``.
"""

from sglang_adatree.telemetry.records import RunRecord, StepRecord

__all__ = ["RunRecord", "StepRecord"]
