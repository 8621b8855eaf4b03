"""The retrain job end to end on seeded step rows: a real XGBoost fit, a validated policy
version with its metrics, activation rules, refusals, the CLI and the dashboard's button."""

from __future__ import annotations

import argparse
import time

import numpy as np
import pytest
from admin_helpers import TEST_ROUNDS, seed_run, wait_for
from sqlalchemy import select, update

from sglang_adatree.core.features import FEATURE_NAMES
from sglang_adatree.core.xgb_cost import XGBoostStepTime
from sglang_adatree.lab.measured import profile_from_telemetry
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.control import read_control_state
from sglang_adatree.telemetry.models import AuditLog, Policy, RetrainJob, Run
from sglang_adatree.tools import retrain

pytest_plugins = ["admin_fixtures"]


def options(**kw) -> retrain.RetrainOptions:
    return retrain.RetrainOptions(**{"num_rounds": TEST_ROUNDS, "nthread": 1, **kw})


def run_once(url: str, **kw) -> retrain.RetrainOutcome:
    opts = options(**kw)
    job_id = retrain.create_job(url, "tester", opts)
    return retrain.run_job(url, job_id, opts, "tester")


def job_row(url: str, job_id: int) -> RetrainJob:
    with store.session_scope(url) as s:
        return s.get_one(RetrainJob, job_id)


def policies(url: str) -> list[Policy]:
    with store.session_scope(url) as s:
        return list(s.scalars(select(Policy).order_by(Policy.version)))


def audit_actions(url: str) -> list[str]:
    with store.session_scope(url) as s:
        return list(s.scalars(select(AuditLog.action).order_by(AuditLog.id)))


def test_too_few_rows_is_refused_with_a_clear_message(db_url):
    seed_run(db_url, 60)
    outcome = run_once(db_url, min_rows=100)
    assert outcome.status == "refused"
    assert "too few recorded steps to retrain: 60" in outcome.message
    assert "at least 100" in outcome.message
    job = job_row(db_url, outcome.job_id)
    assert (job.status, job.progress, job.rows_used, job.policy_version) == (
        "refused",
        1.0,
        60,
        None,
    )
    assert job.error == outcome.message and job.finished_at is not None
    assert policies(db_url) == []
    assert audit_actions(db_url) == ["retrain.request", "retrain.finish"]


def test_fit_validate_store_and_activate(db_url):
    seed_run(db_url, 3000, seed=5)
    outcome = run_once(db_url)
    assert outcome.status == "succeeded", outcome.message
    assert outcome.activated and outcome.policy_version == 1 and outcome.rows_used == 3000
    [policy] = policies(db_url)
    m = policy.validation_metrics
    assert policy.active and policy.activated_by == "tester"
    assert policy.feature_names == list(FEATURE_NAMES)
    assert m["holdout_rows"] == 600 and m["rows_used"] == 3000
    assert m["baseline"]["model"] == "the refitted analytic model"
    assert m["baseline"]["version"] is None
    # The synthetic surface (padding jumps) is learnable: better than the analytic model
    # refitted on the same rows, which is what a server without a trained version runs.
    assert m["mape"] < 0.1 and m["mape"] < m["baseline"]["mape"]
    assert m["decision"] == "activated: better than the refitted analytic model"
    # The artifact is the real model: it loads and predicts the held-out error it claims.
    model = XGBoostStepTime.from_bytes(policy.artifact)
    assert model.info.training_rows == policy.training_rows == 1920  # 80% of the 2400 older
    with store.get_engine(db_url).connect() as conn:
        data = retrain.load_training_set(conn, None, 10_000)
    _, holdout = data.split(retrain.HOLDOUT_FRACTION)
    assert retrain.evaluate(model, holdout)["mape"] == pytest.approx(m["mape"])
    job = job_row(db_url, outcome.job_id)
    assert (job.status, job.progress, job.policy_version, job.error) == ("succeeded", 1.0, 1, None)
    assert job.started_at <= job.finished_at
    state = read_control_state(db_url)
    assert state.active_policy_version == 1 and state.policy.artifact == policy.artifact
    assert audit_actions(db_url) == ["retrain.request", "retrain.finish"]


def test_a_worse_version_is_stored_but_not_activated_unless_forced(db_url):
    seed_run(db_url, 3000, seed=6)
    assert run_once(db_url).policy_version == 1
    # One boosting round barely moves off the mean: clearly worse than version 1.
    weak = run_once(db_url, num_rounds=1)
    assert weak.status == "succeeded" and not weak.activated and weak.policy_version == 2
    assert weak.metrics["baseline"]["version"] == 1
    assert weak.metrics["decision"] == "not activated: not better than v1"
    assert read_control_state(db_url).active_policy_version == 1
    forced = run_once(db_url, num_rounds=1, force=True)
    assert forced.activated and forced.metrics["decision"].endswith("(forced)")
    assert [p.active for p in policies(db_url)] == [False, False, True]


