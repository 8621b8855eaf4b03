"""Every error as a response the caller can read: JSON under ``/api/``, an HTML page elsewhere.

Views raise ``AdminError(status, message)`` for bad input, and the operator-control module
raises ``ControlError`` (its base class) for refused changes; Werkzeug's own
HTTP errors (unknown route, wrong method, body too large) get the same two renderings.

A telemetry database that is down, unreachable, locked or read-only is answered 503, naming
the database and its error, with ``Retry-After``: the operator's fix is the database, not the
dashboard. The dashboard logs one warning when such an outage starts and one when a request
succeeds again. Any other unexpected exception is logged and answered 500 in the same format
(the tests fuzz the API to keep that from happening).
"""

from __future__ import annotations

import logging
import threading
import time

from flask import Flask, Response, current_app, g, jsonify, render_template, request
from flask.typing import ResponseReturnValue
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from werkzeug.exceptions import HTTPException

from sglang_adatree.telemetry.control import ControlError
from sglang_adatree.telemetry.store import display_url

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
# SQLSTATE classes of a database that cannot serve now: 08 connection exception, 53
# insufficient resources (disk full), 57 operator intervention (shutdown, starting up); and
# 25006, a read-only transaction (a hot standby, a read-only database).
UNAVAILABLE_SQLSTATES = ("08", "53", "57", "25006")


class AdminError(ControlError):
    """A request the dashboard refuses itself: ``status`` (4xx) and a message."""


def is_api_request() -> bool:
    return request.path.startswith("/api/")


def error_response(status: int, message: str) -> tuple[Response | str, int]:
    if is_api_request():
        return jsonify({"error": message, "status": status}), status
    return render_template("error.html", status=status, message=message), status


def database_unavailable(exc: DBAPIError) -> bool:
    """Whether ``exc`` says the database cannot serve now (down, unreachable, locked, read-only,
    deleted) rather than that a statement is wrong: SQLite and psycopg report the former as
    ``OperationalError`` (or a lost connection), PostgreSQL's read-only transactions by their
    SQLSTATE."""
    if isinstance(exc, OperationalError | InterfaceError) or exc.connection_invalidated:
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None) or ""
    return sqlstate.startswith(UNAVAILABLE_SQLSTATES)


class OutageLog:
    """One warning when the database stops serving reads (or writes), one when a request's
    reads (or writes) succeed again. Reads and writes are tracked apart: a read-only database
    still serves the pages, and must not end the writes' outage with every refresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down_since: dict[str, float] = {}

    def failed(self, kind: str, url: str, cause: str) -> None:
        with self._lock:
            if kind in self._down_since:
                return
            self._down_since[kind] = time.monotonic()
        log.warning("admin: telemetry database %s refuses %s (%s); answering 503", url, kind, cause)

    def succeeded(self, kind: str) -> None:
        if kind not in self._down_since:  # the common case, without the lock
            return
        with self._lock:
            since = self._down_since.pop(kind, None)
        if since is not None:
            log.warning(
                "admin: telemetry database serves %s again after %.1f s",
                kind,
                time.monotonic() - since,
            )


def _access_kind() -> str:
    """What a request does to the database: every POST that reaches it writes (pins, policy
    versions, retrain jobs, each with its audit entry); everything else reads."""
    return "writes" if request.method == "POST" else "reads"


def _cause(exc: DBAPIError) -> str:
    orig = exc.orig if exc.orig is not None else exc
    return f"{type(orig).__name__}: {orig}".splitlines()[0].strip()


def register(app: Flask) -> None:
    outages = OutageLog()

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

    @app.errorhandler(DBAPIError)
    def _database_error(exc: DBAPIError) -> ResponseReturnValue:
        if not database_unavailable(exc):
            return _unexpected(exc)
        url = display_url(current_app.extensions["adatree"].engine.url)
        cause = _cause(exc)
        outages.failed(_access_kind(), url, cause)
        message = f"the telemetry database {url} is unavailable: {cause}"
        response = app.make_response(error_response(503, message))
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> ResponseReturnValue:
        log.exception("admin: unexpected error on %s %s", request.method, request.path)
        return error_response(500, "internal error; the dashboard's log has the details")

    @app.after_request
    def _database_answered(response: Response) -> Response:
        if g.get("database_answered") and response.status_code < 500:
            outages.succeeded(_access_kind())
        return response
