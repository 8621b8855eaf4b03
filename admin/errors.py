"""Every error as a 4xx the caller can read: JSON under ``/api/``, an HTML page elsewhere.

Views raise ``AdminError(status, message)`` for bad input, and the operator-control module
raises ``ControlError`` (its base class) for refused changes; Werkzeug's own
HTTP errors (unknown route, wrong method, body too large) get the same two renderings. An
unexpected exception is logged and answered 500 in the same format (the tests fuzz the API to
keep that from happening).
"""

from __future__ import annotations

import logging

from flask import Flask, Response, jsonify, render_template, request
from flask.typing import ResponseReturnValue
from werkzeug.exceptions import HTTPException

from sglang_adatree.telemetry.control import ControlError

log = logging.getLogger(__name__)


class AdminError(ControlError):
    """A request the dashboard refuses itself: ``status`` (4xx) and a message."""


def is_api_request() -> bool:
    return request.path.startswith("/api/")


def error_response(status: int, message: str) -> tuple[Response | str, int]:
    if is_api_request():
        return jsonify({"error": message, "status": status}), status
    return render_template("error.html", status=status, message=message), status


def register(app: Flask) -> None:
    @app.errorhandler(ControlError)
    def _refused(exc: ControlError) -> ResponseReturnValue:
        return error_response(exc.status, exc.message)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> ResponseReturnValue:
        if exc.code is None or exc.code < 400:
            return exc  # redirects Werkzeug raises while routing
        body, status = error_response(exc.code, exc.description or exc.name)
        response = app.make_response((body, status))
        for name, value in exc.get_headers():
            if name.lower() == "allow":
                response.headers["Allow"] = value
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> ResponseReturnValue:
        log.exception("admin: unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal error; the dashboard's log has the details")