def test_one_job_at_a_time_unless_the_other_is_stale(db_url):
    first = retrain.create_job(db_url, "a", options())
    with pytest.raises(retrain.JobConflict, match=f"job {first}"):
        retrain.create_job(db_url, "b", options())
    with store.get_engine(db_url).begin() as conn:
        stale = time.time() - retrain.STALE_JOB_S - 1
        conn.execute(update(RetrainJob).values(requested_at=stale))
    assert retrain.create_job(db_url, "b", options()) == first + 1


def test_training_on_one_run_only(db_url):
    seed_run(db_url, 1500, seed=7, end_time=1_700_000_000.0)
    second = seed_run(db_url, 700, seed=8)
    outcome = run_once(db_url, run_id=second, min_rows=500)
    assert outcome.rows_used == 700 and outcome.metrics["run_id"] == second


def test_training_set_is_oldest_first_and_holds_out_the_newest(db_url):
    seed_run(db_url, 1000, seed=9)
    with store.get_engine(db_url).connect() as conn:
        data = retrain.load_training_set(conn, None, 800)
    assert len(data) == 800 and data.x.shape == (800, len(FEATURE_NAMES))
    assert np.all(np.diff(data.wall_time) >= 0)
    head, tail = data.split(0.25)
    assert len(tail) == 200 and tail.wall_time.min() >= head.wall_time.max()


def test_options_bound_min_rows():
    with pytest.raises(ValueError, match="min_rows"):
        retrain.RetrainOptions(min_rows=1)


def test_cli(db_url, capsys):
    seed_run(db_url, 800, seed=10)
    args = argparse.Namespace(db=db_url, run=None, force=False, min_rows=100)
    assert retrain.run(args) == 0
    out = capsys.readouterr().out
    assert "retrain job 1:" in out and "succeeded: policy version 1" in out
    assert retrain.run(argparse.Namespace(db=db_url, run=None, force=False, min_rows=5000)) == 1
    assert "too few recorded steps" in capsys.readouterr().out
    assert retrain.run(argparse.Namespace(db=db_url, run=77, force=False, min_rows=100)) == 2
    assert "no run 77" in capsys.readouterr().out


def test_retrain_button_runs_in_the_background(operator, db_url):
    seed_run(db_url, 3000, seed=11)
    response = operator.post_json("/api/retrain", {"min_rows": 1000})
    assert response.status_code == 202
    job = response.get_json()
    assert job["status"] in ("queued", "running", "succeeded") and job["policy_version"] is None
    # The request returned before the fit; the job finishes on its own thread.
    done = wait_for(
        lambda: (j := operator.get(f"/api/retrain/{job['id']}").get_json())["finished"] and j
    )
    assert done["status"] == "succeeded" and done["rows_used"] == 3000
    assert done["policy"]["version"] == 1 and done["policy"]["active"]
    assert done["policy"]["validation_metrics"]["mape"] < 0.1
    page = operator.get("/policies").text
    assert (
        'data-version="1"' in page and "activated: better than the refitted analytic model" in page
    )
    assert "held-out MAPE" in operator.get("/retrain").text
    assert operator.get("/api/policies").get_json()["active_version"] == 1


def test_retrain_form_and_its_refusals(operator, db_url):
    seed_run(db_url, 200, seed=12)
    assert operator.post_json("/api/retrain", {"min_rows": 5}).status_code == 400
    assert operator.post_json("/api/retrain", {"run_id": 99}).status_code == 404
    assert operator.post_json("/api/retrain", {"force": "sometimes"}).status_code == 400
    response = operator.post_form("/retrain", {"min_rows": "500", "force": "on"})
    assert response.status_code == 302
    job = wait_for(
        lambda: (j := operator.get("/api/retrain").get_json()["jobs"][0])["finished"] and j
    )
    assert job["status"] == "refused" and job["force"] is True
    assert "too few recorded steps to retrain: 200" in job["error"]
    assert "too few recorded steps" in operator.get("/retrain").text


def test_a_run_priced_by_a_profile_is_judged_against_that_profile(db_url, tmp_path):
    run_id = seed_run(db_url, 3000, seed=7)
    path = tmp_path / "deployment.json"
    # The deployment's profile, built from its own recorded steps.
    profile_from_telemetry(db_url).save(path)
    with store.session_scope(db_url) as s:
        run = s.get_one(Run, run_id)
        run.config = {**run.config, "step_time_profile": str(path)}
    weak = run_once(db_url, num_rounds=1)
    baseline = weak.metrics["baseline"]
    assert baseline["model"] == f"the step-time profile {path}" and baseline["version"] is None
    assert baseline["mape"] < 0.1  # per-shape medians of the same surface
    assert not weak.activated
    assert (
        weak.metrics["decision"] == f"not activated: not better than the step-time profile {path}"
    )
    # A profile that cannot be read here: judged against the refitted analytic model, said so.
    path.unlink()
    again = run_once(db_url, num_rounds=1)
    assert again.metrics["baseline"]["model"].startswith(
        f"the refitted analytic model (the step-time profile {path} does not serve here"
    )
