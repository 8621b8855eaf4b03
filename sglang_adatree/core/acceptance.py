"""Online acceptance estimates by depth and sibling rank; expected emitted tokens of a shape.

Sequoia's positional acceptance, kept per depth: ``hazard[d, r]`` is the probability that the
rank-``r`` child (rank 0 = the draft's best) of an accepted depth-``d`` node is accepted, given
that its better-ranked siblings were not. The unconditional chance that the rank-``r`` child is
the accepted one is then ``p[d, r] = hazard[d, r] * prod_{j<r} (1 - hazard[d, j])``; it does not
depend on how many siblings the tree kept.

Estimates are Beta-style posteriors with explicit priors: ``acceptance_prior *
PRIOR_RANK_RATIO**r`` for rank ``r`` at every depth, worth ``acceptance_prior_weight``
observations at the start. Counts decay exponentially: each verify step that measures a cell
keeps ``1 - acceptance_decay`` of its old counts, and of the prior's pseudo-observations too.
The prior therefore fades once a cell is measured: were its weight kept, it would stay as large
as the decayed evidence itself (about ``batch / acceptance_decay`` trials), and at batch size 1
(20 pseudo-observations against about 50 real ones at decay 0.02) a true hazard of 0.2 would
read 0.31 for ever. The effective observations behind a cell (its decayed trial count) are the
confidence measure.

The default decay, 0.005, keeps about 200 verify steps of evidence. At batch size 1 a step adds
one trial per depth, and the estimate's noise must stay well under the margins the policy
decides by: with 0.02 (50 trials) a hazard of 0.35 reads 0.35 +- 0.05, as wide as the gap
between a chain that pays and one that does not on a CPU, so the policy dropped to no
speculation on an unlucky streak and stayed there (no speculation measures no acceptance): on
GSM8K at concurrency 1 it ran 1,1,2 on 47% of the steps although it measured 1,1,2 13-17%
ahead (``tests/test_policy.py`` simulates this).

Expected emitted tokens of a shape follow how EAGLE-2 builds the tree: a node's value is the
product of ``p`` along its path; layer 1 holds the root's ``topk`` children; each further layer
expands the ``topk`` best nodes of the previous one by ``topk`` children; the tree keeps the best
``num_draft_tokens - 1`` nodes of all layers. Expected accepted tokens = sum of kept values,
emitted = accepted + 1 bonus. A chain with constant acceptance ``a`` gives TurboSpec's
``(1 - a**(k + 1)) / (1 - a)``; no speculation gives 1.

Worked example, ``(2, 2, 3)`` with ``p[0] = p[1] = (0.6, 0.2)``: layer 1 values 0.6, 0.2;
layer 2 values 0.36, 0.12, 0.12, 0.04; keep the best 2 nodes (0.6, 0.36): emitted 1.96.

The positional model is biased for shapes whose paths the data rarely covers. Deep nodes of an
EAGLE-2 tree exist only under paths the draft was confident about, so the deep hazards are
measured mostly there, while a chain drafts its deep tokens whatever the confidence: in the CPU
bench's telemetry (steps after the 100th, one run each) the trees that ran most were predicted
within 3% (2,2,4 1.92 vs 1.94 emitted tokens, 3,4,8 2.27 vs 2.25), the chain 3,1,4 at 1.90 and
1.92 against 1.50 and 1.61 measured, 4,2,8 at 2.31 against 2.00. So each shape carries a
correction factor for how far it does better or worse than the model says, relative to the
shape with the most evidence. A shape's raw factor is the mean, per request, of the ratio of
the emitted tokens of its verify steps to what the model predicted for those requests (as of the
last refresh, scaled by the requests' own acceptance factors, ``RequestAcceptance``: as the
policy saw it), forgotten ``FACTOR_SPEED`` times faster than the counts and shrunk towards 1 by
``factor_prior_weight`` pseudo-requests (``shape_factor_prior_weight``). The policy runs the
shape whose estimate is highest, so a factor lifted by a few lucky steps is acted on and one
lowered is not: on the speculative steps it chose, its predictions ran above what the steps
emitted, and a heavier prior narrows that (``docs/results.md``). Measured against the requests'
own level, a shape that ran only through a hard request, as an exploring step does, is not read
as a worse shape: a step's emitted tokens vary far more from one request to the next than
between the shapes a decision turns on. A request counts with the model's confidence then
(``confidence()``: while the hazards are mostly prior, a miss says nothing about the shape).
Every factor is then divided by the raw factor of the shape with the most evidence, so that
shape is predicted by the hazards alone and the level of every estimate stays the hazards': a
factor that also moved the level would add its own noise to the choice between speculating and
not (in ``tests/test_policy.py``'s batch-1 simulation it cost the paying chain its share of the
steps on 4 of 6 seeds), and would take up the hazards' lag after a change of acceptance for
whichever shape was running. The corrected estimate is clipped to ``[1, steps + 1]``.

Estimates used for decisions change only at refreshes (every ``refresh_every`` observations or
on ``refresh()``), so the hot path reads cached numbers and every rank that saw the same
observations holds the same ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_adatree.config import DEFAULTS, AdaTreeConfig
from sglang_adatree.core.shapes import MAX_STEPS, MAX_TOPK, TreeShape

# Prior hazard of the rank-r sibling relative to rank 0: drafts rank their best guess first,
# and a later sibling is right less often once the better ones failed.
PRIOR_RANK_RATIO = 0.5
DEFAULT_REFRESH_EVERY = 16
# A shape's raw factor forgets this many times faster than the counts (about its last 100
# steps at the default decay): its standing against the reference shape should follow the
# recent traffic. 2 kept most of a simulated chain's bias corrected when it ran in streaks of
# 10 steps in 100 (tests/test_acceptance.py); 4 and 8 left more of it to the shrinkage.
FACTOR_SPEED = 2.0


@dataclass(frozen=True)
class AcceptedPathStats:
    """What the acceptance estimator learns from one verify step, per request and depth.

    ``d`` runs over ``[0, steps)``; the accepted path is root = path[0], path[1], ...,
    path[a] with ``a`` accepted draft tokens.

    * ``num_children[b, d]``: children that path[d] has in the verified tree (how many
      candidates the target could accept at depth d + 1); 0 when ``d > a``.
    * ``accepted_rank[b, d]``: sibling rank of path[d + 1] among the ``topk`` draft children
      of path[d] (0 = the draft's most likely token), or -1 when ``d >= a`` (nothing accepted
      at depth d + 1).

    So depth d "offered" ``num_children[b, d]`` tokens and the target took rank
    ``accepted_rank[b, d]``, or rejected them all when that is -1 and ``num_children > 0``.
    Both are integers on the host: torch tensors, NumPy arrays or nested lists.
    """

    num_children: Any  # [batch, steps] int
    accepted_rank: Any  # [batch, steps] int

    def as_lists(self) -> AcceptedPathStats:
        """The same paths as nested lists of ints, ``[batch][steps]``, as the step controller
        reads them: a step's paths are read several times, and a batch's few dozen numbers
        are cheaper walked by the interpreter than by array operations in a CPU server, whose
        forward has just swept the caches (``core.cost_model``)."""
        return AcceptedPathStats(host_lists(self.num_children), host_lists(self.accepted_rank))


def host_lists(values: Any) -> list[list[int]]:
    """``values`` ``[batch, steps]`` (a host torch tensor, a NumPy array or nested lists) as
    nested lists of ints."""
    if isinstance(values, list):
        return values
    to_list = getattr(values, "tolist", None)
    if to_list is not None:
        return to_list()
    return [[int(v) for v in row] for row in values]


def accepted_counts(
    stats: AcceptedPathStats, topk: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(offered per depth, accepted per depth, accepted per sibling rank), batch totals."""
    children, ranks = host_lists(stats.num_children), host_lists(stats.accepted_rank)
    steps = len(ranks[0]) if ranks else 0
    offered, accepted, by_rank = [0] * steps, [0] * steps, [0] * topk
    for children_row, rank_row in zip(children, ranks, strict=True):
        for d in range(steps):
            offered[d] += children_row[d]
            rank = rank_row[d]
            if rank >= 0:
                accepted[d] += 1
                if rank < topk:
                    by_rank[rank] += 1
    return tuple(offered), tuple(accepted), tuple(by_rank)


