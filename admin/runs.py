"""Runs: every recorded server start; choosing one makes every page show it."""

from __future__ import annotations

from flask import Blueprint, jsonify, render_template
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import web
from sglang_adatree.admin.errors import AdminError
from sglang_adatree.admin.queries import runs

bp = Blueprint("runs", __name__)


@bp.get("/runs")
def page() -> ResponseReturnValue:
    """The runs, newest first, each linking to its overview."""
    with web.reading() as conn:
        run = web.selected_run(conn)
        listed = runs.list_runs(conn)
        choices = runs.run_choices(conn)
    return render_template("runs.html", run=run, run_choices=choices, runs=listed)


@bp.get("/api/runs")
def api_list() -> ResponseReturnValue:
    """The runs, newest first."""
    with web.reading() as conn:
        listed = runs.list_runs(conn)
    return jsonify({"runs": [r.to_json() for r in listed]})


@bp.get("/api/runs/<int(min=1, max=2147483647):run_id>")
def api_run(run_id: int) -> ResponseReturnValue:
    """One run."""
    with web.reading() as conn:
        run = runs.get_run(conn, run_id)
    if run is None:
        raise AdminError(404, f"unknown run {run_id}")
    return jsonify(run.to_json())
