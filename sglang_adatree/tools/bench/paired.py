"""Paired comparison: configurations served side by side, each prompt sent to all in turn.

``adatree bench`` runs one server at a time, so a drift of a shared machine between two
servers' turns (another job starting, the CPU clocking down) lands on one configuration only.
Here every configuration's server is up at once, each idle between its own requests
(``--sleep-on-idle`` on a CPU), and the requests go one at a time: prompt 1 to A, B, C, prompt
2 to C, B, A, and so on (the order reverses every prompt, so neither end of it is favoured).
Each request produces exactly ``new_tokens`` tokens (EOS ignored), greedily.

Per configuration: the median TPOT and TTFT over prompts, the acceptance length (tokens after
the prefill's first / SGLang's verify steps: 1.0 for adatree's steps without speculation), and
the paired figure: the median over prompts of its TPOT divided by the reference configuration's
(the first given) for the same prompt, with the quartiles of those ratios and the number of
prompts it was faster on. Every answer is compared with the reference's for the same prompt:
greedy speculative decoding is lossless, so they must be identical, and the comparison says
where they are not.

A request's TPOT is the time from its first token-carrying chunk to its last but one, over the
tokens between them (``client.Streamed.steady_tpot_ms``), not to its last. A server whose
scheduler overlaps batches (plain SGLang on a CPU; its speculative servers run synchronously
there) streams each token a step late, the first included, and its last two together: the
time from the first token to the last holds one step fewer than ``new_tokens - 1``, and TPOT
taken that way reads about ``1 / (new_tokens - 1)`` low against a synchronous server's (3% at
32 tokens, 1.6% at 64). Between the first chunk and the last but one, both count the same steps.

Beside it, the same paired median of the request's whole latency per output token, which does
not depend on where the first token lands either; it includes the prefill (with a speculative
server's draft prefill: a wait too).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import requests
from tqdm import tqdm

from sglang_adatree.tools.bench.client import stream_generate, tpot_ms
from sglang_adatree.tools.bench.configurations import (
    Configuration,
    Models,
    ServerSettings,
    instance_base,
)
from sglang_adatree.tools.bench.databases import database_url, prepare_database
from sglang_adatree.tools.bench.runner import ChatFormatter, warm_up
from sglang_adatree.tools.bench.servers import (
    Server,
    ServerError,
    free_port,
    how_it_ended,
    running_server,
)
from sglang_adatree.tools.bench.stage_clock import StageClock, ms_per_token, read_stage_clock
from sglang_adatree.tools.bench.workloads import WARMUP_PROMPTS, Workload


@dataclass(frozen=True)
class PairedPlan:
    """Everything one ``adatree compare`` invocation runs."""

    models: Models
    settings: ServerSettings
    configurations: tuple[Configuration, ...]  # the first is the reference
    workload: Workload
    new_tokens: int
    work_dir: Path
    warmup_requests: int = 2
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 1800.0
    chat_template: bool = True
    # Read each server's stage clock (``stage_clock``) before the first prompt and after the
    # last; the servers must run with --enable-metrics.
    stage_clock: bool = False


@dataclass(frozen=True)
class Sample:
    """One request of one configuration for one prompt."""

    prompt: int  # index into the workload
    configuration: str
    ttft_ms: float | None
    tpot_ms: float | None  # ``client.Streamed.steady_tpot_ms`` where it has one
    output_tokens: int
    spec_verify_ct: int
    text: str
    error: str | None = None
    latency_ms: float | None = None  # request sent to last token read

    @property
    def latency_per_token_ms(self) -> float | None:
        if self.error is not None or self.latency_ms is None or self.output_tokens < 1:
            return None
        return self.latency_ms / self.output_tokens


@dataclass(frozen=True)
class ConfigSummary:
    """One configuration over all prompts; ratios are paired with the reference's."""

    name: str
    label: str
    prompts: int  # prompts with a usable TPOT here and at the reference
    errors: int
    tpot_ms: float | None  # medians over prompts
    ttft_ms: float | None
    tpot_ratio: float | None  # median of TPOT / reference TPOT, prompt by prompt
    tpot_ratio_q1: float | None
    tpot_ratio_q3: float | None
    faster: int  # prompts on which its TPOT was below the reference's
    # median of latency per output token / the reference's, prompt by prompt
    latency_ratio: float | None
    accept_len: float | None  # tokens after the first / verify steps; None: SGLang counted none
    identical: int  # answers identical to the reference's
    compared: int  # answers compared with the reference's (both without error)


