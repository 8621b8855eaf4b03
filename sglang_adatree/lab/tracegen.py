"""Exact acceptance traces of a draft / target pair: what every shape emits at every position.

For each prompt, the target's greedy answer (``lab.target_pass``), then one teacher-forced
pass of the target over prompt and answer, the draft's extend over the same tokens and, for
each ``topk`` of the candidate shapes, SGLang's draft-tree expansion at every answer position
at once (``lab.draft_forward``, ``lab.tree_replay``). Each shape's tree is verified greedily
against the answer. The result is a ``TraceSet`` of kind ``exact`` (``lab.traces``).

Everything runs in fp32 on the CPU. Requests are cached one file each under
``<cache_dir>/<name>-<draft>-<key>/`` (``key``: a hash of the models' files, the prompts, the
shapes, ``max_new_tokens`` and the chat-template switch), so an interrupted build resumes
where it stopped, and the finished set (``traces.npz``) is loaded without any model work::

    from sglang_adatree.lab.tracegen import build_traces, load_prompt_set, trace_cache_dir
    name, prompts = load_prompt_set("mtbench")
    traces = build_traces(prompts, name=name, target=paths.target_dir, draft=paths.eagle_dir,
                          shapes=DEFAULT_CANDIDATES, max_new_tokens=128,
                          cache_dir=trace_cache_dir(load_config()))

How exact (``tests/test_e2e_lab_traces.py``): an adatree server pinned to a shape, serving the
same prompts greedily one at a time, emits at every decode step what ``pinned_steps`` reads
from the trace (the test's tiny seeded pairs, a chain and a topk-2 tree; the bundled EAGLE
pair on 4 MT-bench prompts x 48 tokens, 2026-12-02), except the last step of a request, which
the trace caps at the answer's end.
One served case parts by design: a standalone draft behind SGLang's radix cache. SGLang feeds
every draft one token ahead of the target and keys its radix tree by token pairs only for EAGLE
drafts, so after a cache hit the standalone draft's KV at the last reused position is the one
an earlier request computed from its own next token. That depends on the server's history, not
on the request; the end-to-end test reproduces it exactly from what that KV read.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.lab.draft_forward import DraftRunner, load_draft
from sglang_adatree.lab.target_pass import GENERATE_BATCH, TargetPass
from sglang_adatree.lab.traces import RequestTrace, TraceSet
from sglang_adatree.lab.tree_replay import expand, verify

# Bump when a trace built from the same inputs would come out different.
TRACEGEN_VERSION = 2
TRACES_FILE = "traces.npz"
MANIFEST_FILE = "manifest.json"
# The files of a model folder that decide what it computes (weights, config, tokenizer).
MODEL_FILE_PATTERNS = ("*.safetensors", "*.json", "*.jinja", "token_map.pt")
MODEL_FILE_SKIP = ("figures.json", "training.json")  # a draft card's figures: no effect


@dataclass(frozen=True)
class TraceJob:
    """What a trace set is built from; its ``key`` names its cache folder."""

    name: str
    prompts: tuple[str, ...]
    target: Path
    draft: Path
    shapes: tuple[TreeShape, ...]
    max_new_tokens: int
    chat_template: bool = True

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError(f"trace set {self.name}: no prompts")
        if not self.shapes:
            raise ValueError(f"trace set {self.name}: no shapes")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def pair(self) -> str:
        return f"{self.draft.name} / {self.target.name}"

    def key(self) -> str:
        digest = hashlib.sha256()
        header = {
            "version": TRACEGEN_VERSION,
            "shapes": [str(s) for s in self.shapes],
            "max_new_tokens": self.max_new_tokens,
            "chat_template": self.chat_template,
        }
        digest.update(json.dumps(header, sort_keys=True).encode())
        for prompt in self.prompts:
            digest.update(hashlib.sha256(prompt.encode()).digest())
        digest.update(model_fingerprint(self.target).encode())
        digest.update(model_fingerprint(self.draft).encode())
        return digest.hexdigest()[:12]

    def folder(self, cache_dir: Path) -> Path:
        return cache_dir / f"{self.name}-{self.draft.name}-{self.key()}"


@dataclass(frozen=True)
class RequestTokens:
    """One request's tokens as the server sees and produces them."""

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    teacher_mismatches: int  # answer tokens the teacher-forced pass would not pick greedily


@dataclass(frozen=True)
class TracedRequest:
    """One request's trace and the tokens it was built from."""

    trace: RequestTrace
    tokens: RequestTokens