def _cells(value: float) -> list[list[float]]:
    """``[MAX_STEPS][MAX_TOPK]`` cells holding ``value``."""
    return [[value] * MAX_TOPK for _ in range(MAX_STEPS)]


@dataclass
class _Counts:
    """Decayed acceptance counts and the per-shape correction's evidence.

    The cells are lists of rows, ``[MAX_STEPS][MAX_TOPK]``: a step adds to the few it measured
    (``AcceptedPathStats.as_lists``), and a refresh reads them all as arrays."""

    trials: list[list[float]] = field(default_factory=lambda: _cells(0.0))
    accepts: list[list[float]] = field(default_factory=lambda: _cells(0.0))
    # Share of the prior's pseudo-observations still held: decays with the counts.
    prior_keep: list[list[float]] = field(default_factory=lambda: _cells(1.0))
    acceptance_length: dict[TreeShape, float] = field(default_factory=dict)
    # Per shape, decayed sums over requests (each weighted by the model's confidence then) of
    # measured / predicted emitted tokens, and of the weights: the correction factor's evidence.
    ratio_sum: dict[TreeShape, float] = field(default_factory=dict)
    ratio_weight: dict[TreeShape, float] = field(default_factory=dict)


class AcceptanceEstimator:
    """Online acceptance by depth and sibling rank; see the module docstring."""

    def __init__(
        self,
        prior: float = DEFAULTS["acceptance_prior"],
        prior_weight: float = DEFAULTS["acceptance_prior_weight"],
        decay: float = DEFAULTS["acceptance_decay"],
        refresh_every: int = DEFAULT_REFRESH_EVERY,
        factor_prior_weight: float = DEFAULTS["shape_factor_prior_weight"],
    ) -> None:
        if not 0.0 < prior < 1.0 or prior_weight < 0.0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"bad estimator settings: {prior=}, {prior_weight=}, {decay=}")
        if factor_prior_weight < 0.0:
            raise ValueError(f"factor_prior_weight must be >= 0, got {factor_prior_weight}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        self.prior_weight = prior_weight
        self.factor_prior_weight = factor_prior_weight
        self.decay = decay
        self.refresh_every = refresh_every
        ranks = np.arange(MAX_TOPK, dtype=np.float64)
        self.prior_hazards = np.broadcast_to(
            prior * PRIOR_RANK_RATIO**ranks, (MAX_STEPS, MAX_TOPK)
        ).copy()  # [MAX_STEPS, MAX_TOPK]
        self._counts = _Counts()
        self._pending = 0
        self.revision = 0
        self._hazards = self.prior_hazards
        self._emitted: dict[TreeShape, float] = {}
        self._model: dict[TreeShape, float] = {}
        self._factors: dict[TreeShape, float] = {}
        self._layers: dict[int, list[np.ndarray]] = {}
        self._positional: np.ndarray | None = None
        self._many: tuple[Sequence[TreeShape], np.ndarray] | None = None
        self._first_weights: tuple[Sequence[TreeShape], np.ndarray] | None = None
        # The confidence as of the last refresh: what a step's miss against the model of that
        # refresh is weighed by (``observe``).
        self._refreshed_confidence = 0.0
        self.refresh()

    @classmethod
    def from_config(cls, config: AdaTreeConfig, **kwargs: Any) -> AcceptanceEstimator:
        return cls(
            prior=config.acceptance_prior,
            prior_weight=config.acceptance_prior_weight,
            decay=config.acceptance_decay,
            factor_prior_weight=config.shape_factor_prior_weight,
            **kwargs,
        )

    def observe(
        self,
        shape: TreeShape,
        num_children: Any,
        accepted_rank: Any,
        request_factor: float = 1.0,
    ) -> None:
        """Add one verify step's accepted paths (tensors or arrays on the CPU).

        ``num_children``: ``[batch, steps]`` int, children the depth-d node of each request's
        accepted path has in the verified tree (d = 0 the root; 0 past the path's end).
        ``accepted_rank``: ``[batch, steps]`` int, draft sibling rank of the child accepted at
        depth d + 1, or -1 if none (``AcceptedPathStats`` holds both).
        ``request_factor``: the batch's mean request acceptance factor when the step was chosen
        (``RequestAcceptance.batch_factor``); the shape's factor measures the step against the
        model's prediction for these requests.

        A trial of rank r at depth d happened when ``num_children > r`` and ``accepted_rank``
        is -1 or ``>= r``. The tree keeps a node's children as a prefix of their draft ranks
        (EAGLE-2 keeps siblings by draft score), except that a score tie may keep a later rank
        instead; so an accepted rank r counts ranks 0..r as tried even if ``num_children <= r``,
        which keeps every hazard a probability.
        """
        children, ranks = host_lists(num_children), host_lists(accepted_rank)
        assert shape.speculative, "no speculation verifies no draft tokens"
        steps, topk = shape.steps, shape.topk
        # trials[d][r]: requests with more than r ranks tried at depth d; accepts[d][r]: those
        # that accepted rank r there. A batch's few dozen cells, walked by the interpreter
        # (``AcceptedPathStats.as_lists``).
        trials = [[0] * MAX_TOPK for _ in range(steps)]
        accepts = [[0] * MAX_TOPK for _ in range(steps)]
        hits = 0
        for children_row, rank_row in zip(children, ranks, strict=True):
            assert len(children_row) == len(rank_row) == steps, (
                f"expected {steps} depths, got {len(children_row)} and {len(rank_row)}"
            )
            for d in range(steps):
                rank, offered = rank_row[d], children_row[d]
                assert offered <= topk, f"more than topk {topk} children"
                assert rank < topk, f"accepted rank >= topk {topk}"
                # Ranks 0 .. tried-1 were tried at this depth.
                tried = rank + 1 if rank >= 0 else offered
                row = trials[d]
                for r in range(tried):
                    row[r] += 1
                if rank >= 0:
                    accepts[d][rank] += 1
                    hits += 1
        batch = len(ranks)
        emitted = 1.0 + hits / max(batch, 1)
        # What the model predicted for this step, and how far to trust that prediction: both
        # as of the last refresh, as the policy saw them.
        weight = batch * self._refreshed_confidence
        ratio = emitted / (1.0 + request_factor * (self.model_emitted(shape) - 1.0))
        counts = self._counts
        self._add(counts, shape, trials, accepts, emitted)
        keep = 1.0 - min(1.0, FACTOR_SPEED * self.decay)
        counts.ratio_sum[shape] = keep * counts.ratio_sum.get(shape, 0.0) + weight * ratio
        counts.ratio_weight[shape] = keep * counts.ratio_weight.get(shape, 0.0) + weight
        self._pending += 1
        if self._pending >= self.refresh_every:
            self.refresh()

    def _add(
        self,
        counts: _Counts,
        shape: TreeShape,
        trials: list[list[int]],  # [steps][MAX_TOPK]
        accepts: list[list[int]],  # [steps][MAX_TOPK]
        emitted: float,
    ) -> None:
        keep = 1.0 - self.decay
        for d, (step_trials, step_accepts) in enumerate(zip(trials, accepts, strict=True)):
            cell_trials, cell_accepts = counts.trials[d], counts.accepts[d]
            prior_keep = counts.prior_keep[d]
            for r, tried in enumerate(step_trials):
                # Only measured cells decay. A depth's trials never grow with the rank (a
                # rank is tried only after every one before it), so the first unmeasured
                # cell ends the row's measured ones.
                if tried == 0:
                    break
                cell_trials[r] = cell_trials[r] * keep + tried
                cell_accepts[r] = cell_accepts[r] * keep + step_accepts[r]
                prior_keep[r] *= keep
        old = counts.acceptance_length.get(shape)
        counts.acceptance_length[shape] = (
            emitted if old is None else (1.0 - self.decay) * old + self.decay * emitted
        )

    def refresh(self) -> None:
        """Recompute the cached estimates from the counts; bumps ``revision``."""
        self._hazards = self._posterior(self._counts, self.prior_hazards)
        self._refreshed_confidence = self.confidence()
        self._factors = self._shape_factors(self._counts)
        wanted = list(self._emitted)
        many = self._many
        self._emitted = {}
        self._model = {}
        self._layers = {}
        self._positional = None
        self._many = None
        self._first_weights = None
        for shape in wanted:
            self.expected_emitted(shape)
        if many is not None:
            self.expected_emitted_many(many[0])
        self._pending = 0
        self.revision += 1

    def _shape_factors(self, counts: _Counts) -> dict[TreeShape, float]:
        """Per measured shape, its ratios' weighted mean shrunk towards 1, divided by that of
        the shape with the most evidence, whose factor is thus 1."""
        k = self.factor_prior_weight
        out = {}
        for shape, w in counts.ratio_weight.items():
            if w + k > 0:
                out[shape] = (counts.ratio_sum[shape] + k) / (w + k)
        if out:
            reference = out[max(out, key=lambda s: counts.ratio_weight[s])]
            out = {shape: f / reference for shape, f in out.items()}
        return out

    def _posterior(self, counts: _Counts, prior: np.ndarray) -> np.ndarray:
        """``[MAX_STEPS, MAX_TOPK]`` hazards: counts plus the prior's remaining
        pseudo-observations (``prior_weight``, decayed as the cell's counts were).

        The prior of depth ``d + 1`` is the posterior of depth ``d``: a draft accepts deep
        tokens about as well as shallow ones, and deep cells are measured only by the deep trees
        that reach them, so a fixed prior there would keep those trees priced by it long after
        the shallow depths showed what this draft does."""
        w = self.prior_weight * np.array(counts.prior_keep)  # [MAX_STEPS, MAX_TOPK]
        accepts = np.array(counts.accepts)  # [MAX_STEPS, MAX_TOPK]
        trials = np.array(counts.trials) + w
        safe = np.where(trials > 0, trials, 1.0)
        out = np.empty_like(prior)
        above = prior[0]
        for d in range(prior.shape[0]):
            # A cell never measured under prior weight 0 has no data: it keeps its prior.
            out[d] = np.where(trials[d] > 0, (accepts[d] + w[d] * above) / safe[d], above)
            above = out[d]
        return out

    def hazards(self) -> np.ndarray:
        """``[MAX_STEPS, MAX_TOPK]`` hazard estimates as of the last refresh."""
        return self._hazards.copy()

    def positional_acceptance(self) -> np.ndarray:
        """``[MAX_STEPS, MAX_TOPK]`` chance that the rank-r child at depth d is the accepted one."""
        h = self._hazards
        survive = np.cumprod(1.0 - h, axis=1)  # [MAX_STEPS, MAX_TOPK]
        return h * np.concatenate([np.ones((MAX_STEPS, 1)), survive[:, :-1]], axis=1)

    def effective_observations(self) -> np.ndarray:
        """``[MAX_STEPS, MAX_TOPK]`` decayed trial counts behind each estimate."""
        return np.array(self._counts.trials)

    def confidence(self) -> float:
        """Weight of data against the prior for the root's top-ranked child, in [0, 1)."""
        n = self._counts.trials[0][0]
        return n / (n + self.prior_weight) if n + self.prior_weight > 0 else 0.0

    def acceptance_length(self, shape: TreeShape) -> float | None:
        """Recent measured emitted tokens per request for ``shape``, or None if never run."""
        return self._counts.acceptance_length.get(shape)

    def expected_emitted(self, shape: TreeShape) -> float:
        """Expected emitted tokens per request (accepted + 1 bonus) of ``shape``: the
        positional model's value times the shape's correction factor, clipped to
        ``[1, steps + 1]``."""
        cached = self._emitted.get(shape)
        if cached is not None:
            return cached
        value = self.model_emitted(shape)
        if shape.speculative:
            value = min(max(value * self.correction(shape), 1.0), shape.steps + 1.0)
        self._emitted[shape] = value
        return value

    def model_emitted(self, shape: TreeShape) -> float:
        """The positional model's expected emitted tokens per request, uncorrected."""
        cached = self._model.get(shape)
        if cached is not None:
            return cached
        if not shape.speculative:
            value = 1.0
        else:
            layers = self._tree_layers(shape.topk, shape.steps)
            values = np.sort(np.concatenate(layers[: shape.steps]))[::-1]
            value = 1.0 + float(values[: shape.num_draft_tokens - 1].sum())
        self._model[shape] = value
        return value

    def correction(self, shape: TreeShape) -> float:
        """The factor ``expected_emitted`` applies to ``model_emitted`` (before clipping); 1
        for a shape never measured."""
        return self._factors.get(shape, 1.0)

    def expected_emitted_many(self, shapes: Sequence[TreeShape]) -> np.ndarray:
        """``[len(shapes)]`` expected emitted tokens per request of each shape (read-only).

        The array for the last ``shapes`` object asked for is kept and recomputed at each
        refresh, so a policy asking every step with the same tuple pays one comparison.
        """
        many = self._many
        if many is not None and many[0] is shapes:
            return many[1]
        values = np.array([self.expected_emitted(s) for s in shapes])
        values.flags.writeable = False
        self._many = (shapes, values)
        return values

    def first_layer_weights(self, shapes: Sequence[TreeShape]) -> np.ndarray:
        """``[ranks, len(shapes)]`` what each first-layer token is worth to each shape: the
        sum, over the nodes the shape's tree keeps that descend from the rank-``r`` child of
        the root, of their values below it (the product of the positional acceptance along the
        path after the first depth). ``ranks`` is the widest ``topk`` of ``shapes``.

        A shape's expected accepted tokens are ``sum_r p[0, r] * W[r]``, so a request whose
        draft states the first layer's probabilities ``q`` (``core.confidence``) expects
        ``1 + q @ W[:, shape]`` emitted tokens before the shape's correction factor: the tree
        the estimates keep, each branch weighed by the draft's own chance of its first token.
        Kept until the next refresh for the last ``shapes`` asked for."""
        kept = self._first_weights
        if kept is not None and kept[0] is shapes:
            return kept[1]
        p = self._positional
        if p is None:
            p = self._positional = self.positional_acceptance()  # [MAX_STEPS, MAX_TOPK]
        ranks = max((s.topk for s in shapes if s.speculative), default=1)
        out = np.zeros((ranks, len(shapes)))
        grown: dict[int, tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]] = {}
        for j, shape in enumerate(shapes):
            if not shape.speculative:
                continue
            k = shape.topk
            values, below, first = grown.setdefault(k, ([], [], []))
            _grow_by_branch(p, values, below, first, k, shape.steps)
            v = np.concatenate(values[: shape.steps])  # [nodes]
            order = np.argsort(-v, kind="stable")[: shape.num_draft_tokens - 1]
            b = np.concatenate(below[: shape.steps])[order]  # [kept nodes]
            r = np.concatenate(first[: shape.steps])[order]  # [kept nodes]
            out[:k, j] = np.bincount(r, weights=b, minlength=k)
        out.flags.writeable = False
        self._first_weights = (shapes, out)
        return out

    def _tree_layers(self, topk: int, steps: int) -> list[np.ndarray]:
        """Candidate node values per layer for ``topk``, at least ``steps`` layers deep.

        Shapes sharing ``topk`` share layers, so they are built once per refresh and extended.
        """
        layers = self._layers.setdefault(topk, [])
        if len(layers) >= steps:
            return layers
        p = self._positional
        if p is None:
            p = self._positional = self.positional_acceptance()  # [MAX_STEPS, MAX_TOPK]
        frontier = np.sort(layers[-1])[::-1][:topk] if layers else np.ones(1)
        for depth in range(len(layers), steps):
            children = np.outer(frontier, p[depth, :topk]).ravel()  # [len(frontier) * topk]
            layers.append(children)
            frontier = np.sort(children)[::-1][:topk]
        return layers


