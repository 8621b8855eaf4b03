"""Pins: force a shape for all batches or a batch-size range, with a reason; clear it. The
rules (only shapes of the candidate set, bounds, the audit entry) are
``telemetry.control``'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Blueprint, flash, jsonify, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import auth, params, web
from sglang_adatree.admin.errors import AdminError
from sglang_adatree.admin.queries import runs
from sqlalchemy import Connection

from sglang_adatree.core.policy import Pin
from sglang_adatree.telemetry import control

bp = Blueprint("pins", __name__)

PIN_ID = "<int(min=1, max=2147483647):pin_id>"
FIELDS = {"shape", "min_batch_size", "max_batch_size", "reason"}


def _pin_request(values: Mapping[str, Any]) -> tuple[Pin, str]:
    """The pin and its reason from a form or JSON body (400 for anything malformed)."""
    if "shape" not in values or "reason" not in values:
        raise AdminError(400, "shape and reason are required")
    bounds = (1, params.MAX_BATCH_SIZE)
    try:
        pin = Pin(
            params.parse_shape(values["shape"]),
            params.parse_optional_int(values.get("min_batch_size"), "min_batch_size", *bounds),
            params.parse_optional_int(values.get("max_batch_size"), "max_batch_size", *bounds),
        )
    except ValueError as exc:  # the pin's own rules: bounds >= 1, min <= max
        raise AdminError(400, str(exc)) from None
    return pin, params.parse_reason(values["reason"])


def _candidates(conn: Connection) -> control.CandidateSet:
    return control.candidate_set(conn, web.state().config.candidate_shapes)


@bp.get("/pins")
def page() -> ResponseReturnValue:
    """Active and recently cleared pins, and the form to pin a shape."""
    with web.reading() as conn:
        run = web.selected_run(conn)
        active, cleared = control.list_pins(conn)
        candidates = _candidates(conn)
        choices = runs.run_choices(conn)
    return render_template(
        "pins.html",
        run=run,
        run_choices=choices,
        active=active,
        cleared=cleared,
        candidates=candidates,
    )


@bp.post("/pins")
def create() -> ResponseReturnValue:
    """Pin a shape from the page's form."""
    pin, reason = _pin_request(request.form)
    with web.writing() as conn:
        record = control.create_pin(conn, _candidates(conn), pin, reason, auth.actor())
    flash(f"pinned shape {record.shape} for {record.batch_range()}")
    return redirect(url_for("pins.page"))


@bp.post(f"/pins/{PIN_ID}/clear")
def clear(pin_id: int) -> ResponseReturnValue:
    """Clear a pin from the page's form."""
    with web.writing() as conn:
        record = control.clear_pin(conn, pin_id, auth.actor())
    flash(f"cleared pin {record.id} ({record.shape})")
    return redirect(url_for("pins.page"))


@bp.get("/api/pins")
def api_list() -> ResponseReturnValue:
    """Active pins (newest first, the order the server applies them) and recently cleared."""
    with web.reading() as conn:
        active, cleared = control.list_pins(conn)
        candidates = _candidates(conn)
    return jsonify(
        {
            "active": [p.to_json() for p in active],
            "cleared": [p.to_json() for p in cleared],
            "candidates": candidates.to_json(),
        }
    )


@bp.post("/api/pins")
def api_create() -> ResponseReturnValue:
    """Pin a shape."""
    pin, reason = _pin_request(params.json_body(allowed=FIELDS, required={"shape", "reason"}))
    with web.writing() as conn:
        record = control.create_pin(conn, _candidates(conn), pin, reason, auth.actor())
    return jsonify(record.to_json()), 201


@bp.post(f"/api/pins/{PIN_ID}/clear")
def api_clear(pin_id: int) -> ResponseReturnValue:
    """Clear a pin."""
    params.json_body(allowed=set())
    with web.writing() as conn:
        record = control.clear_pin(conn, pin_id, auth.actor())
    return jsonify(record.to_json())
