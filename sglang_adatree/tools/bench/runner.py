"""The benchmark loop: one server per configuration, every (workload, load) point against it.

For each round, configurations run one at a time (never two servers at once: they would
compete for memory and cores); the order rotates by one each round so that slow drifts of a
shared machine do not always hit the same configuration. Each server gets warm-up requests
first (prompts from no prompt set), then the points in order: workloads, then loads
ascending. An adaptive policy keeps what it learnt from one point to the next, as a long-running
server would.

A configuration whose server fails to start is reported and skipped; the others still run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from sglang_adatree.config import load_config
from sglang_adatree.core.refit import REFIT_EVERY_ROWS
from sglang_adatree.tools.bench.client import Load, PointResult, RequestResult, run_point
from sglang_adatree.tools.bench.configurations import Configuration, Models, ServerSettings
from sglang_adatree.tools.bench.databases import database_url
from sglang_adatree.tools.bench.results import BenchRow, make_row, with_speedups
from sglang_adatree.tools.bench.servers import Server, ServerError, free_port, running_server
from sglang_adatree.tools.bench.steps import StepPoint, summarize_steps, wait_for_steps
from sglang_adatree.tools.bench.workloads import WARMUP_PROMPTS, Workload

# An adatree-served server is warm once it has cycled through the candidates (at most
# ``warmup_steps`` decode steps) and refitted its step-time model on its own measurements (first
# once every candidate was measured, then at doubling intervals up to every REFIT_EVERY_ROWS:
# waiting one full interval covers the early refits and the corrections after them), with a
# margin; or after MAX_WARMUP_BATCHES warm-up batches.
WARMUP_MARGIN_STEPS = 32
MAX_WARMUP_BATCHES = 12


@dataclass(frozen=True)
class BenchPlan:
    """Everything one ``adatree bench`` invocation runs."""

    models: Models
    settings: ServerSettings
    configurations: tuple[Configuration, ...]
    workloads: tuple[Workload, ...]
    loads: tuple[Load, ...]
    max_new_tokens: int
    work_dir: Path
    db_url: str
    repeats: int = 1
    warmup_requests: int = 2
    seed: int = 0
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 1800.0
    chat_template: bool = True

    @property
    def points(self) -> list[tuple[Workload, Load]]:
        return [(w, load) for w in self.workloads for load in sorted(self.loads, key=_key)]


def _key(load: Load) -> tuple[int, float]:
    return load.sort_key


@dataclass
class BenchOutcome:
    """Rows, the per-step timelines of adatree-served policies, and what went wrong."""

    rows: list[BenchRow]
    timelines: dict[str, list[tuple[float, str, str, str]]]  # policy -> (t, shape, wl, load)
    failures: dict[str, str] = field(default_factory=dict)  # configuration -> error
    startup_s: dict[str, float] = field(default_factory=dict)
    static_shapes: dict[str, str] = field(default_factory=dict)


class ChatFormatter:
    """User message -> the prompt text the target expects (its chat template)."""

    def __init__(self, target: Path, enabled: bool = True) -> None:
        self._tokenizer = None
        if enabled:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(target))
            if tokenizer.chat_template:
                self._tokenizer = tokenizer

    def __call__(self, message: str) -> str:
        if self._tokenizer is None:
            return message
        return self._tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )


def run_bench(plan: BenchPlan, progress: bool = True) -> BenchOutcome:
    """Run every configuration of ``plan`` ``plan.repeats`` times; rows with speedups."""
    fmt = ChatFormatter(plan.models.target, plan.chat_template)
    texts = {w.name: [fmt(p) for p in w.prompts] for w in plan.workloads}
    warmup = [fmt(p) for p in WARMUP_PROMPTS]
    results: dict[tuple[str, str, str], list[PointResult]] = {}
    steps: dict[tuple[str, str, str], list[StepPoint]] = {}
    loads_seen: dict[tuple[str, str, str], list[float]] = {}
    outcome = BenchOutcome(rows=[], timelines={})
    configs = list(plan.configurations)
    for round_index in range(plan.repeats):
        shift = round_index % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if config.name in outcome.failures:
                continue
            log = plan.work_dir / "logs" / f"{config.slug}-{round_index}.log"
            port = free_port()
            db_url = database_url(config, plan.work_dir, plan.db_url)
            command = config.command(plan.models, plan.settings, port, db_url)
            _say(progress, f"[round {round_index + 1}] starting {config.name}: {' '.join(command)}")
            try:
                with running_server(
                    command, config.env(plan.settings), port, log, plan.startup_timeout_s
                ) as server:
                    outcome.startup_s[config.name] = server.startup_s
                    _say(progress, f"{config.name} healthy after {server.startup_s:.0f} s")
                    state = _prepare(server, config, plan, warmup, outcome)
                    run_id = state.get("adatree_run_id")
                    for workload, load in plan.points:
                        key = (config.name, workload.name, str(load))
                        point, load_avg = _run_one(
                            server, config, workload, load, texts, plan, progress
                        )
                        results.setdefault(key, []).append(point)
                        loads_seen.setdefault(key, []).append(load_avg)
                        if run_id is not None:
                            rows = wait_for_steps(
                                db_url, int(run_id), point.started_at, point.finished_at
                            )
                            steps.setdefault(key, []).extend(rows)
                            outcome.timelines.setdefault(config.name, []).extend(
                                (s.wall_time, s.shape, workload.name, str(load)) for s in rows
                            )
            except ServerError as exc:
                outcome.failures[config.name] = str(exc)
                _say(progress, f"{config.name} FAILED: {exc}")
    for config in configs:
        for workload, load in plan.points:
            key = (config.name, workload.name, str(load))
            if key not in results:
                continue
            outcome.rows.append(
                make_row(
                    config.name,
                    config.label(plan.models),
                    workload.name,
                    str(load),
                    results[key],
                    summarize_steps(steps.get(key, [])),
                    static_shape=outcome.static_shapes.get(config.name),
                    machine_load_1m=sum(loads_seen[key]) / len(loads_seen[key]),
                )
            )
    outcome.rows = with_speedups(outcome.rows)
    return outcome


def _prepare(
    server: Server,
    config: Configuration,
    plan: BenchPlan,
    warmup: Sequence[str],
    outcome: BenchOutcome,
) -> dict:
    """``warm_up``, then the server's state; records a static server's resolved shape."""
    info = warm_up(
        server, config, warmup, plan.warmup_requests, plan.max_new_tokens, plan.request_timeout_s
    )
    if config.is_static:
        shape = (
            info.get("speculative_num_steps"),
            info.get("speculative_eagle_topk"),
            info.get("speculative_num_draft_tokens"),
        )
        outcome.static_shapes[config.name] = ",".join(str(x) for x in shape)
    states = info.get("internal_states") or [{}]
    return states[0]


def warm_up(
    server: Server,
    config: Configuration,
    warmup: Sequence[str],
    requests: int,
    max_new_tokens: int,
    timeout_s: float,
) -> dict:
    """Warm-up requests; returns the server's info (``GET /server_info``) afterwards.

    Every server gets ``requests``; one whose decision rule chooses among shapes (adatree and
    the re-implemented baselines, unless pinned) gets more, two at a time, until it is past its
    warm-up cycle and its first step-time refit, so that what follows measures the decision
    rule of a server that has been running, not its start-up. The cold start stays visible in
    the telemetry.
    """
    sent = 0
    warm_steps = max(load_config().warmup_steps, REFIT_EVERY_ROWS) + WARMUP_MARGIN_STEPS
    for batch in range(MAX_WARMUP_BATCHES):
        count = requests if batch == 0 else 2
        if count <= 0:
            break
        prompts = [warmup[(sent + i) % len(warmup)] for i in range(count)]
        sent += count
        point = run_point(
            server.url,
            prompts,
            [""] * len(prompts),
            Load("concurrency", min(2, len(prompts))),
            max_new_tokens,
            timeout_s=timeout_s,
        )
        failed = [r.error for r in point.requests if r.error]
        if failed:
            raise ServerError(f"{config.name}: warm-up requests failed: {failed[0]}")
        if not config.decides:
            break
        if int(server.internal_state().get("adatree_steps") or 0) >= warm_steps:
            break
    return server.info()


def _run_one(
    server: Server,
    config: Configuration,
    workload: Workload,
    load: Load,
    texts: dict[str, list[str]],
    plan: BenchPlan,
    progress: bool,
) -> tuple[PointResult, float]:
    """One point with a progress bar; returns it and the mean 1-minute load average."""
    bar = tqdm(
        total=len(workload),
        desc=f"{config.name} {workload.name} {load}",
        unit="req",
        disable=not progress,
        file=sys.stderr,
        leave=True,
    )
    before = os.getloadavg()[0]

    def done(result: RequestResult) -> None:
        bar.update(1)
        if result.error:
            bar.write(f"  request {result.index} failed: {result.error}")

    try:
        point = run_point(
            server.url,
            texts[workload.name],
            workload.phases,
            load,
            plan.max_new_tokens,
            seed=plan.seed,
            timeout_s=plan.request_timeout_s,
            on_done=done,
        )
    finally:
        bar.close()
    return point, (before + os.getloadavg()[0]) / 2.0


def _say(progress: bool, message: str) -> None:
    if progress:
        tqdm.write(time.strftime("%H:%M:%S ") + message, file=sys.stderr)
