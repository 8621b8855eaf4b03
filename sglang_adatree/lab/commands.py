"""``adatree simulate``: replay policies in the lab (``--list``, ``--scenario``, ``--grid``).

    adatree simulate --list
    adatree simulate --scenario load-h100-c16 [--out rows.json] [--html report.html]
    adatree simulate --grid default --out grid.json --html grid.html
    adatree simulate --scenario models-cpu-eagle-mtbench-c1 --prompts my.jsonl
    adatree simulate --scenario load-h100-c16 --profile-from-db postgresql://...
    adatree simulate --grid validation --profile h100-sxm | --profile my-profile.json
    adatree simulate --grid default --profiled-start 0.03

``--prompts FILE.jsonl`` replays the scenario with exact traces of that prompt file under the
scenario's bundled draft (built once, cached). ``--profile-from-db URL`` charges the step times a
deployment recorded in its telemetry database instead of the scenario's profile; ``--profile``
charges another named profile's, or a profile file's (``adatree profile --profile-out`` writes
one). The policies are the serving loop's own code, configured like a server (``ADATREE_*``
environment and config file) except the candidate shapes, which are the scenario's; a
configured ``step_time_profile`` prices them as it would a server's. ``--profiled-start ERROR``
starts them from the scenario's own profile instead, each shape off by a seeded log-normal
``ERROR`` and the whole 15% slow (``sources.profiled_start``): what a profile sweep of the
deployment would give a server.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from sglang_adatree.config import AdaTreeConfig, ConfigError, load_config
from sglang_adatree.core.step_profile import (
    ProfileStepTime,
    StepTimeProfile,
    load_profile_step_time,
)
from sglang_adatree.lab import report, sources
from sglang_adatree.lab.runner import DECOMPOSITION, decomposition_order, run_scenario
from sglang_adatree.lab.scenarios import GRIDS, Scenario, all_scenarios
from sglang_adatree.lab.sources import SourceError
from sglang_adatree.telemetry.store import SchemaError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="print the scenarios, one a line")
    what.add_argument("--scenario", action="append", metavar="NAME", help="run this scenario")
    what.add_argument("--grid", choices=sorted(GRIDS), help="run a named grid")
    parser.add_argument("--out", type=Path, help="write the rows as a JSON list here")
    parser.add_argument("--html", type=Path, help="write an HTML report with charts here")
    parser.add_argument("--prompts", help="a JSONL file (or a prompt set): exact traces of it")
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--profile-from-db", metavar="URL", help="a deployment's step times")
    profile.add_argument(
        "--profile",
        metavar="NAME|FILE",
        help="another step-time profile: a name (cpu-2core, h100-sxm, ...) or a profile JSON file",
    )
    parser.add_argument(
        "--profiled-start",
        type=float,
        metavar="ERROR",
        help="the adaptive policies start from the scenario's own profile, each shape off by a "
        "seeded log-normal ERROR (e.g. 0.03), as a server with step_time_profile does",
    )
    parser.add_argument("--seed", type=int, default=None, help="override the scenarios' seed")
    parser.add_argument(
        "--tilt",
        type=float,
        default=None,
        metavar="T",
        help="the machine splits its time otherwise than the profile: each shape's step time over "
        "no speculation's is the profile's raised to exp(T) (e.g. 0.4: trees dearer)",
    )
    parser.add_argument(
        "--cold-step",
        type=float,
        default=None,
        metavar="F",
        help="a speculative shape's first step in a run costs F times its time, as a served "
        "shape's first step pays one-off costs (e.g. 1.15; default 1: none)",
    )
    parser.add_argument("--no-decompose", action="store_true", help="skip the loss split")
    parser.add_argument(
        "--decompose-order",
        metavar="CAUSES",
        default=",".join(DECOMPOSITION),
        help="the order in which the loss split replaces the causes, comma-separated "
        f"(default {','.join(DECOMPOSITION)})",
    )
    parser.add_argument("--home", default=None, help="data directory (traces are cached there)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def _scenarios(args: argparse.Namespace) -> list[Scenario]:
    if args.grid:
        chosen = list(GRIDS[args.grid]())
    else:
        known = all_scenarios()
        unknown = [n for n in args.scenario if n not in known]
        if unknown:
            raise SourceError(
                f"unknown scenario {', '.join(unknown)}; `adatree simulate --list` names them"
            )
        chosen = [known[n] for n in args.scenario]
    out = []
    for s in chosen:
        if args.prompts:
            pair = s.traces.partition(":")[0]
            if pair not in sources.BUNDLED_DRAFTS:
                pair = sources.BUNDLED_DRAFTS[0]
            s = dataclasses.replace(s, traces=f"{pair}:{args.prompts}")
        if args.profile_from_db:
            s = dataclasses.replace(s, profile=f"db:{args.profile_from_db}")
        if args.profile:
            s = dataclasses.replace(s, profile=args.profile)
        if args.seed is not None:
            s = dataclasses.replace(s, sim=dataclasses.replace(s.sim, seed=args.seed))
        if args.tilt is not None:
            s = dataclasses.replace(s, sim=dataclasses.replace(s.sim, tilt=args.tilt))
        if args.cold_step is not None:
            s = dataclasses.replace(s, sim=dataclasses.replace(s.sim, cold_step=args.cold_step))
        out.append(s)
    return out


def _profiled(
    args: argparse.Namespace, config: AdaTreeConfig, profile: StepTimeProfile, s: Scenario
) -> ProfileStepTime | None:
    """The step-time profile the controller starts from: the scenario's own, perturbed
    (``--profiled-start``), or the configured ``step_time_profile`` as a server reads it."""
    if args.profiled_start is not None:
        if config.step_time_profile:
            raise SourceError("--profiled-start and step_time_profile: choose one")
        return ProfileStepTime(sources.profiled_start(profile, args.profiled_start, s.sim.seed))
    if config.step_time_profile:
        return load_profile_step_time(config.step_time_profile, s.candidates)
    return None


def run(args: argparse.Namespace) -> int:
    if args.list:
        for s in all_scenarios().values():
            print(f"{s.name}  [{s.condition}] {s.describe()}")
        return 0
    try:
        config = load_config(home=args.home)
        scenarios = _scenarios(args)
        order = decomposition_order([c.strip() for c in args.decompose_order.split(",")])
        replayed = []
        started = time.perf_counter()
        for i, s in enumerate(scenarios, start=1):
            if not args.quiet:
                print(f"[{i}/{len(scenarios)}] {s.name}: {s.describe()}", flush=True)
            traces = sources.load_traces(
                s.traces,
                s.candidates,
                s.answer_tokens,
                config.home_dir,
                progress=not args.quiet,
                num_prompts=s.sim.num_requests,
            )
            profile = sources.load_profile(s.profile, s.candidates)
            profiled = _profiled(args, config, profile, s)
            result = run_scenario(
                traces,
                profile,
                s.sim,
                config,
                s.candidates,
                decompose=not args.no_decompose,
                profiled=profiled,
                decompose_order=order,
            )
            replayed.append(
                report.Replayed(
                    s,
                    traces.label,
                    traces.kind,
                    f"{profile.name} ({profile.source})"
                    + (f"; priced by {profiled.profile.name}" if profiled else ""),
                    result,
                )
            )
    except (SourceError, ConfigError, SchemaError, SQLAlchemyError, ValueError, OSError) as exc:
        print(f"adatree simulate: {exc}", file=sys.stderr, flush=True)
        return 2
    print(report.table(replayed))
    if not args.quiet:
        print(f"\n{len(replayed)} scenarios in {time.perf_counter() - started:.1f} s")
    command = "adatree simulate " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else [])
    if args.out:
        report.write_json(replayed, args.out)
    if args.html:
        report.write_html(replayed, command, args.html)
    return 0
