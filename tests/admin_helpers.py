"""Helpers of the dashboard tests: seeded runs, a logged-in operator client, polling.
The fixtures that use them are in ``admin_fixtures``."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from flask.testing import FlaskClient
from synthetic_runs import synthetic_run

from sglang_adatree.telemetry import store

TOKEN = "test-operator-token"
# Few boosting rounds keep a retrain in the tests to about a second.
TEST_ROUNDS = 40
END_TIME = 1_800_000_000.0  # a fixed "now" for seeded runs: 2027-01-15


def seed_run(url: str, num_steps: int, **kw: Any) -> int:
    """A synthetic run of ``num_steps`` steps (50 per second, ending at ``END_TIME``)."""
    kw.setdefault("end_time", END_TIME)
    return synthetic_run(store.get_engine(url), num_steps, **kw)


class Operator:
    """A logged-in test client that adds the CSRF token to its writes."""

    def __init__(self, client: FlaskClient, csrf: str) -> None:
        self.client = client
        self.csrf = csrf

    def get(self, path: str, **kw: Any):
        return self.client.get(path, **kw)

    def post_json(self, path: str, body: Any = None, **kw: Any):
        headers = {"X-CSRF-Token": self.csrf, **kw.pop("headers", {})}
        if body is None:
            return self.client.post(path, headers=headers, **kw)
        return self.client.post(path, json=body, headers=headers, **kw)

    def post_form(self, path: str, data: dict[str, Any] | None = None, **kw: Any):
        return self.client.post(path, data={"csrf_token": self.csrf, **(data or {})}, **kw)


def login_csrf(client: FlaskClient) -> str:
    """The CSRF token the login form carries (it is also the session's)."""
    page = client.get("/login")
    return re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)


def log_in(client: FlaskClient, name: str = "tester") -> Operator:
    csrf = login_csrf(client)
    response = client.post("/login", data={"token": TOKEN, "name": name, "csrf_token": csrf})
    assert response.status_code == 302, response.text
    with client.session_transaction() as session:
        return Operator(client, session["csrf"])


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    """Poll until ``predicate()`` is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.05)
