"""``adatree profile``: what a decode step costs on this deployment, and where it goes.

Two measurements, each on real SGLang servers started one at a time:

* ``--baseline``: SGLang without speculation against plain transformers greedy generation of
  the same model, interleaved request by request (a server request, then the same prompt
  through transformers in this process while the server idles), concurrency 1, EOS ignored so
  every request produces exactly ``--new-tokens``; reported as medians and their ratio.
* shapes: an adatree server that cycles through ``--shapes``, ``--run-steps`` decode steps of
  each in turn (a warm-up that never ends), with forward profiling on
  (``ADATREE_PROFILE_PATH``). Each step logs its wall time, the time spent inside model
  forwards (the draft passes, the verify pass, the draft extend) and the tokens it emitted;
  the report gives per shape the median step time, forward time and their ratio (the overhead
  of the speculative machinery around the models) and the mean emitted tokens. Steps without
  speculation run as the server serves them (``skip_idle_draft_extend``): on a CPU the
  target's plain decode, the draft's extend skipped, so a catch-up step follows each run of
  them (left out of the report and the profile). So is the first step of each run
  (``lab.measured.follows_a_change``): on a CPU a plain decode right after a speculative step
  costs most of a step more than the next plain one, which a server pays once per change, not
  once per step as a cycle of single steps would charge it.

With ``--concurrency 1,2,4`` the shapes' server is driven at each of those concurrencies in turn
(``--requests`` requests each, that many in flight), so steps run at batch sizes up to the
largest; the report above still reads the batch-size-1 steps. ``--profile-out FILE.json``
writes every logged step as the policy lab's step-time profile
(``lab.measured.profile_from_served_steps``: a ``TableProfile`` over batch size and context per
shape, ``source`` "measured", ``made_by`` this command and the date).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import requests

from sglang_adatree.core.policy import teaches_cost_model
from sglang_adatree.core.shapes import parse_candidates
from sglang_adatree.models.paths import TOKEN_MAP_FILE
from sglang_adatree.tools.bench.configurations import CPU_SERVER_FLAGS

DEFAULT_SHAPES = "0;3,1,4;3,2,6"
# Steps of a shape in a row: the first of each run pays for the change and is left out.
DEFAULT_RUN_STEPS = 8
STEP_LOG = "steps.jsonl"  # the shapes' server's step log, in the work dir
CANDIDATES = "candidates"  # --shapes: the configured candidate shapes


@dataclass(frozen=True)
class BaselineResult:
    """Tokens per second at concurrency 1, medians over requests."""

    requests: int
    new_tokens: int
    sglang_tok_s: float
    transformers_tok_s: float

    @property
    def ratio(self) -> float:
        return self.sglang_tok_s / self.transformers_tok_s


@dataclass(frozen=True)
class ShapeProfile:
    """One shape's decode steps at batch size 1."""

    shape: str
    steps: int
    step_ms: float  # median wall time of the worker's step
    forward_ms: float  # median time inside model forwards during the step
    overhead: float  # median of step / forward
    emitted: float | None = None  # mean emitted tokens a step (speculative shapes)
    # Median of step time less the draft's forwards: for steps without speculation that ran
    # the draft's extend (a server with skip_idle_draft_extend off), what they cost without it.
    step_less_draft_ms: float | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model folder (default: the bundled target)")
    parser.add_argument(
        "--draft", help="draft folder, or 'eagle' / 'standalone' for a bundled one (default eagle)"
    )
    parser.add_argument("--prompts", default="mtbench", help="prompt set or JSONL file")
    parser.add_argument("--requests", type=int, default=6, help="requests per measurement")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help="shapes to profile, 'S,K,N;...', or 'candidates': the configured candidate shapes "
        "(a profile a server's step_time_profile can price them all by)",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also compare non-speculative SGLang with transformers",
    )
    parser.add_argument(
        "--run-steps",
        type=_run_steps,
        default=DEFAULT_RUN_STEPS,
        help="decode steps of each shape in a row; the first of each run, which pays for the "
        f"change of shape, is left out (default {DEFAULT_RUN_STEPS})",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument(
        "--concurrency",
        type=parse_concurrency,
        help="drive the shapes' server at these concurrencies in turn, e.g. '1,2,4' "
        "(--requests each; default: one request at a time)",
    )
    parser.add_argument(
        "--profile-out",
        type=Path,
        help="write every logged step as a step-time profile of the policy lab (JSON)",
    )
    parser.add_argument("--work-dir", type=Path, help="server logs (default: a temp dir)")


def _run_steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 2 <= value <= 1000:
        raise argparse.ArgumentTypeError(
            f"--run-steps {text!r}: an integer from 2 to 1000 (the first step of a run is left out)"
        )
    return value


def parse_concurrency(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; each at least 1."""
    try:
        levels = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: integers like 1,2,4") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--concurrency {text!r}: integers >= 1, like 1,2,4")
    return levels


def _chat(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def _generate(url: str, text: str, new_tokens: int) -> tuple[int, float]:
    started = time.perf_counter()
    response = requests.post(
        f"{url}/generate",
        json={
            "text": text,
            "sampling_params": {
                "max_new_tokens": new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        },
        timeout=900,
    )
    response.raise_for_status()
    elapsed = time.perf_counter() - started
    return int(response.json()["meta_info"]["completion_tokens"]), elapsed


def measure_baseline(
    target: Path, prompts: list[str], new_tokens: int, threads: int, work_dir: Path
) -> BaselineResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_adatree.tools.bench.servers import free_port, running_server

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    port = free_port()
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(target),
        "--port", str(port), "--attention-backend", "adatree_cpu",
        "--sampling-backend", "pytorch", "--max-total-tokens", "32768",
        "--device", "cpu", *CPU_SERVER_FLAGS,
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    sglang_rates, hf_rates = [], []
    with running_server(command, env, port, work_dir / "baseline-server.log") as server:
        _generate(server.url, _chat(tokenizer, prompts[0]), 8)  # warm-up
        for i, prompt in enumerate(prompts):
            text = _chat(tokenizer, prompt)
            tokens, seconds = _generate(server.url, text, new_tokens)
            sglang_rates.append(tokens / seconds)
            ids = tokenizer(text, return_tensors="pt").input_ids
            started = time.perf_counter()
            with torch.no_grad():
                out = model.generate(
                    ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
                )
            hf_rates.append((out.shape[1] - ids.shape[1]) / (time.perf_counter() - started))
            print(
                f"  request {i + 1}/{len(prompts)}: sglang {sglang_rates[-1]:.1f} tok/s, "
                f"transformers {hf_rates[-1]:.1f} tok/s",
                flush=True,
            )
    return BaselineResult(
        len(prompts), new_tokens, statistics.median(sglang_rates), statistics.median(hf_rates)
    )


def _mean_emitted(rows: list[dict]) -> float | None:
    values = [r["emitted"] for r in rows if r.get("emitted") is not None]
    return statistics.fmean(values) if values else None


def summarize_profile(path: Path) -> list[ShapeProfile]:
    """Per-shape medians over the batch-size-1 steps of a profile file.

    Catch-up steps are left out: they run no speculation but the draft's extend, so they are
    neither a plain step nor the speculative shape that follows them (files of servers that
    skip the draft's extend on steps without speculation have one after each of those). So are
    steps right after a step of another shape (``lab.measured.follows_a_change``).
    """
    from sglang_adatree.lab.measured import follows_a_change

    by_shape: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if (
            row["batch_size"] == 1
            and row["forward_ms"] > 0
            and teaches_cost_model(row.get("source") or "model", row.get("step_ms"))
            and not follows_a_change(row)
        ):
            by_shape[row["shape"]].append(row)
    out = []
    for shape, rows in sorted(by_shape.items()):
        out.append(
            ShapeProfile(
                shape=shape,
                steps=len(rows),
                step_ms=statistics.median(r["step_ms"] for r in rows),
                forward_ms=statistics.median(r["forward_ms"] for r in rows),
                overhead=statistics.median(r["step_ms"] / r["forward_ms"] for r in rows),
                emitted=_mean_emitted(rows),
                step_less_draft_ms=statistics.median(
                    r["step_ms"] - r.get("draft_forward_ms", 0.0) for r in rows
                ),
            )
        )
    return out


def measure_shapes(
    target: Path,
    draft: Path,
    shapes: str,
    prompts: list[str],
    new_tokens: int,
    threads: int,
    work_dir: Path,
    concurrency: Sequence[int] = (1,),
    run_steps: int = DEFAULT_RUN_STEPS,
) -> list[ShapeProfile]:
    """Per-shape medians at batch size 1 (``summarize_profile``); every step stays logged in
    ``work_dir / STEP_LOG``. At each of ``concurrency`` the prompts run with that many in
    flight; the server runs ``run_steps`` steps of each shape in turn."""
    from transformers import AutoTokenizer

    from sglang_adatree.tools.bench.servers import free_port, running_server

    tokenizer = AutoTokenizer.from_pretrained(target)
    profile_path = work_dir / STEP_LOG
    profile_path.unlink(missing_ok=True)
    port = free_port()
    command = [
        sys.executable, "-m", "sglang_adatree.cli", "serve", "--model-path", str(target),
        "--speculative-draft-model-path", str(draft), "--port", str(port),
        "--candidate-shapes", shapes, "--device", "cpu", *CPU_SERVER_FLAGS,
    ]  # fmt: skip
    token_map = draft / TOKEN_MAP_FILE
    if token_map.is_file():  # an EAGLE head with a reduced (hot) vocabulary
        command += ["--speculative-token-map", str(token_map)]
    env = {
        "ADATREE_PROFILE_PATH": str(profile_path),
        # The largest warm-up allowed: longer than any profile, so the cycle never ends.
        "ADATREE_WARMUP_STEPS": "100000",
        "ADATREE_WARMUP_RUN_STEPS": str(run_steps),
        "ADATREE_RECORD_STEPS": "false",
        "OMP_NUM_THREADS": str(threads),
    }
    with running_server(command, env, port, work_dir / "adatree-server.log") as server:
        _generate(server.url, _chat(tokenizer, prompts[0]), 8)
        profile_path.write_text("")  # drop the warm-up request's steps
        texts = [_chat(tokenizer, p) for p in prompts]
        for level in concurrency:
            if tuple(concurrency) != (1,):
                print(f"  concurrency {level}:", flush=True)
            with ThreadPoolExecutor(max_workers=level) as pool:
                running = [pool.submit(_generate, server.url, t, new_tokens) for t in texts]
                for i, done in enumerate(as_completed(running)):
                    done.result()
                    print(f"  request {i + 1}/{len(prompts)} done", flush=True)
    return summarize_profile(profile_path)


def run(args: argparse.Namespace) -> int:
    from sglang_adatree.config import load_config
    from sglang_adatree.models.hardware import cpu_name
    from sglang_adatree.models.paths import ModelPaths
    from sglang_adatree.tools.bench.workloads import load_workload

    config = load_config()
    paths = ModelPaths(config.home_dir)
    if args.shapes == CANDIDATES:
        args.shapes = ";".join(str(s) for s in config.candidate_shapes)
    target = Path(args.target) if args.target else paths.target_dir
    bundled = {"eagle": paths.eagle_dir, "standalone": paths.standalone_dir}
    draft = bundled.get(args.draft or "eagle") or Path(args.draft)
    for name, path in (("target", target), ("draft", draft)):
        if not (path / "config.json").is_file():
            print(f"adatree profile: no {name} model at {path} (run `adatree models prepare`)")
            return 2
    parse_candidates(args.shapes)
    prompts = list(load_workload(args.prompts, args.requests).prompts)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="adatree-profile-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "target": str(target),
        "draft": str(draft),
        "prompts": args.prompts,
        # What a model card quoting these figures names (``adatree models evaluate --served``).
        "settings": {
            "draft": args.draft or "eagle",
            "prompts": args.prompts,
            "shapes": args.shapes,
            "requests": args.requests,
            "new_tokens": args.new_tokens,
            "threads": args.threads,
            "run_steps": args.run_steps,
            "cpu": cpu_name(),
        },
    }
    if args.concurrency:
        result["settings"]["concurrency"] = list(args.concurrency)
    if args.baseline:
        print("non-speculative SGLang against transformers (interleaved):", flush=True)
        base = measure_baseline(target, prompts, args.new_tokens, args.threads, work_dir)
        result["baseline"] = {**asdict(base), "ratio": base.ratio}
        print(
            f"sglang {base.sglang_tok_s:.1f} tok/s, transformers {base.transformers_tok_s:.1f} "
            f"tok/s: ratio {base.ratio:.2f}"
        )
    print(f"shape profile ({args.shapes}), batch size 1:", flush=True)
    concurrency = args.concurrency or (1,)
    profiles = measure_shapes(
        target,
        draft,
        args.shapes,
        prompts,
        args.new_tokens,
        args.threads,
        work_dir,
        concurrency,
        args.run_steps,
    )
    result["shapes"] = [asdict(p) for p in profiles]
    print(
        f"{'shape':>8} {'steps':>6} {'step ms':>9} {'forward ms':>11} {'overhead':>9} "
        f"{'emitted':>8}"
    )
    for p in profiles:
        emitted = "-" if p.emitted is None else f"{p.emitted:.2f}"
        print(
            f"{p.shape:>8} {p.steps:>6} {p.step_ms:>9.1f} {p.forward_ms:>11.1f} "
            f"{p.overhead:>9.3f} {emitted:>8}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if args.profile_out:
        write_step_profile(work_dir / STEP_LOG, args.profile_out, args, cpu_name())
    print(f"server logs: {work_dir}")
    return 0


def write_step_profile(step_log: Path, out: Path, args: argparse.Namespace, cpu: str) -> None:
    """The logged steps as a ``TableProfile`` named after ``out`` (e.g. ``cpu-2core-eagle``)."""
    from sglang_adatree.lab.measured import profile_from_served_steps

    command = "adatree " + shlex.join(sys.argv[1:])
    profile = profile_from_served_steps(
        step_log,
        made_by=f"{command} ({date.today().isoformat()})",
        name=out.stem,
        shapes=parse_candidates(args.shapes),
        notes={
            "cpu": cpu,
            "threads": args.threads,
            "draft": args.draft or "eagle",
            "run_steps": args.run_steps,
        },
    )
    profile.save(out)
    notes = profile.notes
    print(
        f"step-time profile: {out} ({notes['rows']} steps; cells measured "
        f"{notes['cells_measured']}, filled {notes['cells_filled']}; batch sizes "
        f"{list(profile.batch_sizes)}, contexts {list(profile.context_lens)})"
    )
