"""Operator changes through the API and the page forms: pins and policy versions, the database
state after every POST, the audit trail, and what the serving worker reads back."""

from __future__ import annotations

import time

import pytest
from admin_helpers import TEST_ROUNDS, TOKEN, log_in, seed_run
from sglang_adatree.admin import create_app
from sqlalchemy import insert, select

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.control import read_control_state
from sglang_adatree.telemetry.models import AuditLog, PinRow, Policy

pytest_plugins = ["admin_fixtures", "telemetry_fixtures"]

RUN_SHAPES = (TreeShape(0, 1, 1), TreeShape(3, 1, 4), TreeShape(3, 2, 6), TreeShape(5, 4, 8))


def pins_in_db(url: str) -> list:
    with store.session_scope(url) as s:
        return list(s.scalars(select(PinRow).order_by(PinRow.id)))


def audit_in_db(url: str) -> list:
    with store.session_scope(url) as s:
        return list(s.scalars(select(AuditLog).order_by(AuditLog.id)))


def add_policy(url: str, version: int, active: bool = False, activated_at: float | None = None):
    with store.get_engine(url).begin() as conn:
        conn.execute(
            insert(Policy).values(
                version=version,
                created_at=time.time(),
                artifact=b"not a real artifact",
                feature_names=["batch_size"],
                training_rows=100,
                validation_metrics={"mape": 0.05 * version},
                active=active,
                activated_at=activated_at,
                activated_by="seed" if activated_at else None,
            )
        )


# ---- pins ----------------------------------------------------------------------------------------


def test_pin_a_candidate_shape_via_the_api(operator, db_url):
    seed_run(db_url, 200, shapes=RUN_SHAPES)
    body = {"shape": "3,2,6", "min_batch_size": 4, "max_batch_size": 32, "reason": "test"}
    response = operator.post_json("/api/pins", body)
    assert response.status_code == 201
    pin = response.get_json()
    assert pin["shape"] == "3,2,6" and pin["active"] and pin["created_by"] == "tester@127.0.0.1"
    [row] = pins_in_db(db_url)
    assert (row.steps, row.topk, row.num_draft_tokens) == (3, 2, 6)
    assert (row.min_batch_size, row.max_batch_size, row.cleared_at) == (4, 32, None)
    [entry] = audit_in_db(db_url)
    assert entry.action == "pin.create" and entry.before is None
    assert entry.after["id"] == row.id and entry.actor == "tester@127.0.0.1"
    # What the serving worker reads within a second.
    state = read_control_state(db_url)
    assert state.pin_for(8) == TreeShape(3, 2, 6)
    assert state.pin_for(64) is None
    listed = operator.get("/api/pins").get_json()
    assert [p["id"] for p in listed["active"]] == [row.id]
    assert listed["candidates"]["source"] == "run"


def test_pins_are_validated_against_the_latest_runs_candidate_set(operator, db_url):
    seed_run(db_url, 100, shapes=RUN_SHAPES)
    # 3,4,8 is a default candidate but not one of this run's.
    response = operator.post_json("/api/pins", {"shape": "3,4,8", "reason": "x"})
    assert response.status_code == 422
    assert "candidate set" in response.get_json()["error"]
    assert pins_in_db(db_url) == []
    assert audit_in_db(db_url) == []


