"""Reproduce both bundled drafts from nothing: prepare -> datagen -> train -> evaluate.

    .venv/bin/python scripts/train_draft.py --tokens 400000 --datagen-hours 6

Resumable: run it again (with a larger budget) and it continues where it stopped.
"""

import argparse

import torch

from sglang_adatree.config import load_config
from sglang_adatree.models.paths import ModelPaths
from sglang_adatree.models.reproduce import Budget, add_arguments, reproduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budget = Budget(
        tokens=args.tokens,
        datagen_hours=args.datagen_hours,
        workers=args.workers,
        eagle_minutes=args.eagle_minutes,
        standalone_minutes=args.standalone_minutes,
        epochs=args.epochs,
    )
    reproduce(ModelPaths(load_config(home=args.home).home_dir), budget, args.device, args.dtype)


if __name__ == "__main__":
    main()