def instance_lines(summaries: Sequence[ConfigSummary]) -> list[str]:
    """For each configuration served by several servers (``--instances``), the range of its
    servers' paired ratios to the reference: how far one server of it can be trusted."""
    groups: dict[str, list[ConfigSummary]] = {}
    for s in summaries:
        groups.setdefault(instance_base(s.name), []).append(s)
    reference = summaries[0].name if summaries else ""
    lines = []
    for base, group in groups.items():
        tpot = [s.tpot_ratio for s in group if s.tpot_ratio is not None]
        latency = [s.latency_ratio for s in group if s.latency_ratio is not None]
        if len(group) < 2 or not tpot:
            continue
        line = f"{base}: {len(group)} servers, TPOT / {reference} {min(tpot):.3f}x-{max(tpot):.3f}x"
        if latency:
            line += f", latency {min(latency):.3f}x-{max(latency):.3f}x"
        lines.append(line)
    return lines


def request_order(prompt: int, names: Sequence[str]) -> list[str]:
    """The configurations' order for prompt ``prompt``: as given, reversed every other one."""
    return list(names) if prompt % 2 == 0 else list(reversed(names))


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _quartiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (None, None)
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def summarize(
    configurations: Sequence[tuple[str, str]], samples: Sequence[Sample]
) -> list[ConfigSummary]:
    """Per ``(name, label)`` in order, the first being the reference; see the module docstring."""
    by = {(s.configuration, s.prompt): s for s in samples}
    prompts = sorted({s.prompt for s in samples})
    reference = configurations[0][0]
    out = []
    for name, label in configurations:
        own = [by[(name, p)] for p in prompts if (name, p) in by]
        ok = [s for s in own if s.error is None]
        ratios, latency_ratios, faster, identical, compared = [], [], 0, 0, 0
        for s in ok:
            ref = by.get((reference, s.prompt))
            if ref is None or ref.error is not None:
                continue
            compared += 1
            identical += s.text == ref.text
            if s.tpot_ms is not None and ref.tpot_ms is not None and ref.tpot_ms > 0:
                ratios.append(s.tpot_ms / ref.tpot_ms)
                faster += s.tpot_ms < ref.tpot_ms
            own_latency, ref_latency = s.latency_per_token_ms, ref.latency_per_token_ms
            if own_latency is not None and ref_latency:
                latency_ratios.append(own_latency / ref_latency)
        verify = sum(s.spec_verify_ct for s in ok)
        q1, q3 = _quartiles(sorted(ratios))
        out.append(
            ConfigSummary(
                name=name,
                label=label,
                prompts=len(ratios),
                errors=len(own) - len(ok),
                tpot_ms=_median([s.tpot_ms for s in ok if s.tpot_ms is not None]),
                ttft_ms=_median([s.ttft_ms for s in ok if s.ttft_ms is not None]),
                tpot_ratio=_median(ratios),
                tpot_ratio_q1=q1,
                tpot_ratio_q3=q3,
                faster=faster,
                latency_ratio=_median(latency_ratios),
                # The prefill makes the first token; each verify step emits the rest.
                accept_len=sum(s.output_tokens - 1 for s in ok) / verify if verify else None,
                identical=identical,
                compared=compared,
            )
        )
    return out


def table_lines(summaries: Sequence[ConfigSummary]) -> list[str]:
    """A plain-text table; the ratio columns read "time per token against the reference"."""
    reference = summaries[0].name
    width = max(22, *(len(s.name) for s in summaries))  # names with settings run long

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    header = (
        f"{'configuration':<{width}} {'TPOT ms':>8} {'TTFT ms':>8} {'TPOT / ' + reference:>16} "
        f"{'quartiles':>13} {'faster':>7} {'latency / ' + reference:>14} {'accept':>7} "
        f"{'same text':>10} {'errors':>6}"
    )
    lines = [header, "-" * len(header)]
    for s in summaries:
        quartiles = (
            "-"
            if s.tpot_ratio_q1 is None
            else f"{s.tpot_ratio_q1:.2f}-{num(s.tpot_ratio_q3, '.2f')}"
        )
        lines.append(
            f"{s.name:<{width}} {num(s.tpot_ms, '.1f'):>8} {num(s.ttft_ms, '.0f'):>8} "
            f"{num(s.tpot_ratio, '.3f') + 'x':>16} {quartiles:>13} "
            f"{f'{s.faster}/{s.prompts}':>7} {num(s.latency_ratio, '.3f') + 'x':>14} "
            f"{num(s.accept_len, '.2f'):>7} "
            f"{f'{s.identical}/{s.compared}':>10} {s.errors:>6}"
        )
    return lines


@dataclass(frozen=True)
class PairedRun:
    """What one paired run measured."""

    samples: list[Sample]
    # Per configuration, SGLang's stage clock over the prompts, ms per generated token by
    # stage (``stage_clock.ms_per_token``); empty unless the plan asked for it.
    stage_ms: dict[str, dict[str, float]]
    # Unix seconds of the first prompt sent and the last answer read (the warm-up before).
    prompts_span: tuple[float, float] = (0.0, 0.0)