def test_without_runs_the_dashboards_config_is_the_candidate_set(operator, db_url):
    assert operator.post_json("/api/pins", {"shape": "3,4,8", "reason": "x"}).status_code == 201
    assert operator.post_json("/api/pins", {"shape": "2,2,2", "reason": "x"}).status_code == 422
    assert operator.get("/api/pins").get_json()["candidates"]["source"] == "config"


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"shape": "3,2,6"}, 400),  # no reason
        ({"reason": "x"}, 400),  # no shape
        ({"shape": "3,2,6", "reason": "  "}, 400),
        ({"shape": "3,2,6", "reason": "x" * 1001}, 400),
        ({"shape": 326, "reason": "x"}, 400),
        ({"shape": "banana", "reason": "x"}, 400),
        ({"shape": "99,99,99", "reason": "x"}, 400),
        ({"shape": "3,2,6", "reason": "x", "min_batch_size": -1}, 400),
        ({"shape": "3,2,6", "reason": "x", "min_batch_size": 0}, 400),
        ({"shape": "3,2,6", "reason": "x", "max_batch_size": 10**30}, 400),
        ({"shape": "3,2,6", "reason": "x", "max_batch_size": "12"}, 201),
        ({"shape": "3,2,6", "reason": "x", "max_batch_size": True}, 400),
        ({"shape": "3,2,6", "reason": "x", "min_batch_size": 9, "max_batch_size": 3}, 400),
        ({"shape": "3,2,6", "reason": "x", "colour": "red"}, 400),
        ({"shape": "5,4,8", "reason": "x"}, 201),
        ([1, 2, 3], 400),
    ],
)
def test_pin_input_is_checked(operator, db_url, body, status):
    seed_run(db_url, 100, shapes=RUN_SHAPES)
    response = operator.post_json("/api/pins", body)
    assert response.status_code == status, response.get_json()
    assert len(pins_in_db(db_url)) == (1 if status == 201 else 0)


def test_non_json_bodies_are_refused(operator, db_url):
    r = operator.post_json("/api/pins", data="shape=3,2,6", content_type="text/plain")
    assert r.status_code == 415
    r = operator.post_json("/api/pins", data="{not json", content_type="application/json")
    assert r.status_code == 400
    r = operator.post_json("/api/pins", data="x" * 70_000, content_type="application/json")
    assert r.status_code == 413
    assert pins_in_db(db_url) == []


def test_clear_a_pin(operator, db_url):
    pin_id = operator.post_json("/api/pins", {"shape": "0", "reason": "debug"}).get_json()["id"]
    response = operator.post_json(f"/api/pins/{pin_id}/clear")
    assert response.status_code == 200
    assert response.get_json()["active"] is False
    [row] = pins_in_db(db_url)
    assert row.cleared_at is not None and row.cleared_by == "tester@127.0.0.1"
    entries = audit_in_db(db_url)
    assert [e.action for e in entries] == ["pin.create", "pin.clear"]
    assert entries[1].before["cleared_at"] is None and entries[1].after["cleared_at"] is not None
    assert read_control_state(db_url).pins == ()
    assert operator.post_json(f"/api/pins/{pin_id}/clear").status_code == 409
    assert operator.post_json("/api/pins/999/clear").status_code == 404
    assert len(audit_in_db(db_url)) == 2


def test_newest_pin_wins_for_the_server(operator, db_url):
    operator.post_json("/api/pins", {"shape": "3,1,4", "reason": "all"})
    operator.post_json("/api/pins", {"shape": "6,4,16", "reason": "small", "max_batch_size": 4})
    state = read_control_state(db_url)
    assert state.pin_for(2) == TreeShape(6, 4, 16)
    assert state.pin_for(100) == TreeShape(3, 1, 4)


def test_pin_and_clear_through_the_page_forms(operator, db_url):
    seed_run(db_url, 100, shapes=RUN_SHAPES)
    form = {"shape": "3,1,4", "min_batch_size": "", "max_batch_size": "16", "reason": "by form"}
    response = operator.post_form("/pins", form)
    assert response.status_code == 302
    [row] = pins_in_db(db_url)
    assert (row.min_batch_size, row.max_batch_size, row.reason) == (None, 16, "by form")
    page = operator.get("/pins").text
    assert f'data-pin="{row.id}"' in page and "pinned shape 3,1,4" in page
    assert operator.post_form(f"/pins/{row.id}/clear").status_code == 302
    assert pins_in_db(db_url)[0].cleared_at is not None
    refused = operator.post_form("/pins", {**form, "shape": "4,4,12"})
    assert refused.status_code == 422 and refused.mimetype == "text/html"
    assert "not in the candidate set" in refused.text


