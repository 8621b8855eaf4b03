"""``adatree compare``: a paired, interleaved comparison of configurations (``bench.paired``).

Example (adatree's step without speculation and pinned to 2,2,4 against SGLang's plain
decoding and its own EAGLE worker at 2,2,4; about 15 minutes on a 2-core CPU)::

    adatree compare --policies ar,adatree@0,static:2,2,4,adatree@2,2,4 \\
        --prompts mtbench --num-requests 12 --new-tokens 64 --out compare.json

The first configuration is the reference of the paired ratios. Exits 1 when a request failed
or an answer differs from the reference's (greedy speculative decoding must reproduce it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from sglang_adatree.config import load_config
from sglang_adatree.core.shapes import ShapeError, parse_candidates
from sglang_adatree.sglang import allocator
from sglang_adatree.telemetry.estimates import Estimates
from sglang_adatree.tools.bench.commands import (
    add_model_arguments,
    add_profile_argument,
    exit_on_signal,
    resolve_models,
    resolve_profile,
    split_items,
)
from sglang_adatree.tools.bench.configurations import (
    ServerSettings,
    parse_configurations,
    with_instances,
)
from sglang_adatree.tools.bench.databases import database_url
from sglang_adatree.tools.bench.paired import (
    PairedPlan,
    PairedRun,
    instance_lines,
    machine_load,
    run_paired,
    summarize,
    table_lines,
)
from sglang_adatree.tools.bench.served_estimates import (
    estimate_lines,
    estimates_json,
    read_estimates,
)
from sglang_adatree.tools.bench.servers import ServerError
from sglang_adatree.tools.bench.workloads import WORKLOAD_NAMES, load_workload

DEFAULT_POLICIES = "ar,adatree"
METRICS_FLAG = "--enable-metrics"
STAGE_COLUMNS = 3  # the reference's largest stages get a column each; the rest are summed


def stage_lines(stage_ms: dict[str, dict[str, float]]) -> list[str]:
    """The stage clock as a table: ms per generated token, the reference's ``STAGE_COLUMNS``
    largest stages, the others summed, and the total."""
    first = next(iter(stage_ms.values()))
    shown = list(first)[:STAGE_COLUMNS]
    head = f"{'stage clock, ms/token':<24}" + "".join(f"{s:>24}" for s in shown)
    lines = [head + f"{'other stages':>14}{'total':>9}", "-" * (len(head) + 23)]
    for name, ms in stage_ms.items():
        other = sum(v for k, v in ms.items() if k not in shown)
        cells = "".join(f"{ms.get(s, 0.0):>24.2f}" for s in shown)
        lines.append(f"{name:<24}{cells}{other:>14.2f}{sum(ms.values()):>9.2f}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser
    add_model_arguments(p)
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help="comma list, the first is the reference: ar, static:S,K,N, static:default, "
        "sglang-adaptive, turbospec, adatree, adatree:SHAPES (its own candidates), "
        f"adatree@S,K,N (pinned), adatree+profile (--step-time-profile) "
        f"(default {DEFAULT_POLICIES})",
    )
    p.add_argument(
        "--candidate-shapes", help="adatree's candidates (default: the package's candidate set)"
    )
    p.add_argument(
        "--prompts",
        default="mtbench",
        help=f"one prompt set ({', '.join(WORKLOAD_NAMES)}) or a JSONL file with a 'prompt' "
        "field (default mtbench)",
    )
    add_profile_argument(p)
    p.add_argument(
        "--instances",
        type=int,
        default=1,
        help="servers per configuration, side by side (the k-th named NAME#k): the spread "
        "between servers of one configuration, which one server each cannot show (default 1; "
        "each server holds its own copy of the models in memory)",
    )
    p.add_argument("--num-requests", type=int, default=12, help="prompts, each sent to all")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per answer, EOS ignored")
    p.add_argument("--warmup-requests", type=int, default=2, help="unmeasured requests first")
    p.add_argument("--seed", type=int, default=0, help="prompt draw")
    p.add_argument("--threads", type=int, default=2, help="OMP threads per server")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per server")
    p.add_argument("--device", default="cpu")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds per server")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument added to every server's command line, once per --server-arg "
        "(e.g. --server-arg=--enable-metrics)",
    )
    p.add_argument(
        "--stage-clock",
        action="store_true",
        help="serve with --enable-metrics and report SGLang's scheduler stage clock per "
        "configuration: ms per generated token by stage, over the prompts",
    )
    p.add_argument("--work-dir", type=Path, help="server logs and telemetry databases")
    p.add_argument("--out", type=Path, help="write the summary and every request as JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _plan(args: argparse.Namespace) -> PairedPlan:
    if args.num_requests < 1 or args.new_tokens < 2:
        raise SystemExit("adatree compare: --num-requests must be >= 1 and --new-tokens >= 2")
    if args.instances < 1:
        raise SystemExit("adatree compare: --instances must be >= 1")
    models = resolve_models(args)
    try:
        candidates = parse_candidates(args.candidate_shapes) if args.candidate_shapes else None
        candidates = candidates or load_config().candidate_shapes
        configs = parse_configurations(
            split_items(args.policies),
            models.draft_kind,
            candidates,
            resolve_profile(args, candidates),
        )
        workload = load_workload(args.prompts, args.num_requests, args.seed)
        allocator.chosen_allocator(os.environ)
    except (ShapeError, ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"adatree compare: {exc}") from None
    configs = with_instances(configs, args.instances)
    if len(configs) < 2:
        raise SystemExit(
            "adatree compare: --policies needs at least two configurations "
            "(or one with --instances 2 or more)"
        )
    extra = tuple(args.server_arg)
    if args.stage_clock and METRICS_FLAG not in extra:
        extra += (METRICS_FLAG,)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="adatree-compare-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    return PairedPlan(
        models=models,
        settings=ServerSettings(args.device, args.max_total_tokens, args.threads, extra),
        configurations=tuple(configs),
        workload=workload,
        new_tokens=args.new_tokens,
        work_dir=work_dir,
        warmup_requests=args.warmup_requests,
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        chat_template=not args.no_chat_template,
        stage_clock=args.stage_clock,
    )


def served_estimates(plan: PairedPlan, paired: PairedRun) -> dict[str, Estimates]:
    """Per adatree server, its estimates over the prompts; a database that cannot be read is
    left out with a message (the comparison stands without it)."""
    out = {}
    for config in plan.configurations:
        if config.kind != "adatree-serve":
            continue
        try:
            db_url = database_url(config, plan.work_dir, shared_url=None)
            out[config.name] = read_estimates(db_url, paired.prompts_span)
        except SQLAlchemyError as exc:
            print(f"adatree compare: {config.name}: no estimates: {exc}", file=sys.stderr)
    return out


def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    signal.signal(signal.SIGTERM, exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started, load_before = time.time(), machine_load()
    try:
        paired = run_paired(plan, progress=not args.quiet)
    except ServerError as exc:
        print(f"adatree compare: {exc}", file=sys.stderr)
        return 1
    samples = paired.samples
    names = [(c.name, c.label(plan.models)) for c in plan.configurations]
    summaries = summarize(names, samples)
    load = (load_before + machine_load()) / 2.0
    minutes = (time.time() - started) / 60.0
    print("\n".join(table_lines(summaries)))
    spread = instance_lines(summaries)
    if spread:
        print("\n" + "\n".join(spread))
    print(
        f"\n{plan.workload.name}: {len(plan.workload)} prompts x {plan.new_tokens} tokens, "
        f"order reversed every prompt; TPOT / {summaries[0].name}: median of per-prompt ratios "
        f"(< 1: faster). Machine load {load:.2f}; {minutes:.1f} min; logs in {plan.work_dir}"
    )
    if paired.stage_ms:
        print("\n" + "\n".join(stage_lines(paired.stage_ms)))
    served = served_estimates(plan, paired)
    for name, est in served.items():
        print("\n" + "\n".join(estimate_lines(name, est)))
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "command": "adatree " + " ".join(sys.argv[1:]),
                    "host": platform.node(),
                    "workload": plan.workload.name,
                    "new_tokens": plan.new_tokens,
                    "machine_load_1m": round(load, 2),
                    "minutes": round(minutes, 1),
                    "summary": [asdict(s) for s in summaries],
                    "stage_clock_ms_per_token": paired.stage_ms,
                    "estimates": {name: estimates_json(est) for name, est in served.items()},
                    "samples": [asdict(s) for s in samples],
                },
                indent=1,
            )
            + "\n"
        )
    bad = [s for s in summaries if s.errors or s.identical < s.compared]
    for s in bad:
        print(
            f"adatree compare: {s.name}: {s.errors} failed requests, "
            f"{s.compared - s.identical} answers differ from {summaries[0].name}'s",
            file=sys.stderr,
        )
    return 1 if bad else 0