def _grow_by_branch(
    p: np.ndarray,
    values: list[np.ndarray],
    below: list[np.ndarray],
    first: list[np.ndarray],
    topk: int,
    steps: int,
) -> None:
    """The candidate node values per layer for ``topk`` (as ``_tree_layers``), each node also
    with its value below the first depth and the rank of the first-layer node it descends
    from: the three lists extended in place to ``steps`` layers."""
    if not values:
        values.append(p[0, :topk].copy())
        below.append(np.ones(topk))
        first.append(np.arange(topk))
    for depth in range(len(values), steps):
        top = np.argsort(-values[-1], kind="stable")[:topk]  # the frontier
        values.append(np.outer(values[-1][top], p[depth, :topk]).ravel())
        below.append(np.outer(below[-1][top], p[depth, :topk]).ravel())
        first.append(np.repeat(first[-1][top], topk))


SPREAD_KEEP = 0.95  # the weight a departed request keeps per later departure
SPREAD_MIN_REQUESTS = 3.0  # of those weights, over requests that verified two steps (four)


@dataclass
class _RequestEvidence:
    ratio_sum: float = 0.0  # decayed sum of accepted / expected accepted over verify steps
    accepted: float = 0.0  # decayed sum of accepted draft tokens over verify steps
    expected: float = 0.0  # decayed sum of those expected of the request there
    weight: float = 0.0  # decayed number of those steps
    seen: int = 0  # the observation counter when last seen
    verified: int = 0  # verify steps, undecayed
    ratio_total: float = 0.0  # undecayed sum of the ratios
    ratio_squares: float = 0.0  # undecayed sum of their squares
    steps: int = 0  # decode steps, speculative or not
    closed: bool = False  # counted in the spread between requests


