"""Migrations, the models-vs-schema check, SQLite pragmas, schema refusals and `adatree db`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from sglang_adatree import cli
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import Base
from sglang_adatree.telemetry.writer import TelemetryWriter

pytest_plugins = ["telemetry_fixtures"]

TABLES = {"runs", "steps", "step_rollups", "policies", "pins", "retrain_jobs", "audit_log"}


def _schema_diff(url: str) -> list:
    with store.get_engine(url).connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return compare_metadata(ctx, Base.metadata)


def _check_migrated(url: str) -> None:
    engine = store.get_engine(url)
    assert store.current_revision(engine) == store.head_revision()
    store.check_schema_at_head(engine)
    assert set(inspect(engine).get_table_names()) >= TABLES
    assert _schema_diff(url) == []
    indexes = {i["name"] for i in inspect(engine).get_indexes("steps")}
    assert {"ix_steps_run_id_wall_time", "ix_steps_run_id_step_index"} <= indexes


def _database(backend: str, tmp_path, request) -> str:
    """An empty database of ``backend``: a SQLite file, or one on the test PostgreSQL server."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'a.sqlite'}"
    return request.getfixturevalue("pg_server").create_database()


def test_sqlite_upgrade_from_empty_matches_models(tmp_path):
    url = f"sqlite:///{tmp_path / 'sub' / 'a.sqlite'}"  # the directory is created too
    assert store.upgrade(url) == store.head_revision()
    _check_migrated(url)


