"""The dashboard while its database is down: 503 naming the database and its error (JSON under
/api/, a page elsewhere), one log line when the outage starts and one when it ends, and the
same pages at 200 once the database is back. SQLite moved away, made unreadable or read-only;
PostgreSQL stopped and restarted. A statement error stays a 500."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from admin_helpers import TOKEN, log_in, seed_run
from sglang_adatree.admin import create_app
from sqlalchemy.exc import IntegrityError
from telemetry_helpers import unprivileged

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.telemetry import store

pytest_plugins = ["admin_fixtures", "telemetry_fixtures"]

PIN = {"shape": "3,1,4", "reason": "outage test"}


def app_on(url: str):
    return create_app(
        {"ADATREE_ADMIN_TOKEN": TOKEN, "ADATREE_DB_URL": url, "ADATREE_CONFIG": AdaTreeConfig()}
    )


def assert_unavailable(response, url: str, cause: str) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"]
    shown = store.display_url(url)
    if response.mimetype == "application/json":
        body = response.get_json()
        assert body["status"] == 503
        message = body["error"]
    else:
        assert response.mimetype == "text/html"
        message = response.text
    assert shown in message, message
    assert cause in message, message


def outage_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.endswith("admin.errors")]


def test_sqlite_moved_away_then_back(db_url, caplog):
    seed_run(db_url, 200, seed=1)
    operator = log_in(app_on(db_url).test_client())
    caplog.set_level(logging.WARNING)
    path = store.sqlite_path(db_url)
    os.replace(path, f"{path}.away")
    try:
        for _ in range(3):
            assert_unavailable(operator.get("/api/overview"), db_url, "unable to open")
        assert_unavailable(operator.get("/"), db_url, "unable to open")
        assert_unavailable(operator.post_json("/api/pins", PIN), db_url, "unable to open")
    finally:
        os.replace(f"{path}.away", path)
    assert operator.get("/api/overview").status_code == 200
    assert operator.get("/").status_code == 200
    assert operator.post_json("/api/pins", PIN).status_code == 201
    lines = outage_lines(caplog)
    assert sum("refuses reads" in m for m in lines) == 1
    assert sum("refuses writes" in m for m in lines) == 1
    assert sum("serves reads again" in m for m in lines) == 1
    assert sum("serves writes again" in m for m in lines) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def private_db():
    """A migrated database in a directory an unprivileged user can reach (pytest's tmp_path
    is root-only), for permission faults that root would ignore."""
    root = Path(tempfile.mkdtemp(prefix="adatree-admin-ro-"))
    url = f"sqlite:///{root / 'ro.sqlite'}?timeout=0.2"
    store.upgrade(url)
    seed_run(url, 200, seed=1)
    yield root, url
    store.get_engine(url).dispose()
    shutil.rmtree(root, ignore_errors=True)


def test_sqlite_read_only_refuses_writes_with_503(private_db):
    root, url = private_db
    files = [root, *root.glob("ro.sqlite*")]
    with unprivileged(*files):
        operator = log_in(app_on(url).test_client())
        for f in root.glob("ro.sqlite*"):
            f.chmod(0o444)
        try:
            assert_unavailable(operator.post_json("/api/pins", PIN), url, "readonly")
            assert operator.get("/api/pins").status_code in (200, 503)
        finally:
            for f in root.glob("ro.sqlite*"):
                f.chmod(0o644)
        assert operator.post_json("/api/pins", PIN).status_code == 201


def test_sqlite_unreadable_answers_503(private_db):
    root, url = private_db
    with unprivileged(root, *root.glob("ro.sqlite*")):
        operator = log_in(app_on(url).test_client())
        db = store.sqlite_path(url)
        db.chmod(0o000)
        try:
            assert_unavailable(operator.get("/api/runs"), url, "OperationalError")
            assert_unavailable(operator.get("/runs"), url, "OperationalError")
        finally:
            db.chmod(0o644)
        assert operator.get("/api/runs").status_code == 200


def test_postgres_stopped_then_restarted(pg_server, pg_url):
    seed_run(pg_url, 200, seed=1)
    operator = log_in(app_on(pg_url).test_client())
    assert operator.get("/api/overview").status_code == 200
    pg_server.stop()
    try:
        assert_unavailable(operator.get("/api/overview"), pg_url, "OperationalError")
        assert_unavailable(operator.get("/shapes"), pg_url, "OperationalError")
        assert_unavailable(operator.post_json("/api/pins", PIN), pg_url, "OperationalError")
    finally:
        pg_server.start()
    assert operator.get("/api/overview").status_code == 200
    assert operator.post_json("/api/pins", PIN).status_code == 201


def test_a_statement_error_is_still_a_500(db_url):
    app = app_on(db_url)

    @app.get("/api/boom")
    def boom():
        raise IntegrityError("INSERT ...", {}, Exception("UNIQUE constraint failed"))

    operator = log_in(app.test_client())
    response = operator.get("/api/boom")
    assert response.status_code == 500
    assert "UNIQUE" not in response.text
