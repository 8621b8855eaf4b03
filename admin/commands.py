"""``adatree admin [--db URL] [--host HOST] [--port PORT]``: serve the dashboard with waitress.

Binds 127.0.0.1 by default. Without ``ADATREE_ADMIN_TOKEN`` it makes a one-off token and prints
it, but only on a loopback address: anywhere else it refuses to start, since the token is the
only thing between the network and the pins.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import threading

from flask import Flask
from sqlalchemy.exc import SQLAlchemyError

from sglang_adatree.config import ConfigError, load_config
from sglang_adatree.telemetry.store import SchemaError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8050
TOKEN_ENV = "ADATREE_ADMIN_TOKEN"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses; any other name counts as exposed."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db",
        default=None,
        help="database URL (default: $ADATREE_DB_URL, else db_url of the config file, "
        "else SQLite adatree.sqlite under $ADATREE_HOME)",
    )
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}; others need {TOKEN_ENV})",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default %(default)s)")
    parser.add_argument(
        "--threads", type=int, default=4, help="waitress worker threads (default %(default)s)"
    )


def _warm(app: Flask) -> None:
    """Fill the latest run's granule cache, so the first long-range view is fast too."""
    from sglang_adatree.admin import web
    from sglang_adatree.admin.queries import runs

    with app.app_context():
        state = web.state()
        with state.engine.connect() as conn:
            run_id = runs.latest_run_id(conn)
            if run_id is not None:
                state.granules.sums(conn, run_id, 0.0, 0.0)


def run(args: argparse.Namespace) -> int:
    import waitress
    from sglang_adatree.admin import create_app

    if not 1 <= args.port <= 65535:
        print(f"adatree admin: --port must be in [1, 65535], got {args.port}")
        return 2
    token = os.environ.get(TOKEN_ENV)
    if not token:
        if not is_loopback(args.host):
            print(
                f"adatree admin: refusing to serve on {args.host} without an operator token: "
                f"set {TOKEN_ENV} (or bind a loopback address such as {DEFAULT_HOST})"
            )
            return 2
        token = secrets.token_urlsafe(18)
        print(f"adatree admin: no {TOKEN_ENV} set; operator token for this process: {token}")
    try:
        config = load_config(db_url=args.db)
        app = create_app({"ADATREE_ADMIN_TOKEN": token, "ADATREE_CONFIG": config})
    except (ValueError, ConfigError, SchemaError, SQLAlchemyError) as exc:
        print(f"adatree admin: {exc}")
        return 2
    threading.Thread(target=_warm, args=(app,), name="admin-warm", daemon=True).start()
    print(f"adatree admin: http://{args.host}:{args.port}/ (Ctrl-C stops)", flush=True)
    waitress.serve(app, host=args.host, port=args.port, threads=args.threads, ident="adatree")
    return 0
