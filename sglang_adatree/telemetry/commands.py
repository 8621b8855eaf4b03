"""``adatree db``: ``upgrade``, ``current`` and ``rollup`` of the telemetry database.

The database is ``--db`` if given, else ``ADATREE_DB_URL``, else ``db_url`` from the config file,
else SQLite ``adatree.sqlite`` under ``ADATREE_HOME`` (``AdaTreeConfig.resolved_db_url``).
"""

from __future__ import annotations

import argparse
import sys

from sqlalchemy.exc import SQLAlchemyError

from sglang_adatree.config import AdaTreeConfig, ConfigError, load_config
from sglang_adatree.telemetry import retention, store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = sub.add_parser("upgrade", help="migrate the database to this package's schema (head)")
    cur = sub.add_parser("current", help="show the database's schema revision; exit 1 if behind")
    roll = sub.add_parser("rollup", help="roll old per-step rows up into per-minute aggregates")
    roll.add_argument(
        "--older-than-hours",
        type=float,
        default=None,
        help="roll up steps older than this (default: the retention_hours setting)",
    )
    for p in (up, cur, roll):
        p.add_argument(
            "--db",
            default=None,
            help="database URL (default: $ADATREE_DB_URL, else db_url of the config file, "
            "else SQLite adatree.sqlite under $ADATREE_HOME)",
        )


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(db_url=args.db)
    except ConfigError as exc:
        print(f"adatree db: {exc}", file=sys.stderr)
        return 2
    url = config.resolved_db_url
    try:
        return _run(args, config, url)
    except SQLAlchemyError as exc:
        print(f"adatree db: {store.display_url(url)}: {exc}".splitlines()[0], file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, config: AdaTreeConfig, url: str) -> int:
    shown = store.display_url(url)
    if args.db_command == "upgrade":
        revision = store.upgrade(url)
        print(f"{shown}: at revision {revision} (head)")
        return 0
    if args.db_command == "current":
        try:
            store.check_schema_at_head(store.get_engine(url))
        except store.SchemaError as exc:
            print(exc)
            return 1
        print(f"{shown}: at revision {store.head_revision()} (head)")
        return 0
    hours = config.retention_hours if args.older_than_hours is None else args.older_than_hours
    if hours < 0:
        print("adatree db rollup: --older-than-hours must be >= 0", file=sys.stderr)
        return 2
    engine = store.get_engine(url)
    try:
        store.check_schema_at_head(engine)
    except store.SchemaError as exc:
        print(exc, file=sys.stderr)
        return 1
    result = retention.rollup(engine, older_than_s=hours * 3600.0)
    print(
        f"{shown}: rolled up {result.steps_rolled} steps older than {hours:g} h into "
        f"{result.rollups_written} per-minute rows"
    )
    return 0