# ---- policy versions -----------------------------------------------------------------------------


def test_activate_and_roll_back_policy_versions(operator, db_url):
    add_policy(db_url, 1, active=True, activated_at=1000.0)
    add_policy(db_url, 2)
    response = operator.post_json("/api/policies/2/activate")
    assert response.status_code == 200 and response.get_json()["active"] is True
    assert read_control_state(db_url).active_policy_version == 2
    assert operator.post_json("/api/policies/2/activate").status_code == 409
    assert operator.post_json("/api/policies/9/activate").status_code == 404
    response = operator.post_json("/api/policies/rollback")
    assert response.status_code == 200 and response.get_json()["version"] == 1
    assert read_control_state(db_url).active_policy_version == 1
    with store.session_scope(db_url) as s:
        assert s.scalars(select(Policy.version).where(Policy.active.is_(True))).all() == [1]
    actions = [(e.action, e.before, e.after) for e in audit_in_db(db_url)]
    assert actions == [
        ("policy.activate", {"active_version": 1}, {"active_version": 2}),
        ("policy.rollback", {"active_version": 2}, {"active_version": 1}),
    ]
    listed = operator.get("/api/policies").get_json()
    assert listed["active_version"] == 1
    assert [p["version"] for p in listed["policies"]] == [2, 1]
    assert "artifact" not in listed["policies"][0]


def test_rollback_with_nothing_earlier_is_409(operator, db_url):
    assert operator.post_json("/api/policies/rollback").status_code == 409
    add_policy(db_url, 1, active=True, activated_at=1000.0)
    assert operator.post_json("/api/policies/rollback").status_code == 409
    assert audit_in_db(db_url) == []


def test_activate_through_the_page_form(operator, db_url):
    add_policy(db_url, 1)
    assert operator.post_form("/policies/1/activate").status_code == 302
    assert read_control_state(db_url).active_policy_version == 1
    page = operator.get("/policies").text
    assert "policy version 1 is now active" in page and "<strong>active</strong>" in page


def test_audit_page_and_api_list_changes_newest_first(operator, db_url):
    operator.post_json("/api/pins", {"shape": "0", "reason": "one"})
    operator.post_json("/api/pins", {"shape": "3,1,4", "reason": "two"})
    entries = operator.get("/api/audit").get_json()["entries"]
    assert [e["after"]["reason"] for e in entries] == ["two", "one"]
    assert "pin.create" in operator.get("/audit").text


def test_the_dashboard_on_postgresql(pg_url):
    """Reads, a pin, an activation and a retrain through the app on PostgreSQL."""
    seed_run(pg_url, 1500, seed=13, shapes=RUN_SHAPES)
    app = create_app(
        {
            "ADATREE_ADMIN_TOKEN": TOKEN,
            "ADATREE_DB_URL": pg_url,
            "ADATREE_CONFIG": AdaTreeConfig(),
            "ADATREE_RETRAIN_ROUNDS": TEST_ROUNDS,
            "TESTING": True,
        }
    )
    operator = log_in(app.test_client())
    for path in ("/api/overview?range=run", "/api/shapes", "/api/cost-model", "/", "/runs"):
        assert operator.get(path).status_code == 200, path
    assert operator.post_json("/api/pins", {"shape": "5,4,8", "reason": "pg"}).status_code == 201
    assert read_control_state(pg_url).pin_for(3) == TreeShape(5, 4, 8)
    job = operator.post_json("/api/retrain", {"min_rows": 1000}).get_json()
    assert app.extensions["adatree"].join_retrain_threads(timeout=60.0)
    done = operator.get(f"/api/retrain/{job['id']}").get_json()
    assert done["status"] == "succeeded" and done["policy"]["active"]
    assert read_control_state(pg_url).active_policy_version == done["policy_version"]
    assert {e["action"] for e in operator.get("/api/audit").get_json()["entries"]} == {
        "pin.create",
        "retrain.request",
        "retrain.finish",
    }
