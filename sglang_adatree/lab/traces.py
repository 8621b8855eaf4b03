"""Acceptance traces: what every candidate shape would emit at every position of a request.

Under greedy decoding a request's answer is the same whatever shapes verify it, and so is the
draft's view of it at every position (the draft extends over the accepted tokens, which are the
answer's). So the tokens a shape's tree emits when a request has produced ``p`` output tokens
depend on ``p`` and the shape only: a trace tabulates them once, and a simulation replays any
policy, at any load, by reading the table.

Positions: row ``p`` describes the decode step taken when the request's output holds ``p``
tokens (its context is ``prompt_len + p``); it emits answer tokens ``p .. p + e - 1``. Row 0 is
the prefill (it makes the first token, not a decode step) and is never read. Emitted tokens
are capped at what is left of the answer, ``answer_len - p``.

Each row also keeps what the serving loop would learn from that step: the accepted path's
``num_children`` and ``accepted_rank`` per depth (``core.acceptance.AcceptedPathStats`` for one
request), and the draft's own expectation of its tree (the sum of the kept nodes' values, the
product of draft probabilities along each node's path). An exact trace also keeps the draft's
first layer at each position (its top-k probabilities for the step's first token, as the engine
hands them to the step controller), so a policy that reads the draft's confidence can be
replayed too.

A trace set is ``exact`` (built from a real draft / target pair: ``lab.tracegen``) or
``parametric`` (drawn from per-depth, per-rank acceptance hazards: ``parametric``, for pairs
that cannot run here), and says which.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.shapes import TreeShape

KINDS = ("exact", "parametric")
FORMAT = 2


@dataclass(frozen=True)
class RequestTrace:
    """One request's greedy answer replayed under every shape of its set."""

    request_id: str
    prompt_len: int
    emitted: np.ndarray  # [answer_len, shapes] int16, >= 1; row 0 unused
    num_children: np.ndarray  # [answer_len, shapes, depth] int8; 0 past the path's end
    accepted_rank: np.ndarray  # [answer_len, shapes, depth] int8; -1 where nothing accepted
    draft_expected: np.ndarray  # [answer_len, shapes] float32; the draft's expected accepted
    # [answer_len, top-k] float32: the draft's first layer at each position (its top-k
    # probabilities for the step's first token, descending; ``core.confidence.FirstLayer``);
    # None where the trace keeps none (parametric traces).
    first_layer: np.ndarray | None = None

    def __post_init__(self) -> None:
        n, s = self.emitted.shape
        assert self.num_children.shape[:2] == (n, s), "num_children must be [answer, shapes, d]"
        assert self.accepted_rank.shape == self.num_children.shape, "paths must share a shape"
        assert self.draft_expected.shape == (n, s), "draft_expected must be [answer, shapes]"
        if self.first_layer is not None:
            assert self.first_layer.ndim == 2 and self.first_layer.shape[0] == n, (
                "first_layer must be [answer, top-k]"
            )
        if n < 1 or self.prompt_len < 1:
            raise ValueError(f"request {self.request_id}: empty prompt or answer")

    @property
    def answer_len(self) -> int:
        return int(self.emitted.shape[0])

    def walked_emitted(self) -> np.ndarray:
        """``[shapes]`` emitted tokens per step of this answer decoded under each shape alone,
        from position 1 as the simulator starts it: what an estimate of this request's
        acceptance under that shape converges to.

        Not the mean over positions: a step that emits ``e`` tokens skips the next ``e - 1``
        positions. Where acceptance comes in stretches, as in real text, a hard stretch takes a
        step per position and an easy one a step per several, and the mean over positions
        reads a shape high: on the bundled pair's exact traces by up to a seventh, the deeper
        the shape the more. (Where positions are independent, as in parametric traces, the
        two agree on average.)"""
        n, width = self.emitted.shape
        out = np.ones(width)
        for column in range(width):
            position, steps, tokens = 1, 0, 0
            while position < n:
                e = int(self.emitted[position, column])
                tokens, steps, position = tokens + e, steps + 1, position + e
            if steps:
                out[column] = tokens / steps
        return out

    def paths(self, position: int, column: int, steps: int) -> AcceptedPathStats:
        """The accepted path of the step at ``position`` under the shape in ``column`` (of
        ``steps`` depths), as the acceptance estimator observes it: ``[1, steps]`` each."""
        return AcceptedPathStats(
            self.num_children[position, column, :steps][None].astype(np.int64),
            self.accepted_rank[position, column, :steps][None].astype(np.int64),
        )


