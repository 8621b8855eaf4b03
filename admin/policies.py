"""Policy versions: each trained cost model with its validation metrics; activate one, or roll
back to the version active before."""

from __future__ import annotations

from flask import Blueprint, flash, jsonify, redirect, render_template, url_for
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import auth, params, web
from sglang_adatree.admin.queries import runs

from sglang_adatree.telemetry import control

bp = Blueprint("policies", __name__)

VERSION = "<int(min=1, max=2147483647):version>"


@bp.get("/policies")
def page() -> ResponseReturnValue:
    """Every policy version with its metrics and the activate / roll back buttons."""
    with web.reading() as conn:
        run = web.selected_run(conn)
        policies = control.list_policies(conn)
        choices = runs.run_choices(conn)
    return render_template("policies.html", run=run, run_choices=choices, policies=policies)


@bp.post(f"/policies/{VERSION}/activate")
def activate(version: int) -> ResponseReturnValue:
    """Activate a version from the page's form."""
    with web.writing() as conn:
        control.activate_policy(conn, version, auth.actor())
    flash(f"policy version {version} is now active")
    return redirect(url_for("policies.page"))


@bp.post("/policies/rollback")
def rollback() -> ResponseReturnValue:
    """Roll back from the page's form."""
    with web.writing() as conn:
        policy = control.rollback_policy(conn, auth.actor())
    flash(f"rolled back: policy version {policy.version} is active again")
    return redirect(url_for("policies.page"))


@bp.get("/api/policies")
def api_list() -> ResponseReturnValue:
    """Every policy version, newest first."""
    with web.reading() as conn:
        policies = control.list_policies(conn)
        active = control.active_version(conn)
    return jsonify({"active_version": active, "policies": [p.to_json() for p in policies]})


@bp.post(f"/api/policies/{VERSION}/activate")
def api_activate(version: int) -> ResponseReturnValue:
    """Activate a version."""
    params.json_body(allowed=set())
    with web.writing() as conn:
        policy = control.activate_policy(conn, version, auth.actor())
    return jsonify(policy.to_json())


@bp.post("/api/policies/rollback")
def api_rollback() -> ResponseReturnValue:
    """Re-activate the version activated before the current one."""
    params.json_body(allowed=set())
    with web.writing() as conn:
        policy = control.rollback_policy(conn, auth.actor())
    return jsonify(policy.to_json())