def model_fingerprint(folder: Path) -> str:
    """A hash of the files of a model folder that decide what the model computes."""
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    digest = hashlib.sha256()
    files = sorted({f for pattern in MODEL_FILE_PATTERNS for f in folder.glob(pattern)})
    for f in files:
        if f.name in MODEL_FILE_SKIP or not f.is_file():
            continue
        digest.update(f.name.encode())
        with open(f, "rb") as handle:
            digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()


def trace_cache_dir(config: AdaTreeConfig) -> Path:
    """Where exact traces are cached: ``<home>/lab/traces``."""
    return config.home_dir / "lab" / "traces"


def load_prompt_set(spec: str, limit: int | None = None) -> tuple[str, list[str]]:
    """``(name, prompts)`` of a named evaluation set (``mtbench``, ``gsm8k``, ``humaneval``)
    or of a JSONL file with a ``prompt`` field per line (named after the file's stem)."""
    from sglang_adatree.models.prompts import EVAL_SETS, load_eval_prompts
    from sglang_adatree.tools.bench.workloads import read_jsonl_prompts

    if spec in EVAL_SETS:
        return spec, [p.text for p in load_eval_prompts(spec, limit)]
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(f"prompts {spec!r}: neither {', '.join(EVAL_SETS)} nor a JSONL file")
    prompts = read_jsonl_prompts(path)
    return path.stem, prompts[:limit] if limit is not None else prompts


def build_traces(
    prompts: Sequence[str],
    *,
    name: str,
    target: Path,
    draft: Path,
    shapes: Sequence[TreeShape],
    max_new_tokens: int,
    cache_dir: Path,
    chat_template: bool = True,
    progress: bool = True,
) -> TraceSet:
    """The exact trace set of ``prompts`` under the draft / target pair, built or reused."""
    job = TraceJob(
        name, tuple(prompts), Path(target), Path(draft), tuple(shapes), max_new_tokens,
        chat_template,
    )  # fmt: skip
    return run_job(job, cache_dir, progress)


def run_job(job: TraceJob, cache_dir: Path, progress: bool = True) -> TraceSet:
    """Build ``job``'s trace set in its cache folder (resuming), or load the finished one."""
    folder = job.folder(cache_dir)
    if (folder / TRACES_FILE).is_file():
        return TraceSet.load(folder / TRACES_FILE)
    folder.mkdir(parents=True, exist_ok=True)
    _write_json(folder / MANIFEST_FILE, _manifest(job))
    todo = [i for i in range(len(job.prompts)) if not _request_file(folder, i).is_file()]
    bar = tqdm(
        total=len(job.prompts), initial=len(job.prompts) - len(todo), unit="req",
        desc=f"traces {job.name}", disable=not progress,
    )  # fmt: skip
    started = time.perf_counter()
    if todo:
        target_pass = TargetPass(job.target)
        runner = load_draft(job.draft, target_pass.model)
        for start in range(0, len(todo), GENERATE_BATCH):
            chunk = todo[start : start + GENERATE_BATCH]
            prompt_ids = [target_pass.prompt_ids(job.prompts[i], job.chat_template) for i in chunk]
            answers = target_pass.answers(prompt_ids, job.max_new_tokens)
            for i, ids, answer in zip(chunk, prompt_ids, answers, strict=True):
                traced = trace_request(target_pass, runner, ids, answer, job.shapes)
                _save_request(_request_file(folder, i), traced)
                bar.update(1)
    bar.close()
    requests = [_load_request(folder, i, f"{job.name}-{i}") for i in range(len(job.prompts))]
    traces = TraceSet(job.name, job.pair, "exact", job.shapes, tuple(r.trace for r in requests))
    traces.save(folder / TRACES_FILE)
    tokens = [r.tokens for r in requests]
    _write_json(
        folder / "summary.json",
        {
            "requests": len(tokens),
            "answer_tokens": sum(len(t.answer_ids) for t in tokens),
            "teacher_mismatches": sum(t.teacher_mismatches for t in tokens),
            "build_seconds": round(time.perf_counter() - started, 1),
        },
    )
    return traces


def cached_tokens(job: TraceJob, cache_dir: Path) -> list[RequestTokens]:
    """The prompt and answer tokens of every request of a built (or partly built) job."""
    folder = job.folder(cache_dir)
    return [_load_request(folder, i, "").tokens for i in range(len(job.prompts))]