@dataclass(frozen=True)
class RequestSpread:
    """How far a new request's acceptance factor may sit from the estimator's, as the requests
    that left showed it: ``between`` the variance of their true factors, ``within`` the
    variance of one verify step's ratio inside a request, ``steps`` their mean decode steps."""

    between: float
    within: float
    steps: float


class RequestAcceptance:
    """How each request accepts relative to the estimator: a factor on its expected accepted
    draft tokens.

    Acceptance varies by prompt far more than by position inside one answer: a batch's expected
    emitted tokens under a shape is the mean over its requests of ``1 + f_r * (E(shape) - 1)``,
    ``E`` the estimator's expected emitted tokens. A request's factor ``f_r`` is the ratio of the
    draft tokens it accepted to those the estimator expected of it, over its recent verify steps
    (each older step's weight kept ``keep`` per step), shrunk towards 1 by ``prior_steps``
    pseudo-steps: a new request is the estimator's, a few steps make it its own. The ratio is the
    mean of each step's, or with ``ratio_of_sums`` the ratio of the sums: where a step can be
    expected to accept a tenth of a token (a draft unsure of its first token under the draft's
    first layer, ``core.confidence``), one that accepts two would move the mean twenty times as
    far as a step that expected one. The batch needs only the mean factor, since the
    expectation is linear in it.

    A step that verifies nothing for a request (no speculation) ages its evidence as a verify
    step would (``age``): a factor pulled down by an unlucky streak would otherwise price every
    tree out for the rest of the request, and a request served without speculation measures
    nothing that could lift it again.

    A request that leaves the batch (``close``) joins the spread between requests (``spread``):
    how far a new request's factor may sit from 1, which prices what a new request's first
    steps would tell (``policy.Policy``'s probe).
    """

    def __init__(
        self,
        prior_steps: float,
        keep: float,
        max_requests: int = 4096,
        ratio_of_sums: bool = False,
    ) -> None:
        if prior_steps < 0 or not 0.0 <= keep < 1.0:
            raise ValueError(f"bad request acceptance settings: {prior_steps=}, {keep=}")
        self.prior_steps = prior_steps
        self.keep = keep
        self.ratio_of_sums = ratio_of_sums
        self.max_requests = max_requests
        self._evidence: dict[str, _RequestEvidence] = {}
        self._counter = 0
        # Over the requests that left, each older one's weight kept SPREAD_KEEP per request:
        # [requests, requests with two verify steps, sum of means, of squared means, of the
        # means' sampling variances, of the within variances, of decode steps].
        self._spread = [0.0] * 7

    def factor(self, request_id: str) -> float:
        e = self._evidence.get(request_id)
        if e is None or e.weight + self.prior_steps <= 0.0:  # nothing verified, no prior
            return 1.0
        if not self.ratio_of_sums:
            return (e.ratio_sum + self.prior_steps) / (e.weight + self.prior_steps)
        ratio = e.accepted / e.expected if e.expected > 0.0 else 1.0
        return (e.weight * ratio + self.prior_steps) / (e.weight + self.prior_steps)

    def batch_factor(self, request_ids: Sequence[str]) -> float:
        """The mean factor over a batch (1.0 for requests never observed)."""
        if not request_ids:
            return 1.0
        return sum(self.factor(r) for r in request_ids) / len(request_ids)

    def observe(
        self, request_ids: Sequence[str], accepted: Any, expected: float | Sequence[float]
    ) -> None:
        """One verify step: ``accepted`` ``[batch]`` draft tokens each request accepted, where
        ``expected`` were expected of each (one value for all, or ``[batch]``: the estimator's
        times what is known of the step beyond the request, its draft's confidence)."""
        each = [expected] * len(request_ids) if isinstance(expected, int | float) else expected
        if min(each, default=0.0) <= 0:
            return
        self._counter += 1
        counts = accepted.tolist() if hasattr(accepted, "tolist") else list(accepted)  # [batch]
        assert len(counts) == len(request_ids), f"{len(counts)} counts for {len(request_ids)} ids"
        for request_id, a, x in zip(request_ids, counts, each, strict=True):
            e = self._evidence.get(request_id)
            if e is None:
                e = self._evidence[request_id] = _RequestEvidence()
            ratio = a / x
            e.ratio_sum = self.keep * e.ratio_sum + ratio
            e.accepted = self.keep * e.accepted + a
            e.expected = self.keep * e.expected + x
            e.weight = self.keep * e.weight + 1.0
            e.seen = self._counter
            e.verified += 1
            e.ratio_total += ratio
            e.ratio_squares += ratio * ratio
            e.steps += 1
        self._forget_departed()

    def age(self, request_ids: Sequence[str]) -> None:
        """One step that verified nothing for ``request_ids``: their evidence keeps ``keep``,
        and the step counts among their decode steps."""
        self._counter += 1
        for request_id in request_ids:
            e = self._evidence.get(request_id)
            if e is None:
                e = self._evidence[request_id] = _RequestEvidence()
            e.ratio_sum *= self.keep
            e.accepted *= self.keep
            e.expected *= self.keep
            e.weight *= self.keep
            e.seen = self._counter
            e.steps += 1
        self._forget_departed()

    def close(self, request_ids: Iterable[str]) -> None:
        """``request_ids`` left the batch: their whole answers join the spread between
        requests (once each; their evidence stays, should one come back)."""
        k, t = SPREAD_KEEP, self._spread
        for request_id in request_ids:
            e = self._evidence.get(request_id)
            if e is None or e.closed:
                continue
            e.closed = True
            t[0] = k * t[0] + 1.0
            t[6] = k * t[6] + e.steps
            if e.verified < 2:
                continue
            n = e.verified
            mean = e.ratio_total / n
            within = max(e.ratio_squares - n * mean * mean, 0.0) / (n - 1)
            t[1] = k * t[1] + 1.0
            t[2] = k * t[2] + mean
            t[3] = k * t[3] + mean * mean
            t[4] = k * t[4] + within / n
            t[5] = k * t[5] + within

    def spread(self) -> RequestSpread | None:
        """The spread between the requests that left (a method of moments: the variance of
        their mean ratios less the mean sampling variance of those means); None until the
        weight of those that verified two steps reaches SPREAD_MIN_REQUESTS."""
        t = self._spread
        w = t[1]
        if w < SPREAD_MIN_REQUESTS:
            return None
        mean = t[2] / w
        between = max(t[3] / w - mean * mean - t[4] / w, 0.0)
        return RequestSpread(between, t[5] / w, t[6] / t[0])

    def _forget_departed(self) -> None:
        if len(self._evidence) > self.max_requests:
            # Requests that left (finished, aborted) stop being seen: forget the oldest half.
            by_age = sorted(self._evidence.items(), key=lambda kv: kv[1].seen)
            for request_id, _ in by_age[: len(by_age) // 2]:
                del self._evidence[request_id]
