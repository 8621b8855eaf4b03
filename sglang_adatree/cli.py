"""The ``adatree`` command: a thin dispatcher over one module per sub-command.

Each sub-command lives in its own module, which defines ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their command runs, so ``adatree db``
does not pay for importing torch or SGLang.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Order is the order of `adatree --help`.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("sglang_adatree.sglang.serve", "run SGLang with adatree (its options + SGLang's)"),
    "admin": ("sglang_adatree.admin.commands", "serve the operator dashboard"),
    "demo": (
        "sglang_adatree.tools.demo",
        "the bundled model pair, a short workload and the dashboard",
    ),
    "db": ("sglang_adatree.telemetry.commands", "telemetry database: upgrade, current, rollup"),
    "retrain": ("sglang_adatree.tools.retrain", "refit the cost model from recorded steps"),
    "profile": ("sglang_adatree.tools.profile", "profile step times of candidate shapes"),
    "bench": ("sglang_adatree.tools.bench.commands", "benchmark adatree against the baselines"),
    "compare": (
        "sglang_adatree.tools.bench.compare",
        "paired comparison of configurations served side by side",
    ),
    "soak": (
        "sglang_adatree.tools.soak.commands",
        "a soak under moving load, operator actions and database faults",
    ),
    "models": ("sglang_adatree.models.commands", "prepare, train and evaluate the bundled models"),
    "simulate": (
        "sglang_adatree.lab.commands",
        "replay policies against the oracles in the policy lab",
    ),
}


def build_parser(argv: Sequence[str]) -> tuple[argparse.ArgumentParser, object | None]:
    """The top-level parser; only the chosen sub-command's module is imported."""
    parser = argparse.ArgumentParser(
        prog="adatree", description="Adaptive tree speculative decoding for SGLang."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (module_name, help_text) in COMMANDS.items():
        cmd_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(cmd_parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        # `serve` passes every option it does not own through to SGLang untouched.
        module = importlib.import_module(COMMANDS["serve"][0])
        return int(module.main(argv[1:]))
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        return 2
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
