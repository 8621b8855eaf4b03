"""Audit log: every operator change with who made it, when, and the state before and after."""

from __future__ import annotations

from flask import Blueprint, jsonify, render_template
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import web
from sglang_adatree.admin.queries import runs

from sglang_adatree.telemetry import control

bp = Blueprint("audit", __name__)


@bp.get("/audit")
def page() -> ResponseReturnValue:
    """The newest audit entries."""
    with web.reading() as conn:
        run = web.selected_run(conn)
        entries = control.list_audit(conn)
        choices = runs.run_choices(conn)
    return render_template("audit.html", run=run, run_choices=choices, entries=entries)


@bp.get("/api/audit")
def api_list() -> ResponseReturnValue:
    """The newest audit entries, newest first."""
    with web.reading() as conn:
        entries = control.list_audit(conn)
    return jsonify({"entries": [e.to_json() for e in entries]})
