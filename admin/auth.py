"""Login with the operator token, the session, and CSRF protection.

* The token comes from ``ADATREE_ADMIN_TOKEN`` (or the app config of the same name) and is
  compared in constant time. A login stores the operator's name and a fresh CSRF token in the
  session cookie (signed, HttpOnly, SameSite=Strict); nothing else is kept server-side.
* Every page and API call except the login page and static files needs that session: pages
  redirect to the login form, the API answers 401.
* Every state-changing request (anything but GET / HEAD / OPTIONS, the login form included)
  must carry the session's CSRF token, as the form field ``csrf_token`` or the header
  ``X-CSRF-Token``; otherwise 403.
* The audit log names the actor as ``<name>@<client address>``: the token is shared, so the
  name is what the operator typed at login.
"""

from __future__ import annotations

import hmac
import secrets
from urllib.parse import urlsplit

from flask import (
    Blueprint,
    Flask,
    current_app,
    redirect,
    render_template,
    request,
    session,
    url_for,
)
from flask.typing import ResponseReturnValue
from sglang_adatree.admin.errors import AdminError, is_api_request

bp = Blueprint("auth", __name__)

PUBLIC_ENDPOINTS = frozenset({"auth.login", "static"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "X-CSRF-Token"
MAX_NAME_CHARS = 64


def csrf_token() -> str:
    """The session's CSRF token, created on first use (the login form needs one too)."""
    token = session.get("csrf")
    if not token:
        token = session["csrf"] = secrets.token_urlsafe(32)
    return token


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison, so response timing does not leak the token."""
    return hmac.compare_digest(given.encode(), expected.encode())


def actor() -> str:
    """Who is acting, for the audit log."""
    return f"{session.get('user', 'unknown')}@{request.remote_addr or 'local'}"


def logged_in() -> bool:
    return bool(session.get("user"))


def _safe_next(target: str | None) -> str:
    """Only same-site paths: an open redirect after login would be a phishing aid."""
    if not target:
        return url_for("overview.page")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//"):
        return url_for("overview.page")
    return target


def _check_csrf() -> None:
    expected = session.get("csrf")
    given = request.headers.get(CSRF_HEADER) or request.form.get(CSRF_FIELD)
    if not expected or not given or not token_matches(given, expected):
        raise AdminError(403, "CSRF token missing or wrong: reload the page and try again")


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
    app.jinja_env.globals["csrf_token"] = csrf_token

    @app.before_request
    def _guard() -> ResponseReturnValue:
        if request.endpoint not in PUBLIC_ENDPOINTS and not logged_in():
            if is_api_request():
                raise AdminError(401, "login required: POST the operator token to /login")
            return redirect(url_for("auth.login", next=request.full_path.rstrip("?")))
        if request.method not in SAFE_METHODS:
            _check_csrf()
        return None


@bp.route("/login", methods=["GET", "POST"])
def login() -> ResponseReturnValue:
    """The login form; a correct operator token starts a session."""
    if request.method == "GET":
        return render_template("login.html", next=request.args.get("next", ""), error=None)
    name = request.form.get("name", "").strip()[:MAX_NAME_CHARS] or "operator"
    given = request.form.get("token", "")
    if not token_matches(given, current_app.config["ADATREE_ADMIN_TOKEN"]):
        error = "wrong operator token"
        return render_template("login.html", next=request.form.get("next", ""), error=error), 401
    # A new session on login, so a session fixed by someone else before it is worthless.
    session.clear()
    session.permanent = True
    session["user"] = name
    csrf_token()
    return redirect(_safe_next(request.form.get("next")))


@bp.post("/logout")
def logout() -> ResponseReturnValue:
    """End the session."""
    session.clear()
    return redirect(url_for("auth.login"))