@dataclass(frozen=True)
class TraceSet:
    """Traces of one prompt set under one draft / target pair, for a tuple of shapes."""

    name: str  # e.g. "mtbench"
    pair: str  # the draft / target pair, e.g. "eagle-smollm2 / SmolLM2-135M-Instruct"
    kind: str  # "exact" or "parametric"
    shapes: tuple[TreeShape, ...]  # the columns of every request's arrays
    requests: tuple[RequestTrace, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"trace kind must be one of {KINDS}, got {self.kind!r}")
        if not self.requests:
            raise ValueError(f"trace set {self.name}: no requests")
        width = len(self.shapes)
        for r in self.requests:
            if r.emitted.shape[1] != width:
                raise ValueError(f"request {r.request_id}: {r.emitted.shape[1]} columns, "
                                 f"the set has {width} shapes")  # fmt: skip

    @property
    def label(self) -> str:
        return f"{self.name} ({self.kind}, {self.pair})"

    def column(self, shape: TreeShape) -> int:
        try:
            return self.shapes.index(shape)
        except ValueError:
            have = " ".join(str(s) for s in self.shapes)
            raise KeyError(f"shape {shape} is not in trace set {self.name} ({have})") from None

    def mean_emitted(self, shape: TreeShape) -> float:
        """Mean emitted tokens a decode step of ``shape`` over every request's positions."""
        j = self.column(shape)
        values = np.concatenate([r.emitted[1:, j] for r in self.requests])
        return float(values.mean()) if values.size else 1.0

    def save(self, path: Path) -> None:
        """One ``.npz`` file: the arrays of every request and a JSON header."""
        header = {
            "format": FORMAT,
            "name": self.name,
            "pair": self.pair,
            "kind": self.kind,
            "shapes": [str(s) for s in self.shapes],
            "requests": [{"id": r.request_id, "prompt_len": r.prompt_len} for r in self.requests],
        }
        arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)}
        for i, r in enumerate(self.requests):
            arrays[f"emitted_{i}"] = r.emitted
            arrays[f"children_{i}"] = r.num_children
            arrays[f"rank_{i}"] = r.accepted_rank
            arrays[f"expected_{i}"] = r.draft_expected
            if r.first_layer is not None:
                arrays[f"first_{i}"] = r.first_layer
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> TraceSet:
        with np.load(path) as data:
            header = json.loads(bytes(data["header"]).decode())
            if header.get("format") != FORMAT:
                raise ValueError(f"{path}: trace format {header.get('format')}, need {FORMAT}")
            requests = tuple(
                RequestTrace(
                    request_id=meta["id"],
                    prompt_len=int(meta["prompt_len"]),
                    emitted=data[f"emitted_{i}"],
                    num_children=data[f"children_{i}"],
                    accepted_rank=data[f"rank_{i}"],
                    draft_expected=data[f"expected_{i}"],
                    first_layer=data.get(f"first_{i}"),
                )
                for i, meta in enumerate(header["requests"])
            )
        return cls(
            name=header["name"],
            pair=header["pair"],
            kind=header["kind"],
            shapes=tuple(TreeShape.parse(s) for s in header["shapes"]),
            requests=requests,
        )


# ---- parametric traces ----------------------------------------------------------------------


def tree_nodes(shape: TreeShape, hazards: np.ndarray) -> list[tuple[int, ...]]:
    """The nodes an EAGLE-2 tree of ``shape`` keeps when draft scores follow ``hazards``.

    A node is the tuple of sibling ranks along its path from the root (``(0, 1)``: the best
    child's second child). Its value is the product of the positional acceptance
    ``p[d, r] = hazard[d, r] * prod_{j<r} (1 - hazard[d, j])`` along the path; each layer
    expands the ``topk`` best nodes of the one above by ``topk`` children, and the tree keeps
    the best ``num_draft_tokens - 1`` nodes of all layers (``core.acceptance`` computes the same
    expectation).
    """
    if not shape.speculative:
        return []
    h = np.asarray(hazards, dtype=np.float64)  # [depth, rank]
    k = shape.topk
    survive = np.cumprod(1.0 - h[:, :k], axis=1)
    p = h[:, :k] * np.concatenate([np.ones((h.shape[0], 1)), survive[:, :-1]], axis=1)
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    candidates: list[tuple[tuple[int, ...], float]] = []
    for depth in range(shape.steps):
        layer = [((*path, r), v * p[depth, r]) for path, v in frontier for r in range(k)]
        candidates.extend(layer)
        frontier = sorted(layer, key=lambda nv: -nv[1])[:k]
    kept = sorted(candidates, key=lambda nv: -nv[1])[: shape.num_draft_tokens - 1]
    return [path for path, _ in kept]


