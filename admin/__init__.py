"""The operator dashboard: a thin Flask layer over the telemetry store.

``create_app(config)`` builds the app. Pages and the JSON API under ``/api/`` share one query
function per dataset (``admin.queries``); ``admin.charts`` turns query results into Plotly
figures; the audited changes (pins, policy versions) are ``telemetry.control``'s. Blueprints,
one concept each: auth, overview, shapes, cost_model, policies, pins, retrain, runs, audit,
openapi; Plotly's JavaScript is served from the installed package at ``/assets/plotly.min.js``.
``adatree admin`` (``admin.commands``) serves it with waitress.

Settings (``config`` keys; environment variables where noted):

* ``ADATREE_ADMIN_TOKEN``: the operator token (default ``$ADATREE_ADMIN_TOKEN``); required.
* ``ADATREE_DB_URL``: the telemetry database (default: the AdaTree configuration's
  ``resolved_db_url``, i.e. ``$ADATREE_DB_URL``, the config file or SQLite under the home).
* ``ADATREE_CONFIG``: an ``AdaTreeConfig`` (default ``load_config()``), whose candidate set
  pins are validated against while no run has recorded one.
* ``ADATREE_RETRAIN_ROUNDS``: boosting rounds of a retrain (default ``xgb_cost``'s).
* ``SECRET_KEY``: signs the session cookie (default: random per process, so a restart logs
  everyone out).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import plotly
from flask import Flask, Response, send_file
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import (
    audit,
    auth,
    cost_model,
    errors,
    openapi,
    overview,
    pins,
    policies,
    retrain,
    runs,
    shapes,
    web,
)

from sglang_adatree.config import load_config
from sglang_adatree.core.xgb_cost import DEFAULT_ROUNDS
from sglang_adatree.telemetry.store import check_schema_at_head, get_engine

MIN_TOKEN_CHARS = 8
TOKEN_ENV = "ADATREE_ADMIN_TOKEN"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; img-src 'self' data:; "
    # Plotly sets inline styles on the elements it draws.
    "style-src 'self' 'unsafe-inline'; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'"
)


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    """The dashboard app; raises ``ValueError`` without an operator token and
    ``telemetry.store.SchemaError`` when the database is not at this package's schema."""
    app = Flask(__name__)
    app.config.from_mapping(
        ADATREE_ADMIN_TOKEN=os.environ.get(TOKEN_ENV),
        ADATREE_DB_URL=None,
        ADATREE_CONFIG=None,
        ADATREE_RETRAIN_ROUNDS=DEFAULT_ROUNDS,
        SECRET_KEY=secrets.token_bytes(32),
        SESSION_COOKIE_NAME="adatree_session",
        SESSION_COOKIE_HTTPONLY=True,
        SESSION_COOKIE_SAMESITE="Strict",
        PERMANENT_SESSION_LIFETIME=timedelta(hours=12),
        MAX_CONTENT_LENGTH=64 * 1024,
        JSON_SORT_KEYS=False,
    )
    app.config.update(config or {})
    token = app.config["ADATREE_ADMIN_TOKEN"]
    if not token or len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"the dashboard needs an operator token of at least {MIN_TOKEN_CHARS} characters: "
            f"set {TOKEN_ENV}"
        )
    adatree_config = app.config["ADATREE_CONFIG"] or load_config()
    engine = get_engine(app.config["ADATREE_DB_URL"] or adatree_config.resolved_db_url)
    check_schema_at_head(engine)
    app.extensions["adatree"] = web.AdminState(engine=engine, config=adatree_config)
    app.json.sort_keys = False
    app.jinja_env.filters.update(web.FILTERS)

    errors.register(app)
    auth.init_app(app)
    for module in (overview, shapes, cost_model, policies, pins, retrain, runs, audit, openapi):
        app.register_blueprint(module.bp)

    @app.get("/assets/plotly.min.js")
    def plotly_js() -> ResponseReturnValue:
        """Plotly's JavaScript from the installed package: the dashboard needs no network."""
        return send_file(PLOTLY_JS, mimetype="text/javascript", max_age=86400)

    @app.after_request
    def _security_headers(response: Response) -> Response:
        response.headers.setdefault("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        if response.mimetype in ("text/html", "application/json"):
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    return app
