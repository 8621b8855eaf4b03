"""Exact traces against real adatree servers: every decode step emits what the trace says.

One server at a time, on the CPU, with the tiny seeded target: the standalone draft, then a
tiny EAGLE head with a hot-token map. Each server starts pinned to the chain 3,1,4 (the pin is
written before it starts), serves every prompt greedily one request at a time (batch size 1),
is re-pinned to the tree 3,2,6 (topk 2) and serves them again. Its ``steps`` rows, in order,
must be the trace's walk (from position 1, each step advancing by what the trace says that
shape emits there), and its outputs the trace's answers.

The last step of a request is compared as "at least": the trace caps emitted tokens at the
answer's end (``max_new_tokens`` or EOS), the server's verify accepts past it and cuts after.

Where they part, and why (found on these servers, 2026-12-02): with a standalone draft, a
radix-cache hit reuses the draft's KV of the cached prefix, and SGLang feeds every draft one
token ahead of the target (draft position ``j`` reads token ``j + 1``, also for a standalone
model), so the KV at the last reused position was computed, by the request that cached it,
from *that* request's next token. SGLang keys its radix tree by token pairs only for EAGLE
drafts (``is_eagle()``: bigram keys), so an EAGLE head never meets this; a standalone draft
does on every prompt that shares a prefix (here the chat template's system turn) with an
earlier one. Traces are per request and cannot know the server's history; the standalone case
below reproduces the served steps exactly once the trace is built from what that cached KV
read (``_cached_reads``). Served without the radix cache, traces match from the first request.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from sglang_servers import adatree_command, free_port, sglang_server
from sqlalchemy import select
from tiny_eagle import make_tiny_eagle

from sglang_adatree.core.policy import Pin
from sglang_adatree.core.shapes import NO_SPEC, TreeShape
from sglang_adatree.lab import tracegen
from sglang_adatree.lab.draft_forward import load_draft
from sglang_adatree.lab.target_pass import TargetPass
from sglang_adatree.lab.tracegen import TraceJob, cached_tokens, pinned_steps, run_job
from sglang_adatree.models.paths import TOKEN_MAP_FILE
from sglang_adatree.telemetry import control
from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.store import get_engine, upgrade
from sglang_adatree.tools.bench.runner import ChatFormatter

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a quiet village by the sea,",
    "def fibonacci(n):",
    "Three primes:",
]
MAX_NEW_TOKENS = 32
CHAIN, TREE = TreeShape(3, 1, 4), TreeShape(3, 2, 6)
SHAPES = (NO_SPEC, CHAIN, TREE)


def _serve(target: Path, draft: Path, work: Path, extra: tuple[str, ...] = ()) -> list[dict]:
    """Serve every prompt under the chain, then the tree: per request, the shape, output ids,
    prompt tokens and the emitted tokens of its decode steps."""
    db_url = f"sqlite:///{work / 'adatree.sqlite'}"
    upgrade(db_url)
    engine = get_engine(db_url)
    candidates = control.CandidateSet(SHAPES, "config", None)
    with engine.begin() as conn:
        pin_id = control.create_pin(conn, candidates, Pin(CHAIN), "trace check", "pytest").id
    env = {
        "ADATREE_DB_URL": db_url,
        "ADATREE_WARMUP_STEPS": "100000",
        "ADATREE_CONTROL_POLL_S": "0.2",
        "ADATREE_TELEMETRY_FLUSH_S": "0.05",
    }
    command = adatree_command(
        target, draft, free_port(), "--candidate-shapes", ";".join(map(str, SHAPES)), *extra
    )
    texts = [ChatFormatter(target)(p) for p in PROMPTS]
    served = []
    with sglang_server(command, work / "server.log", env=env) as server:
        for shape in (CHAIN, TREE):
            if shape != CHAIN:
                with engine.begin() as conn:
                    control.clear_pin(conn, pin_id, "pytest")
                    pin_id = control.create_pin(conn, candidates, Pin(shape), "trace", "pytest").id
                time.sleep(1.0)  # polled every 0.2 s
            for text in texts:
                started = time.time()
                sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
                out = server.generate({"text": text, "sampling_params": sampling})
                time.sleep(0.5)  # the writer flushes every 50 ms here
                with engine.connect() as conn:
                    rows = conn.execute(
                        select(Step.steps, Step.topk, Step.num_draft_tokens, Step.emitted_tokens)
                        .where(Step.wall_time >= started)
                        .order_by(Step.step_index)
                    ).all()
                assert {(s, k, n) for s, k, n, _ in rows} == {
                    (shape.steps, shape.topk, shape.num_draft_tokens)
                }
                served.append(
                    {
                        "shape": shape,
                        "output_ids": list(out["output_ids"]),
                        "prompt_tokens": out["meta_info"]["prompt_tokens"],
                        "emitted": [e for *_, e in rows],
                    }
                )
    return served


def _check(served: list[dict], expected_steps: list[list[int]], answers, prompt_lens) -> None:
    for i, request in enumerate(served):
        k = i % len(PROMPTS)
        assert request["prompt_tokens"] == prompt_lens[k], i
        assert request["output_ids"] == answers[k], i
        want, got = expected_steps[i], request["emitted"]
        assert len(got) == len(want) and got[:-1] == want[:-1], (i, request["shape"], got, want)
        assert got[-1] >= want[-1], (i, got, want)


def _job(target: Path, draft: Path) -> TraceJob:
    return TraceJob("e2e", tuple(PROMPTS), target, draft, SHAPES, MAX_NEW_TOKENS)


def _cached_reads(earlier: list[list[int]], prompt: list[int]) -> dict[int, int]:
    """Draft positions of ``prompt`` whose KV a radix-cache hit takes from an earlier request
    and that read another token there: ``{position: the token it read}``.

    Position ``j`` (reading token ``j + 1``) is reused while tokens ``0 .. j`` are cached (at
    most ``len(prompt) - 1`` tokens are); its KV is the one the first request that cached
    those tokens computed.
    """
    reads = {}
    for j in range(len(prompt) - 1):
        owner = next((s for s in earlier if len(s) > j + 1 and s[: j + 1] == prompt[: j + 1]), None)
        if owner is None:
            break
        if owner[j + 1] != prompt[j + 1]:
            reads[j] = owner[j + 1]
    return reads


def test_standalone_draft_steps_equal_the_trace(tiny_models, tmp_path):
    target, draft = tiny_models.target, tiny_models.draft
    job = _job(target, draft)
    traces = run_job(job, tmp_path / "traces", progress=False)
    tokens = cached_tokens(job, tmp_path / "traces")
    served = _serve(target, draft, tmp_path)

    # What each request's cached draft KV read, then its trace built from that.
    target_pass = TargetPass(target)
    runner = load_draft(draft, target_pass.model)
    plain_context = runner.context
    sent: list[list[int]] = []
    expected, stale = [], 0
    for i, request in enumerate(served):
        t = tokens[i % len(PROMPTS)]
        column = traces.column(request["shape"])
        reads = _cached_reads(sent, list(t.prompt_ids))
        sent.append([*t.prompt_ids, *request["output_ids"]])
        if not reads:
            expected.append(pinned_steps(traces.requests[i % len(PROMPTS)], column))
            continue
        stale += 1

        def context(ids: torch.Tensor, hidden, reads=reads):
            ids = ids.clone()
            for position, token in reads.items():
                ids[position + 1] = token
            return plain_context(ids, hidden)

        runner.context = context
        traced = tracegen.trace_request(target_pass, runner, t.prompt_ids, t.answer_ids, SHAPES)
        runner.context = plain_context
        expected.append(pinned_steps(traced.trace, column))
    assert 0 < stale < len(served), "the case should hit the radix cache, and not always"
    _check(
        served,
        expected,
        [list(t.answer_ids) for t in tokens],
        [len(t.prompt_ids) for t in tokens],
    )


def test_eagle_head_steps_equal_the_trace(tiny_models, tmp_path):
    target = tiny_models.target
    head = make_tiny_eagle(target, tmp_path / "head", PROMPTS, MAX_NEW_TOKENS)
    job = _job(target, head)
    traces = run_job(job, tmp_path / "traces", progress=False)
    tokens = cached_tokens(job, tmp_path / "traces")
    served = _serve(target, head, tmp_path, ("--speculative-token-map", str(head / TOKEN_MAP_FILE)))
    expected = [
        pinned_steps(traces.requests[i % len(PROMPTS)], traces.column(r["shape"]))
        for i, r in enumerate(served)
    ]
    _check(
        served,
        expected,
        [list(t.answer_ids) for t in tokens],
        [len(t.prompt_ids) for t in tokens],
    )
    assert sum(sum(e) - len(e) for e in expected) > 0, "the head should have accepted tokens"