def test_postgres_upgrade_from_empty_matches_models(pg_server):
    url = pg_server.create_database()
    assert store.upgrade(url) == store.head_revision()
    _check_migrated(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_downgrade_to_base_and_up_again(backend, tmp_path, request):
    url = _database(backend, tmp_path, request)
    store.upgrade(url)
    assert store.downgrade(url, "0001") == "0001"
    assert "pins" not in inspect(store.get_engine(url)).get_table_names()
    assert store.downgrade(url, "base") is None
    assert set(inspect(store.get_engine(url)).get_table_names()) <= {"alembic_version"}
    store.upgrade(url)
    _check_migrated(url)


def test_sqlite_connections_get_the_pragmas(sqlite_url):
    with store.get_engine(sqlite_url).connect() as conn:
        pragma = {
            name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
            for name in ("journal_mode", "foreign_keys", "synchronous", "busy_timeout")
        }
    assert pragma == {
        "journal_mode": "wal",
        "foreign_keys": 1,
        "synchronous": 1,
        "busy_timeout": 200,
    }


def test_default_busy_timeout_is_five_seconds(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.sqlite'}"
    store.upgrade(url)
    with store.get_engine(url).connect() as conn:
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000


def test_one_engine_per_url(sqlite_url):
    assert store.get_engine(sqlite_url) is store.get_engine(sqlite_url)


def test_session_scope_commits_or_rolls_back(sqlite_url):
    from sglang_adatree.telemetry.models import AuditLog

    with store.session_scope(sqlite_url) as s:
        s.add(AuditLog(at=1.0, actor="op", action="pin", before=None, after={"x": 1}))
    with pytest.raises(RuntimeError), store.session_scope(sqlite_url) as s:
        s.add(AuditLog(at=2.0, actor="op", action="clear", before=None, after=None))
        s.flush()
        raise RuntimeError("boom")
    with store.session_scope(sqlite_url) as s:
        assert [(a.action, a.after) for a in s.query(AuditLog)] == [("pin", {"x": 1})]


def test_behind_schema_refused_with_the_fix_command(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    store.upgrade(url, "0001")
    fix = f"adatree db upgrade --db {url}"
    with pytest.raises(store.SchemaError, match="behind head") as err:
        store.check_schema_at_head(store.get_engine(url))
    assert fix in str(err.value)
    # Every process that opens the store refuses, the writer included.
    with pytest.raises(store.SchemaError) as err:
        TelemetryWriter(url)
    assert fix in str(err.value)


def test_postgres_behind_schema_refused_with_the_fix_command(pg_server):
    url = pg_server.create_database()
    store.upgrade(url, "0001")
    with pytest.raises(store.SchemaError, match="behind head") as err:
        store.check_schema_at_head(store.get_engine(url))
    assert f"adatree db upgrade --db {url}" in str(err.value)


def test_missing_and_empty_databases_refused_never_created(tmp_path):
    missing = tmp_path / "missing.sqlite"
    url = f"sqlite:///{missing}"
    with pytest.raises(store.SchemaError, match="does not exist") as err:
        store.check_schema_at_head(store.get_engine(url))
    assert f"adatree db upgrade --db {url}" in str(err.value)
    assert not missing.exists()
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with pytest.raises(store.SchemaError, match="has no schema"):
        store.check_schema_at_head(store.get_engine(f"sqlite:///{empty}"))


def test_newer_database_refused(sqlite_url):
    with store.get_engine(sqlite_url).begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    with pytest.raises(store.SchemaError, match="upgrade the package"):
        store.check_schema_at_head(store.get_engine(sqlite_url))


def test_cli_db_upgrade_and_current(tmp_path, monkeypatch, capsys):
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    assert cli.main(["db", "current", "--db", url]) == 1
    assert "adatree db upgrade --db" in capsys.readouterr().out
    assert cli.main(["db", "upgrade", "--db", url]) == 0
    assert cli.main(["db", "current", "--db", url]) == 0
    assert f"at revision {store.head_revision()} (head)" in capsys.readouterr().out
    # An unreachable server: one line naming the database, no traceback.
    assert cli.main(["db", "current", "--db", "postgresql://nobody@127.0.0.1:1/none"]) == 1
    assert "127.0.0.1:1/none" in capsys.readouterr().err


def test_cli_url_resolution(tmp_path, monkeypatch, capsys):
    """--db > ADATREE_DB_URL > config file > SQLite under ADATREE_HOME."""
    home = tmp_path / "home"
    monkeypatch.delenv("ADATREE_DB_URL", raising=False)
    monkeypatch.delenv("ADATREE_CONFIG", raising=False)
    monkeypatch.setenv("ADATREE_HOME", str(home))
    assert cli.main(["db", "upgrade"]) == 0
    assert (home / "adatree.sqlite").exists()
    config = tmp_path / "adatree.toml"
    config.write_text(f'db_url = "sqlite:///{tmp_path / "from_file.sqlite"}"\n')
    monkeypatch.setenv("ADATREE_CONFIG", str(config))
    assert cli.main(["db", "upgrade"]) == 0
    assert (tmp_path / "from_file.sqlite").exists()
    monkeypatch.setenv("ADATREE_DB_URL", f"sqlite:///{tmp_path / 'from_env.sqlite'}")
    assert cli.main(["db", "upgrade"]) == 0
    assert (tmp_path / "from_env.sqlite").exists()
    assert cli.main(["db", "upgrade", "--db", f"sqlite:///{tmp_path / 'flag.sqlite'}"]) == 0
    assert (tmp_path / "flag.sqlite").exists()
    capsys.readouterr()


def test_upgrade_works_outside_the_source_tree(tmp_path):
    """No alembic.ini, any working directory: the command an installed package runs."""
    url = f"sqlite:///{tmp_path / 'x.sqlite'}"
    done = subprocess.run(
        [sys.executable, "-m", "sglang_adatree.cli", "db", "upgrade", "--db", url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "(head)" in done.stdout
    store.check_schema_at_head(store.get_engine(url))


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0003_keeps_recorded_steps_and_retires_old_feature_versions(backend, tmp_path, request):
    url = _database(backend, tmp_path, request)
    store.upgrade(url, "0002")
    engine = store.get_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (started_at, target_model, device, package_version, config, "
                "node, rank, dropped_steps, rejected_steps) "
                "VALUES (1.0, 't', 'cpu', '0', '{}', 'n', 0, 0, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO steps (run_id, step_index, wall_time, batch_size, sum_context_len, "
                "max_context_len, prefill_tokens, steps, topk, num_draft_tokens, "
                "decision_source, measured_step_ms, measured_accept_len, emitted_tokens, "
                "drafted_tokens, accepted_tokens, goodput, accepted_by_depth, accepted_by_rank) "
                "VALUES (1, 0, 2.0, 3, 300, 100, 0, 3, 1, 4, 'model', 9.0, 2.0, 6, 9, 3, 666.0, "
                "'2,1,0', '3')"
            )
        )
        for version, names, active in ((1, ["batch_size", "prefill_tokens"], True),):
            conn.execute(
                text(
                    "INSERT INTO policies (version, created_at, artifact, feature_names, "
                    "training_rows, validation_metrics, active) "
                    "VALUES (:v, 1.0, :a, :f, 10, '{}', :active)"
                ),
                {"v": version, "a": b"x", "f": json.dumps(names), "active": active},
            )
    store.upgrade(url)
    _check_migrated(url)
    with engine.connect() as conn:
        step = conn.execute(text("SELECT batch_size, padded_batch_size FROM steps")).one()
        unfinished = conn.execute(text("SELECT unfinished_steps FROM runs")).scalar()
        active = conn.execute(text("SELECT active FROM policies WHERE version = 1")).scalar()
        audit = conn.execute(text("SELECT actor, action FROM audit_log")).all()
    assert tuple(step) == (3, 3) and unfinished == 0 and not active
    assert [tuple(a) for a in audit] == [("migration 0003", "policy.deactivate")]
    assert store.downgrade(url, "0002") == "0002"
    store.upgrade(url)
    _check_migrated(url)


def _record_one_step(engine, extra: dict[str, str] | None = None) -> None:
    """A run with one step, by the columns every revision since 0003 has (and ``extra``)."""
    extra = extra or {}
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO runs (started_at, target_model, device, package_version, config, "
                "node, rank, dropped_steps, rejected_steps, unfinished_steps) "
                "VALUES (1.0, 't', 'cpu', '0', '{}', 'n', 0, 0, 0, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO steps (run_id, step_index, wall_time, batch_size, padded_batch_size, "
                "sum_context_len, max_context_len, steps, topk, num_draft_tokens, "
                "decision_source, measured_step_ms, measured_accept_len, emitted_tokens, "
                "drafted_tokens, accepted_tokens, goodput, accepted_by_depth, accepted_by_rank"
                + "".join(f", {name}" for name in extra)
                + ") VALUES (1, 0, 2.0, 3, 3, 300, 100, 3, 1, 4, 'model', 9.0, 2.0, 6, 9, 3, "
                "666.0, '2,1,0', '3'" + "".join(f", {value}" for value in extra.values()) + ")"
            )
        )


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0004_adds_the_runner_up_and_keeps_recorded_steps(backend, tmp_path, request):
    url = _database(backend, tmp_path, request)
    store.upgrade(url, "0003")
    engine = store.get_engine(url)
    _record_one_step(engine)
    store.upgrade(url)
    _check_migrated(url)
    columns = "batch_size, runner_up, runner_up_step_ms, runner_up_accept_len"
    with engine.connect() as conn:
        step = conn.execute(text(f"SELECT {columns} FROM steps")).one()
    assert tuple(step) == (3, None, None, None)
    assert store.downgrade(url, "0003") == "0003"
    names = {c["name"] for c in inspect(store.get_engine(url)).get_columns("steps")}
    assert "runner_up" not in names and "batch_size" in names
    store.upgrade(url)
    _check_migrated(url)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_0005_adds_the_price_split_and_keeps_recorded_steps(backend, tmp_path, request):
    url = _database(backend, tmp_path, request)
    store.upgrade(url, "0004")
    engine = store.get_engine(url)
    _record_one_step(engine, {"runner_up": "'2,2,4'", "runner_up_step_ms": "10.5"})
    store.upgrade(url)
    _check_migrated(url)
    columns = "runner_up, runner_up_step_ms, price_drift, price_tilt, price_offset"
    with engine.connect() as conn:
        step = conn.execute(text(f"SELECT {columns} FROM steps")).one()
    assert tuple(step) == ("2,2,4", 10.5, None, None, None)
    assert store.downgrade(url, "0004") == "0004"
    names = {c["name"] for c in inspect(store.get_engine(url)).get_columns("steps")}
    assert not names & {"price_drift", "price_tilt", "price_offset"} and "runner_up" in names
    store.upgrade(url)
    _check_migrated(url)