def trace_request(
    target_pass: TargetPass,
    runner: DraftRunner,
    prompt_ids: Sequence[int],
    answer: Sequence[int],
    shapes: Sequence[TreeShape],
    request_id: str = "",
) -> TracedRequest:
    """One request under every shape: its trace and its tokens."""
    prompt_len, answer_len = len(prompt_ids), len(answer)
    assert prompt_len >= 1 and answer_len >= 1, (prompt_len, answer_len)
    tokens = [*prompt_ids, *answer]
    hidden, mismatches = target_pass.teacher_forced(tokens, prompt_len)
    depth = max((s.steps for s in shapes), default=1) or 1
    emitted = np.ones((answer_len, len(shapes)), dtype=np.int16)
    children = np.zeros((answer_len, len(shapes), depth), dtype=np.int8)
    ranks = np.full((answer_len, len(shapes), depth), -1, dtype=np.int8)
    expected = np.zeros((answer_len, len(shapes)), dtype=np.float32)
    # The draft's first layer as the engine relays it: the widest top-k of the shapes.
    width = max((s.topk for s in shapes if s.speculative), default=1)
    first = np.zeros((answer_len, width), dtype=np.float32)
    speculative = [j for j, s in enumerate(shapes) if s.speculative]
    if answer_len >= 2 and speculative:
        ctx, out = runner.context(torch.tensor(tokens), hidden)
        position = torch.arange(1, answer_len)  # [rows] output tokens before each step
        root = prompt_len + position - 2  # draft position that reads each step's root token
        first_out = out[root]  # [rows, hidden]
        first_logits = runner.logits(first_out)
        first_hidden = first_out if runner.reads_hidden else None
        # SGLang's drafts rank by probability (softmax, then top-k), as ``tree_replay.expand``.
        first[1:] = torch.topk(torch.softmax(first_logits, dim=-1), width).values.numpy()
        answer_t = torch.tensor([*answer, *([-1] * depth)])
        targets = answer_t[position[:, None] + torch.arange(depth)]  # [rows, depth]
        remaining = answer_len - position
        by_topk = sorted(speculative, key=lambda j: shapes[j].topk)
        for topk, group in groupby(by_topk, key=lambda j: shapes[j].topk):
            columns = list(group)
            layers = expand(
                runner, ctx, root + 1, first_logits, first_hidden, topk,
                max(shapes[j].steps for j in columns),
            )  # fmt: skip
            for j in columns:
                s = shapes[j].steps
                outcome = verify(layers, shapes[j], targets, remaining)
                emitted[1:, j] = outcome.emitted.numpy()
                children[1:, j, :s] = outcome.num_children.numpy()
                ranks[1:, j, :s] = outcome.accepted_rank.numpy()
                expected[1:, j] = outcome.draft_expected.numpy()
    return TracedRequest(
        RequestTrace(request_id, prompt_len, emitted, children, ranks, expected, first),
        RequestTokens(tuple(prompt_ids), tuple(answer), mismatches),
    )


def pinned_steps(trace: RequestTrace, column: int) -> list[int]:
    """Emitted tokens of each decode step of the request on a server pinned to the shape in
    ``column``: from position 1 (after the prefill), each step advances by what it emits."""
    steps, position = [], 1
    while position < trace.answer_len:
        steps.append(int(trace.emitted[position, column]))
        position += steps[-1]
    return steps


def _request_file(folder: Path, index: int) -> Path:
    return folder / "requests" / f"{index:05d}.npz"


def _save_request(path: Path, traced: TracedRequest) -> None:
    """Written to a temporary file and renamed: a request's file is whole or absent."""
    t, tokens = traced.trace, traced.tokens
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        emitted=t.emitted,
        num_children=t.num_children,
        accepted_rank=t.accepted_rank,
        draft_expected=t.draft_expected,
        first_layer=t.first_layer,
        prompt_ids=np.asarray(tokens.prompt_ids, dtype=np.int64),
        answer_ids=np.asarray(tokens.answer_ids, dtype=np.int64),
        teacher_mismatches=np.asarray(tokens.teacher_mismatches, dtype=np.int64),
    )
    os.replace(tmp, path)


def _load_request(folder: Path, index: int, request_id: str) -> TracedRequest:
    with np.load(_request_file(folder, index)) as data:
        return TracedRequest(
            RequestTrace(
                request_id=request_id,
                prompt_len=int(data["prompt_ids"].shape[0]),
                emitted=data["emitted"],
                num_children=data["num_children"],
                accepted_rank=data["accepted_rank"],
                draft_expected=data["draft_expected"],
                first_layer=data["first_layer"],
            ),
            RequestTokens(
                tuple(int(t) for t in data["prompt_ids"]),
                tuple(int(t) for t in data["answer_ids"]),
                int(data["teacher_mismatches"]),
            ),
        )


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _manifest(job: TraceJob) -> dict:
    return {
        "name": job.name,
        "pair": job.pair,
        "target": str(job.target),
        "draft": str(job.draft),
        "shapes": [str(s) for s in job.shapes],
        "max_new_tokens": job.max_new_tokens,
        "chat_template": job.chat_template,
        "num_prompts": len(job.prompts),
        "version": TRACEGEN_VERSION,
    }