def _walk(
    nodes: Sequence[tuple[int, ...]], accept: np.ndarray, steps: int
) -> tuple[int, np.ndarray, np.ndarray]:
    """Greedy verification of a tree whose node at each (depth, rank) the target would accept
    when ``accept[depth, rank]`` (the first such rank among the kept siblings wins):
    (accepted draft tokens, num_children [steps], accepted_rank [steps])."""
    kept = set(nodes)
    children = np.zeros(steps, dtype=np.int8)
    ranks = np.full(steps, -1, dtype=np.int8)
    path: tuple[int, ...] = ()
    for depth in range(steps):
        offered = sorted(n[-1] for n in kept if len(n) == depth + 1 and n[:-1] == path)
        children[depth] = len(offered)
        hit = next((r for r in offered if accept[depth, r]), None)
        if hit is None:
            return depth, children, ranks
        ranks[depth] = hit
        path = (*path, hit)
    return steps, children, ranks


def parametric_traces(
    name: str,
    pair: str,
    shapes: Sequence[TreeShape],
    hazards_by_class: Mapping[str, np.ndarray],
    *,
    num_requests: int,
    answer_len: int,
    prompt_len: int = 128,
    seed: int = 0,
) -> TraceSet:
    """Traces drawn from acceptance hazards (``[depth, rank]`` per request class), labelled
    parametric.

    Requests take the classes in turn. Answers end where a real one would stop at EOS or the
    token limit: a length drawn uniformly from half of ``answer_len`` up to it (requests that
    all end together would keep a batch in lockstep, which real traffic does not). At each
    position one draw decides, for every (depth, rank), whether the target would accept that
    child given its better siblings were not; every shape is verified against the same draw,
    so a larger tree never emits less than a subtree of it, as with a real draft.
    """
    shapes = tuple(shapes)
    depth = max((s.steps for s in shapes), default=0)
    rank = max((s.topk for s in shapes), default=1)
    classes = sorted(hazards_by_class)
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num_requests):
        cls = classes[i % len(classes)]
        length = int(rng.integers(max(2, answer_len // 2), answer_len + 1))
        h = np.zeros((max(depth, 1), rank))
        given = np.asarray(hazards_by_class[cls], dtype=np.float64)
        h[: min(depth, given.shape[0]), : min(rank, given.shape[1])] = given[:depth, :rank]
        nodes = [tree_nodes(s, h) for s in shapes]
        expected = np.array([_expected(nodes_j, h) for nodes_j in nodes], dtype=np.float32)
        emitted = np.ones((length, len(shapes)), dtype=np.int16)
        children = np.zeros((length, len(shapes), max(depth, 1)), dtype=np.int8)
        ranks = np.full((length, len(shapes), max(depth, 1)), -1, dtype=np.int8)
        for p in range(1, length):
            accept = rng.random(h.shape) < h  # [depth, rank]
            for j, shape in enumerate(shapes):
                if not shape.speculative:
                    continue
                accepted, c, r = _walk(nodes[j], accept, shape.steps)
                emitted[p, j] = min(accepted + 1, length - p)
                children[p, j, : shape.steps] = c
                ranks[p, j, : shape.steps] = r
        requests.append(
            RequestTrace(
                request_id=f"{cls}-{i}",
                prompt_len=prompt_len,
                emitted=emitted,
                num_children=children,
                accepted_rank=ranks,
                draft_expected=np.broadcast_to(expected, (length, len(shapes))).copy(),
            )
        )
    return TraceSet(name, pair, "parametric", shapes, tuple(requests))


def _expected(nodes: Sequence[tuple[int, ...]], hazards: np.ndarray) -> float:
    """The tree's expected accepted draft tokens under ``hazards`` (sum of node values)."""
    if not nodes:
        return 0.0
    k = hazards.shape[1]
    survive = np.cumprod(1.0 - hazards, axis=1)
    p = hazards * np.concatenate([np.ones((hazards.shape[0], 1)), survive[:, :-1]], axis=1)
    total = 0.0
    for node in nodes:
        value = 1.0
        for d, r in enumerate(node):
            value *= p[d, r] if r < k else 0.0
        total += value
    return total
