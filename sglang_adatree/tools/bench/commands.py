"""``adatree bench``: adatree against every baseline on real SGLang servers, one at a time.

Example (the quick sweep, about 20 minutes on a 2-core CPU)::

    adatree bench --quick --out bench.json --html bench.html

The target and draft default to the bundled pair (``adatree models path``); the draft is the
EAGLE head when one is prepared, else the standalone draft.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sglang_adatree.config import load_config
from sglang_adatree.core.shapes import ShapeError, TreeShape, parse_candidates
from sglang_adatree.core.step_profile import load_profile_step_time
from sglang_adatree.models.paths import ModelPaths
from sglang_adatree.sglang import allocator
from sglang_adatree.tools.bench.client import Load
from sglang_adatree.tools.bench.configurations import (
    SETTING_MARK,
    Models,
    ServerSettings,
    detect_draft_kind,
    parse_configurations,
)
from sglang_adatree.tools.bench.databases import database_url, prepare_database
from sglang_adatree.tools.bench.report import (
    bound_lines,
    comparison_lines,
    table_lines,
    write_html,
    write_json,
)
from sglang_adatree.tools.bench.results import compare
from sglang_adatree.tools.bench.runner import BenchPlan, run_bench
from sglang_adatree.tools.bench.workloads import WORKLOAD_NAMES, load_workload

# name -> (full default, --quick default); explicit options override both.
DEFAULTS: dict[str, tuple[object, object]] = {
    "policies": (
        "ar,static:default,static:sweep,sglang-adaptive,turbospec,adatree",
        "ar,static:default,static:2,2,4,sglang-adaptive,turbospec,adatree",
    ),
    "prompts": ("mtbench,gsm8k,transition", "mtbench"),
    "loads": ("c1,c4,c8", "c1,c4"),
    "num_requests": (16, 4),
    "max_new_tokens": (128, 32),
    "warmup_requests": (2, 2),
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--target``, ``--draft`` and ``--home``, which ``resolve_models`` reads."""
    parser.add_argument("--target", help="target model folder (default: the bundled target)")
    parser.add_argument(
        "--draft", help="draft model folder (default: the bundled EAGLE head or draft)"
    )
    parser.add_argument("--home", help="data directory (default: ADATREE_HOME or config)")


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    """``--step-time-profile``, the file ``adatree+profile`` prices by."""
    parser.add_argument(
        "--step-time-profile",
        type=Path,
        metavar="FILE",
        help="the step-time profile adatree+profile prices by (`adatree profile --shapes "
        "candidates --profile-out FILE`)",
    )


def resolve_profile(args: argparse.Namespace, candidates: Sequence[TreeShape]) -> str | None:
    """``--step-time-profile`` as an absolute path, checked before any server starts: a file
    that cannot be read or lacks a candidate shape raises ``ValueError`` with what to do."""
    if args.step_time_profile is None:
        return None
    profile = str(args.step_time_profile.expanduser().resolve())
    load_profile_step_time(profile, candidates)
    return profile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    add_model_arguments(p)
    p.add_argument(
        "--policies",
        help="comma list of ar, static:S,K,N, static:default, static:sweep, sglang-adaptive, "
        "turbospec, adatree, adatree:SHAPES (its own candidates, ';'-separated), adatree@S,K,N "
        "(pinned), adatree+profile (--step-time-profile) (shapes keep their commas: "
        "'static:3,1,4'); an adatree serve one may add settings of its server: "
        "'adatree+profile/new_batch_steps=1'",
    )
    p.add_argument(
        "--candidate-shapes",
        help="adatree's candidates, e.g. '0;1,1,2;3,1,4;3,2,6' (default: the package's set); "
        "turbospec and the re-implemented sglang-adaptive use their chains",
    )
    p.add_argument(
        "--prompts",
        help=f"comma list of workloads: {', '.join(WORKLOAD_NAMES)} or JSONL files with a "
        "'prompt' field",
    )
    add_profile_argument(p)
    p.add_argument(
        "--loads", help="comma list: cN = N concurrent clients, rX = Poisson X requests/s"
    )
    p.add_argument("--num-requests", type=int, help="requests per point")
    p.add_argument("--max-new-tokens", type=int, help="output tokens per request at most")
    p.add_argument("--warmup-requests", type=int, help="unmeasured requests per server first")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all configurations")
    p.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    p.add_argument("--quick", action="store_true", help="a small sweep (about 20 min on 2 cores)")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--html", type=Path, help="write the HTML report here")
    p.add_argument("--work-dir", type=Path, help="server logs and the telemetry database")
    p.add_argument("--db", help="telemetry database URL (default: SQLite in --work-dir)")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OpenMP threads per server (default 1: on a shared, oversubscribed CPU spinning "
        "OpenMP threads are several times slower than one)",
    )
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per server")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds per server")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    p.add_argument("--dry-run", action="store_true", help="print the server commands and stop")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _option(args: argparse.Namespace, name: str) -> object:
    value = getattr(args, name)
    if value is not None:
        return value
    full, quick = DEFAULTS[name]
    return quick if args.quick else full


