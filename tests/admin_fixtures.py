"""Fixtures of the dashboard tests, loaded with ``pytest_plugins = ["admin_fixtures"]``: a
migrated SQLite database, the app, and a logged-in operator client (``admin_helpers`` has the
plain helpers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from admin_helpers import TEST_ROUNDS, TOKEN, Operator, log_in
from flask import Flask
from sglang_adatree.admin import create_app

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.telemetry import store


@pytest.fixture
def db_url(tmp_path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'admin.sqlite'}"
    store.upgrade(url)
    yield url
    store.get_engine(url).dispose()


@pytest.fixture
def make_app(db_url) -> Iterator[Callable[..., Flask]]:
    """``make_app(**config)``: the dashboard on the test database; retrain threads it started
    are joined afterwards."""
    apps: list[Flask] = []

    def factory(**config: Any) -> Flask:
        settings = {
            "ADATREE_ADMIN_TOKEN": TOKEN,
            "ADATREE_DB_URL": db_url,
            "ADATREE_CONFIG": AdaTreeConfig(),
            "ADATREE_RETRAIN_ROUNDS": TEST_ROUNDS,
            "TESTING": True,
            **config,
        }
        apps.append(create_app(settings))
        return apps[-1]

    yield factory
    for app in apps:
        assert app.extensions["adatree"].join_retrain_threads(timeout=60.0)


@pytest.fixture
def app(make_app) -> Flask:
    return make_app()


@pytest.fixture
def operator(app) -> Operator:
    return log_in(app.test_client())
