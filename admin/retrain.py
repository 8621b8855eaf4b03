"""Retrain: refit the cost model from recorded steps on a background thread, with progress and
the result (rows used, held-out error against the current version)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import (
    Blueprint,
    current_app,
    flash,
    jsonify,
    redirect,
    render_template,
    request,
    url_for,
)
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import auth, params, web
from sglang_adatree.admin.errors import AdminError
from sglang_adatree.admin.queries import jobs as job_queries
from sglang_adatree.admin.queries import runs
from sqlalchemy import Connection

from sglang_adatree.telemetry import control
from sglang_adatree.tools import retrain

bp = Blueprint("retrain", __name__)

JOB_ID = "<int(min=1, max=2147483647):job_id>"
FIELDS = {"force", "run_id", "min_rows"}


def _options(conn: Connection, values: Mapping[str, Any]) -> retrain.RetrainOptions:
    run_id = params.parse_optional_int(values.get("run_id"), "run_id", 1, params.MAX_ID)
    if run_id is not None and runs.get_run(conn, run_id) is None:
        raise AdminError(404, f"unknown run {run_id}")
    min_rows = params.parse_int(
        values.get("min_rows", retrain.DEFAULT_MIN_ROWS),
        "min_rows",
        retrain.MIN_ROWS_FLOOR,
        retrain.MAX_TRAINING_ROWS,
    )
    return retrain.RetrainOptions(
        run_id=run_id,
        force=params.parse_bool(values.get("force", False), "force"),
        min_rows=min_rows,
        num_rounds=current_app.config["ADATREE_RETRAIN_ROUNDS"],
    )


def _start(values: Mapping[str, Any]) -> int:
    """Queue the job and hand it to a background thread; the request returns at once."""
    state = web.state()
    with web.reading() as conn:
        options = _options(conn, values)
    try:
        job_id = retrain.create_job(state.engine, auth.actor(), options)  # audited there
    except retrain.JobConflict as exc:
        raise AdminError(409, str(exc)) from None
    thread = retrain.start_job_thread(state.engine, job_id, options, auth.actor())
    state.retrain_threads.append(thread)
    return job_id


@bp.get("/retrain")
def page() -> ResponseReturnValue:
    """The Retrain button, and recent jobs with their progress and results."""
    with web.reading() as conn:
        run = web.selected_run(conn)
        jobs = job_queries.list_jobs(conn)
        policies = {p.version: p for p in control.list_policies(conn)}
        choices = runs.run_choices(conn)
    return render_template(
        "retrain.html",
        run=run,
        run_choices=choices,
        jobs=jobs,
        policies=policies,
        default_min_rows=retrain.DEFAULT_MIN_ROWS,
        min_rows_floor=retrain.MIN_ROWS_FLOOR,
        max_rows=retrain.MAX_TRAINING_ROWS,
    )


@bp.post("/retrain")
def start() -> ResponseReturnValue:
    """Start a retrain from the page's form."""
    values = {
        "force": request.form.get("force", "off"),
        "run_id": request.form.get("run_id", ""),
        "min_rows": request.form.get("min_rows", str(retrain.DEFAULT_MIN_ROWS)),
    }
    job_id = _start(values)
    flash(f"retrain job {job_id} started")
    return redirect(url_for("retrain.page"))


@bp.get("/api/retrain")
def api_list() -> ResponseReturnValue:
    """Recent retrain jobs, newest first."""
    with web.reading() as conn:
        jobs = job_queries.list_jobs(conn)
    return jsonify({"jobs": [j.to_json() for j in jobs]})


@bp.post("/api/retrain")
def api_start() -> ResponseReturnValue:
    """Start a retrain job; poll ``/api/retrain/{job_id}`` for its progress."""
    job_id = _start(params.json_body(allowed=FIELDS))
    with web.reading() as conn:
        job = job_queries.get_job(conn, job_id)
    assert job is not None
    return jsonify(job.to_json()), 202


@bp.get(f"/api/retrain/{JOB_ID}")
def api_job(job_id: int) -> ResponseReturnValue:
    """One retrain job, with the policy version it produced."""
    with web.reading() as conn:
        job = job_queries.get_job(conn, job_id)
        if job is None:
            raise AdminError(404, f"unknown retrain job {job_id}")
        version = None
        if job.policy_version is not None:
            version = control.get_policy(conn, job.policy_version)
    return jsonify({**job.to_json(), "policy": None if version is None else version.to_json()})
