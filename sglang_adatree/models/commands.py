"""``adatree models prepare | datagen | train | evaluate | path``."""

from __future__ import annotations

import argparse
import json

import torch

from sglang_adatree.config import load_config
from sglang_adatree.models.hardware import resolve_dtype
from sglang_adatree.models.paths import ModelPaths
from sglang_adatree.models.prompts import EVAL_SETS

DRAFTS = ("eagle", "standalone")
# Precisions of the target (datagen) and of training: bf16 is fast with AMX or on a GPU, but
# emulated (5-7x slower than fp32) on a CPU without bf16 instructions; "auto" picks by device
# (``hardware.resolve_dtype``).
DTYPES = ("auto", "bfloat16", "float32")


def add_dtype_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--dtype`` of datagen, train and scripts/train_draft.py: ``what`` it sets."""
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help=f"{what} (default auto: bfloat16 on a GPU or a CPU with bf16 instructions, "
        "float32 otherwise)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", help="data directory (default: ADATREE_HOME or config)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of datagen and train: cpu (default), or cuda where a GPU is",
    )
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    p = sub.add_parser("prepare", help="build the target HF folder and assemble the drafts")
    p.add_argument("--force", action="store_true", help="rebuild even if the marker matches")

    p = sub.add_parser("datagen", help="generate training (or held-out evaluation) data")
    p.add_argument("--name", default="train", help="data set name under <home>/datagen/")
    p.add_argument("--eval-set", choices=EVAL_SETS, help="a held-out set (eval-<set>)")
    p.add_argument("--eval-limit", type=int, help="first N prompts (default: all MT-bench, 40)")
    p.add_argument("--tokens", type=int, help="stop after this many answer tokens in total")
    p.add_argument("--time-budget-min", type=float, help="stop starting shards after this")
    p.add_argument("--max-shards", type=int, help="stop after this many shard indices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--prompts-per-shard", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--num-passage", type=int, default=8, help="passage prompts per shard (0: none)")
    p.add_argument(
        "--num-detailed-meta",
        type=int,
        default=8,
        help="detailed meta prompts per shard: the target writes advanced requests (0: none)",
    )
    p.add_argument(
        "--num-real", type=int, default=4, help="GPQA / AIME questions per shard (0: none)"
    )
    add_dtype_argument(p, "the target's precision for training sets")
    p.add_argument("--worker", default="0/1", help="'w/n': this process's share of shards")

    p = sub.add_parser("train", help="train a draft on generated data")
    p.add_argument("draft", choices=DRAFTS)
    p.add_argument(
        "--data", nargs="+", default=["train"], help="data set names under <home>/datagen/"
    )
    p.add_argument("--init-from", help="start from this exported weights folder (a finished run)")
    p.add_argument("--time-budget-min", type=float, default=60.0)
    p.add_argument("--tokens", type=int, help="use at most this many training tokens")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--tokens-per-batch", type=int, default=4096)
    p.add_argument("--unroll", type=int, default=3, help="eagle: draft steps trained at once")
    p.add_argument("--val-every", type=int, default=200, help="batches between validations")
    add_dtype_argument(p, "compute precision: bf16 autocast or float32")
    p.add_argument("--export", action="store_true", help="write the shipped weights folder")

    p = sub.add_parser("evaluate", help="top-k agreement of a draft with the target")
    p.add_argument("draft", choices=DRAFTS)
    p.add_argument("--data", nargs="+", default=[f"eval-{s}" for s in EVAL_SETS])
    p.add_argument("--weights", help="a draft folder (default: the shipped weights)")
    p.add_argument("--steps", type=int, default=5, help="chain depth for step-k agreement")
    p.add_argument("--json", dest="json_out", help="also write the figures to this file")
    p.add_argument("--card", action="store_true", help="time passes, write MODEL_CARD.md")
    p.add_argument(
        "--served",
        help="with --card: add served step times from this `adatree profile --out` file",
    )

    sub.add_parser("path", help="print where the prepared target and the drafts are")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.device != "cpu" and args.models_command in ("datagen", "train"):
        check_device(args.device)
    if getattr(args, "dtype", None) == "auto":
        args.dtype = resolve_dtype(args.dtype, args.device)
        print(f"precision: {args.dtype} (--dtype auto on {args.device})")
    paths = ModelPaths(load_config(home=args.home).home_dir)
    if args.models_command == "prepare":
        from sglang_adatree.models.prepare import prepare_all

        for line in prepare_all(paths, force=args.force):
            print(line)
        return 0
    if args.models_command == "datagen":
        return _datagen(args, paths)
    if args.models_command == "train":
        from sglang_adatree.models.train import train_command

        return train_command(args, paths)
    if args.models_command == "evaluate":
        from sglang_adatree.models.evaluate import evaluate_command

        return evaluate_command(args, paths)
    if args.models_command == "path":
        print(f"target:      {paths.target_dir}")
        print(f"eagle head:  {paths.eagle_dir}  (token map {paths.eagle_token_map})")
        print(f"standalone:  {paths.standalone_dir}")
        print(f"data:        {paths.home / 'datagen'}")
        return 0
    raise AssertionError(args.models_command)


def check_device(device: str) -> None:
    """Refuse a device torch cannot use before any model is loaded."""
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise SystemExit(f"--device {device}: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: torch sees no CUDA device on this machine")


def _datagen(args: argparse.Namespace, paths: ModelPaths) -> int:
    from sglang_adatree.models.datagen import DatagenConfig, eval_config, run_datagen

    for flag in ("num_passage", "num_detailed_meta", "num_real"):
        if getattr(args, flag) < 0:
            raise SystemExit(
                f"--{flag.replace('_', '-')} must be 0 or more, not {getattr(args, flag)}"
            )
    if args.eval_set:
        cfg = eval_config(args.eval_set, args.eval_limit)
    else:
        cfg = DatagenConfig(
            name=args.name,
            seed=args.seed,
            prompts_per_shard=args.prompts_per_shard,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            num_passage=args.num_passage,
            num_detailed_meta=args.num_detailed_meta,
            num_real=args.num_real,
            dtype=args.dtype,
        )
    budget = args.time_budget_min * 60 if args.time_budget_min else None
    manifest = run_datagen(
        paths.target_dir,
        paths.datagen_dir(cfg.name),
        cfg,
        max_response_tokens=args.tokens,
        time_budget_s=budget,
        max_shards=args.max_shards,
        worker=int(args.worker.split("/")[0]),
        num_workers=int(args.worker.split("/")[1]),
        device=args.device,
    )
    shards = manifest["shards"]
    summary = {
        "name": cfg.name,
        "shards": len(shards),
        "sequences": sum(s["num_seqs"] for s in shards),
        "tokens": sum(s["num_tokens"] for s in shards),
        "answer_tokens": sum(s["num_response_tokens"] for s in shards),
        "seconds": round(sum(s["seconds"] for s in shards), 1),
    }
    print(json.dumps(summary))
    return 0
