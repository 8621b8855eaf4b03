"""Both bundled drafts from nothing: prepare -> datagen -> train -> export -> evaluate.

Every stage resumes: prepare is idempotent, datagen skips finished shards, training resumes
from its last checkpoint. Re-running with a larger budget continues where the last run stopped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass

from sglang_adatree.models.commands import add_dtype_argument, check_device
from sglang_adatree.models.hardware import resolve_dtype
from sglang_adatree.models.paths import ModelPaths
from sglang_adatree.models.prompts import EVAL_SETS


@dataclass(frozen=True)
class Budget:
    """How much of each stage to run."""

    tokens: int = 400_000  # training answer tokens to generate
    datagen_hours: float = 6.0
    workers: int = 2  # datagen processes of one thread each
    eagle_minutes: float = 90.0
    standalone_minutes: float = 60.0
    epochs: float = 4.0


def _cli(paths: ModelPaths, *args: str) -> list[str]:
    return [sys.executable, "-m", "sglang_adatree.cli", "models", "--home", str(paths.home), *args]


def generate_training_data(
    paths: ModelPaths, budget: Budget, device: str = "cpu", dtype: str = "auto"
) -> None:
    """``budget.workers`` single-thread datagen processes, sharing one data set."""
    common = ["--threads", "1", "--device", device, "datagen", "--name", "train"]
    common += ["--tokens", str(budget.tokens), "--dtype", dtype]
    common += ["--time-budget-min", str(budget.datagen_hours * 60)]
    procs = [
        subprocess.Popen(_cli(paths, *common, "--worker", f"{w}/{budget.workers}"))
        for w in range(budget.workers)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"datagen workers exited with {codes}")


def reproduce(paths: ModelPaths, budget: Budget, device: str = "cpu", dtype: str = "auto") -> None:
    """Every stage in order; ``device`` (``cuda`` where a GPU is) runs datagen and training,
    the held-out sets (fp32), the evaluation and the cards' timings stay on the CPU.
    ``dtype`` is the training data's and the trainings' precision (``auto``: bf16 on a GPU or
    a CPU with bf16 instructions, float32 on other CPUs)."""
    from sglang_adatree.models.datagen import eval_config, run_datagen
    from sglang_adatree.models.prepare import prepare_all
    from sglang_adatree.models.train import TrainConfig, export_best, train

    if device != "cpu":
        check_device(device)
    dtype = resolve_dtype(dtype, device)
    print(f"precision: {dtype}")
    for line in prepare_all(paths):
        print(line)
    generate_training_data(paths, budget, device, dtype)
    for eval_set in EVAL_SETS:
        cfg = eval_config(eval_set)
        run_datagen(paths.target_dir, paths.datagen_dir(cfg.name), cfg)
    minutes = {"eagle": budget.eagle_minutes, "standalone": budget.standalone_minutes}
    for draft, limit in minutes.items():
        cfg = TrainConfig(draft=draft, epochs=budget.epochs, dtype=dtype)
        summary = train(cfg, paths, limit * 60, device=device)
        print(f"exported {export_best(paths, draft, summary)}")
    for line in prepare_all(paths):
        print(line)
    for draft in ("eagle", "standalone"):
        subprocess.run(_cli(paths, "evaluate", draft, "--card"), check=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Budget()
    parser.add_argument("--home", help="data directory (default: ADATREE_HOME or config)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of this process")
    parser.add_argument("--tokens", type=int, default=defaults.tokens)
    parser.add_argument("--datagen-hours", type=float, default=defaults.datagen_hours)
    parser.add_argument("--workers", type=int, choices=(1, 2), default=defaults.workers)
    parser.add_argument("--eagle-minutes", type=float, default=defaults.eagle_minutes)
    parser.add_argument("--standalone-minutes", type=float, default=defaults.standalone_minutes)
    parser.add_argument("--epochs", type=float, default=defaults.epochs)
    parser.add_argument(
        "--device", default="cpu", help="torch device of datagen and training (cpu, or cuda)"
    )
    add_dtype_argument(parser, "precision of the training data and the trainings")
