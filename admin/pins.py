"""Pins: force a shape for all batches or a batch-size range, with a reason; clear it. Only
shapes of the candidate set (``queries.runs.candidate_set``) can be pinned."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Blueprint, flash, jsonify, redirect, render_template, request, url_for
from flask.typing import ResponseReturnValue

from admin import actions, auth, params, web
from admin.errors import AdminError
from admin.queries import control, runs

bp = Blueprint("pins", __name__)

PIN_ID = "<int(min=1, max=2147483647):pin_id>"
FIELDS = {"shape", "min_batch_size", "max_batch_size", "reason"}


def _pin_request(values: Mapping[str, Any]) -> actions.PinRequest:
    if "shape" not in values or "reason" not in values:
        raise AdminError(400, "shape and reason are required")
    bounds = (1, params.MAX_BATCH_SIZE)
    return actions.PinRequest(
        shape=params.parse_shape(values["shape"]),
        min_batch_size=params.parse_optional_int(
            values.get("min_batch_size"), "min_batch_size", *bounds
        ),
        max_batch_size=params.parse_optional_int(
            values.get("max_batch_size"), "max_batch_size", *bounds
        ),
        reason=params.parse_reason(values["reason"]),
    )


def _candidates(conn) -> runs.CandidateSet:
    return runs.candidate_set(conn, web.state().config)


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
    req = _pin_request(request.form)
    with web.writing() as conn:
        pin = actions.create_pin(conn, _candidates(conn), req, auth.actor())
    flash(f"pinned shape {pin.shape} for {pin.batch_range()}")
    return redirect(url_for("pins.page"))


@bp.post(f"/pins/{PIN_ID}/clear")
def clear(pin_id: int) -> ResponseReturnValue:
    """Clear a pin from the page's form."""
    with web.writing() as conn:
        pin = actions.clear_pin(conn, pin_id, auth.actor())
    flash(f"cleared pin {pin.id} ({pin.shape})")
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
    req = _pin_request(params.json_body(allowed=FIELDS, required={"shape", "reason"}))
    with web.writing() as conn:
        pin = actions.create_pin(conn, _candidates(conn), req, auth.actor())
    return jsonify(pin.to_json()), 201


@bp.post(f"/api/pins/{PIN_ID}/clear")
def api_clear(pin_id: int) -> ResponseReturnValue:
    """Clear a pin."""
    params.json_body(allowed=set())
    with web.writing() as conn:
        pin = actions.clear_pin(conn, pin_id, auth.actor())
    return jsonify(pin.to_json())
