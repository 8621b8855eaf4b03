"""``adatree serve``: adatree's own options, then SGLang's launcher with everything else.

adatree's options become the environment every SGLang process inherits (``ADATREE_CONFIG``,
``ADATREE_DB_URL``, ``ADATREE_CANDIDATE_SHAPES``, ``ADATREE_STEP_TIME_PROFILE``); every other
argument goes to ``python -m sglang.launch_server`` unchanged, so SGLang's flags keep their
meaning. The launcher replaces this process (``exec``), so signals reach SGLang directly.

On ``--device cpu`` it also supplies the settings SGLang needs there, unless given:
``--disable-cuda-graph``, ``--sleep-on-idle`` (an idle scheduler busy-polls a core otherwise),
``--max-total-tokens 32768`` (SGLang sizes the KV pool from free
memory otherwise: most of the machine), ``--dtype float32``, one tokenizer and one
detokenizer process, ``OMP_NUM_THREADS`` = the CPU count for the model process, and tcmalloc in
``LD_PRELOAD`` for every process where it is installed (``allocator``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sglang_adatree.config import ConfigError, load_config
from sglang_adatree.core.shapes import ShapeError, parse_candidates
from sglang_adatree.sglang import allocator

CPU_DEFAULTS: tuple[tuple[str, str | None], ...] = (
    ("--disable-cuda-graph", None),
    # An idle scheduler otherwise polls for requests in a busy loop: a whole core of a small
    # machine, taken from the tokenizer, the client and everything else.
    ("--sleep-on-idle", None),
    ("--max-total-tokens", "32768"),
    ("--dtype", "float32"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adatree serve",
        description=(
            "Run SGLang with --speculative-algorithm adatree. Options below are adatree's; "
            "all others are passed to `python -m sglang.launch_server`."
        ),
        add_help=False,
    )
    parser.add_argument("--adatree-config", help="adatree TOML config file (ADATREE_CONFIG)")
    parser.add_argument("--db", help="telemetry database URL (ADATREE_DB_URL)")
    parser.add_argument(
        "--candidate-shapes",
        help="candidate shapes, e.g. '0;3,1,4;5,4,8' (ADATREE_CANDIDATE_SHAPES)",
    )
    parser.add_argument(
        "--step-time-profile",
        help="price the candidates by this deployment's step-time profile, as `adatree profile "
        "--shapes candidates --profile-out FILE` writes it (ADATREE_STEP_TIME_PROFILE)",
    )
    parser.add_argument("--adatree-help", action="help", help="show adatree's options")
    return parser


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def build_command(argv: Sequence[str], env: dict[str, str]) -> list[str]:
    """The SGLang command line for ``argv``; updates ``env`` with adatree's settings.

    Raises ``SystemExit(2)`` with a message for a bad adatree option, before SGLang starts.
    """
    ours, rest = _parser().parse_known_args(list(argv))
    if ours.adatree_config:
        env["ADATREE_CONFIG"] = ours.adatree_config
    if ours.db:
        env["ADATREE_DB_URL"] = ours.db
    if ours.step_time_profile:
        env["ADATREE_STEP_TIME_PROFILE"] = str(Path(ours.step_time_profile).expanduser().resolve())
    if ours.candidate_shapes:
        try:
            parse_candidates(ours.candidate_shapes)
        except ShapeError as exc:
            raise SystemExit(f"adatree serve: --candidate-shapes: {exc}") from None
        env["ADATREE_CANDIDATE_SHAPES"] = ours.candidate_shapes
    try:
        load_config(env=env)
    except ConfigError as exc:
        raise SystemExit(f"adatree serve: {exc}") from None
    if not _has_flag(rest, "--speculative-algorithm"):
        rest += ["--speculative-algorithm", "adatree"]
    if _flag_value(rest, "--device") == "cpu":
        for flag, value in CPU_DEFAULTS:
            if not _has_flag(rest, flag):
                rest += [flag] if value is None else [flag, value]
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            preload = allocator.preload(env)
        except ValueError as exc:
            raise SystemExit(f"adatree serve: {exc}") from None
        if preload is not None:
            env["LD_PRELOAD"] = preload
        elif note := allocator.missing_note(env):
            print(f"adatree serve: {note}", file=sys.stderr)
    return [sys.executable, "-m", "sglang.launch_server", *rest]


def main(argv: Sequence[str]) -> int:
    env = dict(os.environ)
    command = build_command(argv, env)
    os.execvpe(command[0], command, env)
    return 0  # not reached: exec replaced the process
