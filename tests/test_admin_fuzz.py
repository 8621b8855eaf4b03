"""The OpenAPI document matches the routes, and schemathesis fuzzes every operation of the JSON
API (valid and invalid inputs) as a logged-in operator: no answer may be a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from admin_helpers import TOKEN, log_in, seed_run
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from sglang_adatree.admin import create_app
from sglang_adatree.admin.openapi import DOCUMENT

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.telemetry import store

pytest_plugins = ["admin_fixtures"]

EXAMPLES_PER_OPERATION = 25


def api_routes(app) -> set[tuple[str, str]]:
    """(method, OpenAPI-style path) of every ``/api/`` route the app serves."""
    out = set()
    for rule in app.url_map.iter_rules():
        if not rule.rule.startswith("/api/") or rule.rule == "/api/openapi.json":
            continue
        path = rule.rule
        for arg in rule.arguments:
            path = path.replace(f"<int(min=1, max=2147483647):{arg}>", f"{{{arg}}}")
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            out.add((method.lower(), path))
    return out


def test_every_api_route_is_documented_and_every_documented_path_routed(app):
    documented = {(m, p) for p, ops in DOCUMENT["paths"].items() for m in ops}
    assert api_routes(app) == documented


def test_the_document_is_served_to_operators(operator):
    assert operator.get("/api/openapi.json").get_json() == DOCUMENT


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    """One app and session for every fuzzed operation: a database with a run, a pin and a
    retrain job, so ids in paths sometimes exist."""
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'fuzz.sqlite'}"
    store.upgrade(url)
    seed_run(url, 300, seed=31)
    app = create_app(
        {
            "ADATREE_ADMIN_TOKEN": TOKEN,
            "ADATREE_DB_URL": url,
            "ADATREE_CONFIG": AdaTreeConfig(),
            "ADATREE_RETRAIN_ROUNDS": 5,
            "TESTING": True,
        }
    )
    operator = log_in(app.test_client(), "fuzzer")
    operator.post_json("/api/pins", {"shape": "3,1,4", "reason": "fuzz"})
    session = {"adatree_session": operator.client.get_cookie("adatree_session").value}
    yield app, session, {"X-CSRF-Token": operator.csrf}
    assert app.extensions["adatree"].join_retrain_threads(timeout=60.0)
    store.get_engine(url).dispose()


schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES_PER_OPERATION,
    database="none",
    # The session is the test's own (below); generated cookies would only log it out.
    with_security_parameters=False,
)


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_api_never_answers_5xx(case, fuzz_target):
    app, cookies, headers = fuzz_target
    response = case.call(app=app, headers=headers, cookies=cookies)
    assert response.status_code < 500, (case.method, case.formatted_path, response.text[:300])
    # Logged in with the right CSRF token: a 401 or 403 would mean nothing was fuzzed.
    assert response.status_code not in (401, 403), response.text[:300]
