"""``adatree demo``: the bundled model pair served by SGLang with adatree on this machine.

1. prepare the models (the SmolLM2 target from its package, the drafts from the shipped
   weights; instant after the first run);
2. migrate the telemetry database (SQLite under ``ADATREE_HOME``);
3. start SGLang with adatree on the CPU and the dashboard on 127.0.0.1 with a fresh operator
   token, and print both URLs and the token;
4. send a short real workload from the packaged MT-bench prompts, with a progress bar;
5. print a summary: requests, tokens, goodput, acceptance length and the shapes adatree chose;
6. keep both servers up for the operator until Ctrl-C (or stop at once with ``--no-wait``),
   then stop every process it started.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import requests
from tqdm import tqdm


@dataclass(frozen=True)
class DemoSummary:
    """What the workload did, from the client's view and the telemetry store's."""

    requests: int
    output_tokens: int
    seconds: float
    verify_steps: int
    emitted_tokens: int
    shapes: dict[str, int]  # steps per shape
    sources: dict[str, int]  # steps per decision source

    @property
    def goodput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def accept_length(self) -> float:
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft", choices=("eagle", "standalone"), default="eagle",
                        help="which bundled draft to serve (default %(default)s)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=12, help="requests in the workload")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens per answer")
    parser.add_argument("--port", type=int, default=30000, help="SGLang port (default 30000)")
    parser.add_argument("--admin-port", type=int, default=8050, help="dashboard port")
    parser.add_argument("--no-wait", action="store_true", help="stop after the summary")
    parser.add_argument("--no-dashboard", action="store_true", help="do not start the dashboard")


def _workload(count: int) -> list[str]:
    from sglang_adatree.tools.bench.workloads import load_workload

    return list(load_workload("mtbench", count, seed=0).prompts)


def _ask(url: str, prompt: str, max_new_tokens: int) -> int:
    response = requests.post(
        f"{url}/v1/chat/completions",
        json={
            "model": "default",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_new_tokens,
            "temperature": 0,
        },
        timeout=1800,
    )
    response.raise_for_status()
    return int(response.json()["usage"]["completion_tokens"])


def _summary(
    db_url: str, run_id: int, requests_done: int, tokens: int, seconds: float
) -> DemoSummary:
    from sqlalchemy import select

    from sglang_adatree.telemetry.models import Step
    from sglang_adatree.telemetry.store import get_engine

    with get_engine(db_url).connect() as conn:
        rows = conn.execute(
            select(Step.steps, Step.topk, Step.num_draft_tokens, Step.decision_source,
                   Step.batch_size, Step.emitted_tokens).where(Step.run_id == run_id)
        ).all()  # fmt: skip
    shapes = Counter(f"{s},{k},{n}" for s, k, n, *_ in rows)
    sources = Counter(src for _, _, _, src, _, _ in rows)
    verify = sum(bs for *_, bs, _ in rows)
    emitted = sum(e for *_, e in rows)
    return DemoSummary(requests_done, tokens, seconds, verify, emitted, dict(shapes), dict(sources))


def _print_summary(summary: DemoSummary) -> None:
    print()
    print("adatree demo summary")
    print(f"  requests            {summary.requests}")
    print(f"  output tokens       {summary.output_tokens}")
    print(f"  wall time           {summary.seconds:.1f} s")
    print(f"  goodput             {summary.goodput:.1f} tokens/s")
    print(f"  acceptance length   {summary.accept_length:.2f} emitted tokens per verify step")
    print("  shapes used (steps, topk, num_draft_tokens: decode steps)")
    for shape, count in sorted(summary.shapes.items(), key=lambda kv: -kv[1]):
        print(f"    {shape:>10}  {count}")
    print("  decision sources    " + ", ".join(f"{k} {v}" for k, v in summary.sources.items()))


def run(args: argparse.Namespace) -> int:
    from sglang_adatree.config import load_config
    from sglang_adatree.models.paths import ModelPaths
    from sglang_adatree.models.prepare import prepare_all
    from sglang_adatree.telemetry.store import upgrade
    from sglang_adatree.tools.bench.servers import ServerError, running_server

    config = load_config()
    paths = ModelPaths(config.home_dir)
    print("[1/5] preparing the bundled models", flush=True)
    for line in prepare_all(paths):
        print("      " + line)
    draft = paths.eagle_dir if args.draft == "eagle" else paths.standalone_dir
    if not (draft / "config.json").is_file():
        print(f"adatree demo: the {args.draft} draft is missing at {draft}", file=sys.stderr)
        return 2
    db_url = config.resolved_db_url
    print(f"[2/5] telemetry database {db_url}", flush=True)
    config.home_dir.mkdir(parents=True, exist_ok=True)
    upgrade(db_url)

    work = Path(tempfile.mkdtemp(prefix="adatree-demo-"))
    token = os.environ.get("ADATREE_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    serve = [sys.executable, "-m", "sglang_adatree.cli", "serve", "--model-path",
             str(paths.target_dir), "--speculative-draft-model-path", str(draft),
             "--device", "cpu", "--port", str(args.port), "--db", db_url]  # fmt: skip
    if args.draft == "eagle" and paths.eagle_token_map.is_file():
        serve += ["--speculative-token-map", str(paths.eagle_token_map)]
    url = f"http://127.0.0.1:{args.port}"
    try:
        with ExitStack() as stack:
            print(f"[3/5] starting SGLang with adatree on the CPU (log {work / 'server.log'})")
            started = time.monotonic()
            server = stack.enter_context(running_server(serve, {}, args.port, work / "server.log"))
            print(f"      ready in {time.monotonic() - started:.0f} s at {url}", flush=True)
            if not args.no_dashboard:
                admin = [sys.executable, "-m", "sglang_adatree.cli", "admin", "--db", db_url,
                         "--host", "127.0.0.1", "--port", str(args.admin_port)]  # fmt: skip
                # Ready once its login page answers.
                stack.enter_context(
                    running_server(
                        admin,
                        {"ADATREE_ADMIN_TOKEN": token},
                        args.admin_port,
                        work / "admin.log",
                        timeout_s=120,
                        health_path="/login",
                    )
                )
                print(f"      dashboard: http://127.0.0.1:{args.admin_port}/  token: {token}")
            run_id = server.internal_state().get("adatree_run_id")
            prompts = _workload(args.requests)
            print(
                f"[4/5] {len(prompts)} MT-bench requests, {args.concurrency} at a time", flush=True
            )
            t0 = time.monotonic()
            tokens = 0
            with (
                ThreadPoolExecutor(args.concurrency) as pool,
                tqdm(total=len(prompts), desc="requests", unit="req") as bar,
            ):
                for n in pool.map(lambda p: _ask(url, p, args.max_new_tokens), prompts):
                    tokens += n
                    bar.update(1)
            seconds = time.monotonic() - t0
            time.sleep(1.0)  # let the telemetry writer flush the last steps
            print("[5/5] summary", flush=True)
            _print_summary(_summary(db_url, run_id, len(prompts), tokens, seconds))
            if args.no_wait:
                return 0
            print(f"\nSGLang: {url}   dashboard: http://127.0.0.1:{args.admin_port}/")
            print("Press Ctrl-C to stop everything.", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    except ServerError as exc:
        print(f"adatree demo: {exc}", file=sys.stderr)
        return 1