def run_paired(plan: PairedPlan, progress: bool = True) -> PairedRun:
    """Start every configuration's server, warm each up, then send the prompts in turn.

    Raises ``ServerError`` when a server does not start, its warm-up fails, it is no longer
    running when the prompts start (a later server's start can take its memory) or (with
    ``plan.stage_clock``) its stage clock cannot be read before the prompts; every server is
    stopped on every way out, Ctrl-C included. A server that dies during the prompts is
    reported once, with how it ended, and its remaining prompts are recorded as failed without
    being sent; the others' run goes on. A stage clock that cannot be read after the prompts is
    left out of the result, with a message.
    """
    fmt = ChatFormatter(plan.models.target, plan.chat_template)
    texts = [fmt(p) for p in plan.workload.prompts]
    warmup = [fmt(p) for p in WARMUP_PROMPTS]
    names = [c.name for c in plan.configurations]
    samples: list[Sample] = []
    with ExitStack() as stack:
        servers: dict[str, Server] = {}
        for config in plan.configurations:
            db_url = database_url(config, plan.work_dir, shared_url=None)
            if config.kind == "adatree-serve":
                prepare_database(db_url, config)
            port = free_port()
            command = config.command(plan.models, plan.settings, port, db_url)
            log = plan.work_dir / "logs" / f"{config.slug}.log"
            _say(progress, f"starting {config.name}: {' '.join(command)}")
            server = stack.enter_context(
                running_server(
                    command, config.env(plan.settings), port, log, plan.startup_timeout_s
                )
            )
            _say(progress, f"{config.name} healthy after {server.startup_s:.0f} s; warming up")
            warm_up(
                server,
                config,
                warmup,
                plan.warmup_requests,
                plan.new_tokens,
                plan.request_timeout_s,
            )
            servers[config.name] = server
        # Each server was healthy once; a later one's start can still have cost it its life.
        for name, server in servers.items():
            server.check_alive(name)
        session = stack.enter_context(requests.Session())
        before: dict[str, StageClock] = {}
        if plan.stage_clock:
            for name, server in servers.items():
                try:
                    before[name] = read_stage_clock(session, server.url)
                except (requests.RequestException, ValueError) as exc:
                    raise ServerError(f"{name}: cannot read its stage clock: {exc}") from exc
        bar = stack.enter_context(
            tqdm(
                total=len(texts) * len(names),
                desc=f"compare {plan.workload.name}",
                unit="req",
                disable=not progress,
                file=sys.stderr,
            )
        )
        dead: dict[str, str] = {}  # name -> why its remaining prompts were not sent
        prompts_started = time.time()
        for i, text in enumerate(texts):
            for name in request_order(i, names):
                if name in dead:
                    # Its prompts are not sent: the others' comparison goes on without it.
                    sample = Sample(i, name, None, None, 0, 0, "", dead[name])
                else:
                    server = servers[name]
                    sample = _one(session, server.url, name, i, text, plan)
                    if sample.error is not None:
                        try:
                            server.check_alive(name)
                        except ServerError as exc:
                            ended = how_it_ended(server.process, server.log)
                            dead[name] = f"not sent: the server {ended}"
                            tqdm.write(f"adatree compare: {exc}", file=sys.stderr)
                samples.append(sample)
                bar.update(1)
        prompts_span = (prompts_started, time.time())
        stage_ms: dict[str, dict[str, float]] = {}
        for name, start in before.items():
            try:
                stage_ms[name] = ms_per_token(start, read_stage_clock(session, servers[name].url))
            except (requests.RequestException, ValueError) as exc:
                print(f"adatree compare: {name}: no stage clock: {exc}", file=sys.stderr)
    return PairedRun(samples, stage_ms, prompts_span)


def _one(
    session: requests.Session, url: str, name: str, index: int, text: str, plan: PairedPlan
) -> Sample:
    start = time.perf_counter()
    streamed = stream_generate(
        session, url, text, plan.new_tokens, plan.request_timeout_s, ignore_eos=True
    )
    latency_ms = (time.perf_counter() - start) * 1000.0
    tpot = None
    if streamed.error is None:
        tpot = tpot_ms(
            streamed.ttft_ms, latency_ms, streamed.output_tokens, streamed.steady_tpot_ms
        )
    return Sample(
        prompt=index,
        configuration=name,
        ttft_ms=streamed.ttft_ms,
        tpot_ms=tpot,
        output_tokens=streamed.output_tokens,
        spec_verify_ct=streamed.spec_verify_ct,
        text=streamed.text,
        error=streamed.error,
        latency_ms=latency_ms,
    )


def machine_load() -> float:
    """The 1-minute load average: the comparison is only as fair as the machine was quiet."""
    return os.getloadavg()[0]


def _say(progress: bool, message: str) -> None:
    if progress:
        tqdm.write(message, file=sys.stderr)
