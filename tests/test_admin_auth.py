"""Login, the session cookie, CSRF refusals, and the refusal to serve exposed without a token."""

from __future__ import annotations

import argparse

import pytest
from admin_helpers import TOKEN, log_in, login_csrf
from sglang_adatree.admin import auth, commands, create_app
from sqlalchemy import func, select

from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.models import AuditLog, PinRow

pytest_plugins = ["admin_fixtures"]


def count(url: str, model) -> int:
    with store.session_scope(url) as s:
        return int(s.scalar(select(func.count()).select_from(model)))


@pytest.mark.parametrize("path", ["/", "/pins", "/runs", "/audit", "/shapes?range=5m"])
def test_pages_redirect_to_login(app, path):
    response = app.test_client().get(path)
    assert response.status_code == 302
    assert response.headers["Location"].startswith("/login?next=")


@pytest.mark.parametrize("path", ["/api/overview", "/api/pins", "/api/runs", "/api/audit"])
def test_api_needs_login(app, path):
    response = app.test_client().get(path)
    assert response.status_code == 401
    assert "login required" in response.get_json()["error"]


def test_login_page_and_static_files_are_public(app):
    client = app.test_client()
    assert client.get("/login").status_code == 200
    assert client.get("/static/style.css").status_code == 200
    assert client.get("/assets/plotly.min.js").status_code == 302


def test_wrong_token_is_refused(app):
    client = app.test_client()
    csrf = login_csrf(client)
    response = client.post("/login", data={"token": TOKEN + "x", "csrf_token": csrf})
    assert response.status_code == 401
    assert "wrong operator token" in response.text
    assert client.get("/api/runs").status_code == 401


def test_login_sets_a_strict_httponly_session_cookie(app):
    client = app.test_client()
    csrf = login_csrf(client)
    response = client.post("/login", data={"token": TOKEN, "name": "ada", "csrf_token": csrf})
    assert response.status_code == 302 and response.headers["Location"] == "/"
    cookie = response.headers["Set-Cookie"]
    assert cookie.startswith("adatree_session=")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert client.get("/api/runs").status_code == 200


def test_login_redirects_only_to_local_paths(app):
    for target, expected in [("/pins", "/pins"), ("https://evil.example/", "/"), ("//evil", "/")]:
        client = app.test_client()
        csrf = login_csrf(client)
        data = {"token": TOKEN, "csrf_token": csrf, "next": target}
        assert client.post("/login", data=data).headers["Location"] == expected


def test_login_without_csrf_is_refused(app):
    client = app.test_client()
    client.get("/login")
    assert client.post("/login", data={"token": TOKEN}).status_code == 403


def test_logout_ends_the_session(operator):
    assert operator.post_form("/logout").status_code == 302
    assert operator.get("/api/runs").status_code == 401


def test_state_changes_need_the_csrf_token(operator, db_url):
    client = operator.client
    body = {"shape": "3,1,4", "reason": "x"}
    assert client.post("/api/pins", json=body).status_code == 403
    wrong = {"X-CSRF-Token": operator.csrf + "x"}
    assert client.post("/api/pins", json=body, headers=wrong).status_code == 403
    assert client.post("/pins", data=body).status_code == 403
    assert client.post("/pins", data={**body, "csrf_token": "nope"}).status_code == 403
    assert client.post("/api/retrain", json={}).status_code == 403
    assert client.post("/api/policies/rollback").status_code == 403
    assert client.post("/logout").status_code == 403
    refused = client.post("/api/pins", json=body)
    assert "CSRF" in refused.get_json()["error"]
    assert count(db_url, PinRow) == 0 and count(db_url, AuditLog) == 0
    assert operator.post_json("/api/pins", body).status_code == 201


def test_csrf_token_of_another_session_is_refused(app, db_url):
    first = log_in(app.test_client(), "first")
    second = log_in(app.test_client(), "second")
    assert first.csrf != second.csrf
    response = first.client.post(
        "/api/pins", json={"shape": "0", "reason": "x"}, headers={"X-CSRF-Token": second.csrf}
    )
    assert response.status_code == 403
    assert count(db_url, PinRow) == 0


def test_token_compare_is_constant_time_and_exact():
    assert auth.token_matches("abc-token", "abc-token")
    assert not auth.token_matches("abc-toke", "abc-token")
    assert not auth.token_matches("", "abc-token")


def test_create_app_needs_a_token(db_url, monkeypatch):
    monkeypatch.delenv("ADATREE_ADMIN_TOKEN", raising=False)
    with pytest.raises(ValueError, match="ADATREE_ADMIN_TOKEN"):
        create_app({"ADATREE_DB_URL": db_url})
    with pytest.raises(ValueError, match="at least"):
        create_app({"ADATREE_DB_URL": db_url, "ADATREE_ADMIN_TOKEN": "short"})
    monkeypatch.setenv("ADATREE_ADMIN_TOKEN", TOKEN)
    assert create_app({"ADATREE_DB_URL": db_url}).config["ADATREE_ADMIN_TOKEN"] == TOKEN


def test_create_app_refuses_a_database_without_the_schema(tmp_path):
    url = f"sqlite:///{tmp_path / 'missing.sqlite'}"
    with pytest.raises(store.SchemaError, match="adatree db upgrade"):
        create_app({"ADATREE_DB_URL": url, "ADATREE_ADMIN_TOKEN": TOKEN})


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("192.168.1.5", False),
        ("::", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host, loopback):
    assert commands.is_loopback(host) is loopback


def test_admin_command_refuses_an_exposed_host_without_a_token(db_url, monkeypatch, capsys):
    monkeypatch.delenv("ADATREE_ADMIN_TOKEN", raising=False)
    args = argparse.Namespace(db=db_url, host="0.0.0.0", port=8050, threads=2)
    assert commands.run(args) == 2
    assert "refusing to serve on 0.0.0.0" in capsys.readouterr().out


def test_admin_command_reports_a_database_without_the_schema(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ADATREE_ADMIN_TOKEN", TOKEN)
    url = f"sqlite:///{tmp_path / 'none.sqlite'}"
    args = argparse.Namespace(db=url, host="127.0.0.1", port=8050, threads=2)
    assert commands.run(args) == 2
    assert "adatree db upgrade" in capsys.readouterr().out