def split_items(text: str) -> list[str]:
    """Comma list whose shapes keep their commas: 'ar,static:3,1,4,adatree@2,2,4,adatree'
    (also 'adatree:0;3,1,4', whose last shape takes the numbers that follow it, and
    'adatree@2,2,4/min_gain=0.05', whose settings follow the shape)."""
    items: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        last = items[-1] if items else ""
        if (
            part.split(SETTING_MARK, 1)[0].isdigit()
            and last.startswith(("static:", "adatree:", "adatree@"))
            and last.rsplit(";", 1)[-1].count(",") < 2
        ):
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def resolve_models(args: argparse.Namespace) -> Models:
    """The target and draft folders and the draft's kind; exits with the fix when missing."""
    paths = ModelPaths(load_config(home=args.home).home_dir)
    target = Path(args.target) if args.target else paths.target_dir
    if args.draft:
        draft = Path(args.draft)
    else:
        draft = next(
            (d for d in (paths.eagle_dir, paths.standalone_dir) if (d / "config.json").is_file()),
            paths.standalone_dir,
        )
    for name, folder in (("target", target), ("draft", draft)):
        if not (folder / "config.json").is_file():
            raise SystemExit(
                f"adatree bench: no {name} model at {folder}; run `adatree models prepare` "
                f"or pass --{name}"
            )
    return Models(target.resolve(), draft.resolve(), detect_draft_kind(draft))


def exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    models = resolve_models(args)
    try:
        candidates = parse_candidates(args.candidate_shapes) if args.candidate_shapes else None
        candidates = candidates or load_config().candidate_shapes
        configs = parse_configurations(
            split_items(str(_option(args, "policies"))),
            models.draft_kind,
            candidates,
            resolve_profile(args, candidates),
        )
        loads = [Load.parse(x) for x in str(_option(args, "loads")).split(",") if x.strip()]
        allocator.chosen_allocator(os.environ)
    except (ShapeError, ValueError) as exc:
        raise SystemExit(f"adatree bench: {exc}") from None
    num_requests = int(_option(args, "num_requests"))
    workloads = []
    for spec in (x.strip() for x in str(_option(args, "prompts")).split(",") if x.strip()):
        try:
            workloads.append(load_workload(spec, num_requests, args.seed))
        except (ValueError, FileNotFoundError) as exc:
            raise SystemExit(f"adatree bench: {exc}") from None
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="adatree-bench-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    db_url = args.db or f"sqlite:///{(work_dir / 'telemetry.sqlite').resolve()}"
    settings = ServerSettings(args.device, args.max_total_tokens, args.threads)
    plan = BenchPlan(
        models=models,
        settings=settings,
        configurations=tuple(configs),
        workloads=tuple(workloads),
        loads=tuple(loads),
        max_new_tokens=int(_option(args, "max_new_tokens")),
        work_dir=work_dir,
        db_url=db_url,
        repeats=args.repeats,
        warmup_requests=int(_option(args, "warmup_requests")),
        seed=args.seed,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        chat_template=not args.no_chat_template,
    )
    if args.dry_run:
        for config in configs:
            print(f"# {config.label(models)}")
            env = " ".join(f"{k}={v}" for k, v in config.env(settings).items())
            url = database_url(config, work_dir, db_url)
            print(env, shlex.join(config.command(models, settings, 30000, url)))
        return 0
    for config in configs:
        if config.kind == "adatree-serve":
            prepare_database(database_url(config, work_dir, db_url), config)
    # SIGTERM (and SIGINT, even when a background shell ignores it) unwind through the
    # server's context manager, which stops the server and all its children.
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.time()
    outcome = run_bench(plan, progress=not args.quiet)
    comparison = compare(outcome.rows)
    print("\n".join(table_lines(outcome.rows)))
    print()
    print("\n".join(comparison_lines(comparison)))
    if bounds := bound_lines(outcome.rows):
        print()
        print("\n".join(bounds))
    for name, error in outcome.failures.items():
        print(f"\n{name} did not run: {error}", file=sys.stderr)
    meta = {
        "command": "adatree " + " ".join(sys.argv[1:]),
        "target": str(models.target),
        "draft": str(models.draft),
        "draft_kind": models.draft_kind,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "minutes": round((time.time() - started) / 60.0, 1),
        "server_startup_s": {k: round(v, 1) for k, v in outcome.startup_s.items()},
        "static_shapes": outcome.static_shapes,
        "failures": outcome.failures,
        "work_dir": str(work_dir),
    }
    if args.out:
        write_json(outcome.rows, args.out)
        args.out.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    if args.html:
        write_html(outcome.rows, comparison, outcome.timelines, meta, args.html)
    print(f"\n{meta['minutes']} min; logs and telemetry in {work_dir}", file=sys.stderr)
    return 1 if outcome.failures or not outcome.rows else 0
