"""``adatree soak --minutes N [--db URL|postgresql] [--out FILE.json]``: see ``tools.soak``.

Prints the report as JSON (and writes it to ``--out``); exits 1 when a must-show check fails
(``report.checks``), 2 when the soak could not run.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--minutes",
        type=float,
        default=30.0,
        help="how long to soak (default %(default)s; 3 is the CI form)",
    )
    add(
        "--db",
        default=None,
        help="telemetry database: a SQLAlchemy URL, or 'postgresql' for a PostgreSQL cluster of "
        "the soak's own (stopped and restarted mid-soak); default a fresh SQLite file in the "
        "work directory (made read-only, deleted and restored mid-soak)",
    )
    add("--out", type=Path, default=None, help="write the report here (JSON)")
    add(
        "--work-dir",
        type=Path,
        default=None,
        help="server logs and the SQLite file (default a new temporary one)",
    )
    add(
        "--draft",
        choices=("eagle", "standalone"),
        default="eagle",
        help="the bundled draft to serve (default %(default)s)",
    )
    add(
        "--threads",
        type=int,
        default=1,
        help="OMP threads per server (default %(default)s, as adatree bench: spinning threads "
        "on a shared CPU cost more than they give)",
    )
    add(
        "--greedy-prompts",
        type=int,
        default=8,
        help="fixed greedy prompts compared with the reference (default %(default)s)",
    )
    add(
        "--rss-slope-limit",
        type=float,
        default=1.0,
        help="the slope of the RSS peaks after warm-up that passes, MB/min (default %(default)s)",
    )
    add("--no-browser", action="store_true", help="no headless Chromium on the dashboard")


def run(args: argparse.Namespace) -> int:
    from sglang_adatree.tools.bench.commands import exit_on_signal
    from sglang_adatree.tools.bench.servers import ServerError
    from sglang_adatree.tools.soak.runner import SoakOptions, run_soak

    options = SoakOptions(
        minutes=args.minutes,
        db=args.db,
        work_dir=args.work_dir,
        draft=args.draft,
        threads=args.threads,
        greedy_prompts=args.greedy_prompts,
        rss_slope_limit=args.rss_slope_limit,
        browser=not args.no_browser,
    )
    # SIGTERM (and SIGINT, even when a background shell ignores it) unwind through the soak's
    # exit stack, which stops both servers, the browser and the soak's own PostgreSQL cluster.
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result = run_soak(options, log=lambda line: print(line, file=sys.stderr, flush=True))
    except (ServerError, RuntimeError, ValueError) as exc:
        print(f"adatree soak: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    failed = [name for name, ok in result["checks"].items() if not ok]
    if failed:
        print(f"adatree soak: failed checks: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
