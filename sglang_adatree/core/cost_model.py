"""Step-time cost models: the protocol, the analytic model and the online residual correction.

Two layers:

* a step-time model maps feature rows (``features.FEATURE_NAMES``) to milliseconds:
  ``AnalyticStepTime`` here (TurboSpec's linear model plus draft terms, usable from the first
  step and fitted by least squares), ``xgb_cost.XGBoostStepTime`` for the trained one;
* ``OnlineCostModel`` implements the ``CostModel`` protocol the policy uses: it wraps a
  step-time model, optionally reads its predictions from a precomputed ``CostTable``, and
  multiplies them by a per-shape residual correction so that measured step times pull the
  predictions back when the model is off.

The residual correction is a Kalman filter over ``log(measured_ms / predicted_ms)``, whose
state is a drift common to every shape (the machine's speed: a shared CPU, a GPU's clocks,
neighbours), the split (how the machine prices speculation against plain decoding otherwise
than the model does: a tilt per unit of a shape's lever, and an offset common to every
speculative shape), and one part per shape (how far the step-time model misprices that shape),
each with its variance and their covariances. A step of a shape measures the drift, plus the
tilt times the shape's lever (the log of the shape's predicted time over no speculation's for
the same batch: 0 for no speculation), plus the offset if the shape speculates, plus that
shape's part, plus the step's own noise, and splits what it says between them in proportion to
how little each is known:

* at the start the drift is unknown (the default model may be a GPU's costs on a CPU, ten times
  off) and a shape's part is near the model's view of the shape (which counts as
  ``PRIOR_STEPS`` of the shape's steps; a measured profile of the deployment as many as its
  error is smaller than a step's noise, below), so the first steps set the drift;
* between steps the drift walks (the machine changes; the walk is set so that while one shape
  runs, a step moves the drift by about ``DRIFT_GAIN_RATIO * residual_decay`` of its surprise)
  and every part walks far slower (``PART_WALK``), so a shape's standing against the others goes
  stale slowly while it does not run;
* a shape that runs pins the sum of the drift and its own part, but not how they split; a step
  of another shape, measured rarely, then mostly corrects that other shape's part (its variance
  is the larger), not the drift, so a shape priced wrong by a few noisy steps is put right by
  the next few steps it runs, while the running shape's prediction does not move.

Every variance is in units of one step's noise, which then drops out of every gain: a step
moves the estimates as far on the 2-core CPU, whose steps stray by 17% (docs/lab.md), as on a
GPU, whose steps stray by a few percent. What a measured profile (``step_profile``) knows of a
shape is the exception: its error (``PROFILE_ERROR``) is a fraction of the step time whatever
the platform, so in noise units it is worth ``(noise / PROFILE_ERROR)^2`` of a shape's steps:
about 25 under a noise of 15%, 1 under a GPU's few percent. The filter estimates the noise
from its own surprises (``noise_var``) and gives a profile-priced shape that worth at its first
measured step (the shapes measured before the estimate settled, at ``NOISE_SETTLED`` steps,
then). A profile worth a fixed 16 steps held its price against a few slow exploring steps on
the CPU but cost the GPU scenarios more
(docs/notes/2026-12-05-a-profile-worth-the-platforms-noise.md).

The split is what a machine that is not the profiled one looks like: a shared CPU can speed up
its plain step more than its trees (memory against compute), a change in the shapes' ratio that
the drift, common to all, cannot carry. With the drift alone, the speculative shapes that run
set it, no speculation is priced by it, and a profile-priced part, worth tens of steps, barely
moves on the rare step that measures it: a server goes on speculating where speculation loses
(docs/notes/2026-12-06-the-split.md). With the split, two shapes of different levers (an
exploring step of a larger tree is one) tell the tilt from the drift, and no speculation's price
follows without its running; one step of no speculation sets the offset, which a part worth
tens of steps would not have let it move.

The corrected prediction is
``predicted_ms * exp(drift + lever * tilt + [speculative] * offset + shape's part)``. Without
the drift only the shape that runs learns that the machine got faster or slower: measured on
this CPU, the chain 1,1,2 went from 139 to 115 ms a step while it ran, the tree 2,2,4 kept its
old prediction (186 ms; an exploring step measured it at 130) and the policy stayed on the chain
for 200 steps where the tree was 6% better. The filter replaces a moving average per shape
beside a drift that took about 80% of every surprise: under a shared CPU's noise that share
kept a shape's error from its warm-up steps (20% in a served run) for the rest of a run, since
an exploring step of that shape mostly moved the drift, which the running shape's steps then
moved back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

import numpy as np
from scipy.optimize import nnls

from sglang_adatree.core.features import (
    COLUMN,
    NUM_FEATURES,
    StepFeatures,
    build_feature_matrix,
    feature_matrix,
    shape_columns,
)
from sglang_adatree.core.shapes import NO_SPEC, TreeShape

if TYPE_CHECKING:
    from sglang_adatree.core.cost_table import CostTable

# Predictions are clamped here: a fitted linear model can extrapolate to zero or below, and the
# policy divides by step time.
MIN_STEP_MS = 0.01

# The drift's gain per step while one shape runs, as a multiple of ``residual_decay`` (at most
# ``MAX_DRIFT_GAIN``): fast enough to follow the machine, slow enough to average a few steps'
# noise (0.2 at the default 0.05).
DRIFT_GAIN_RATIO = 4.0
MAX_DRIFT_GAIN = 0.9
# The filter's variances are in units of one step's noise (its variance, which then drops out of
# every gain: how far one step may move an estimate is the same on a CPU whose steps stray by
# 17% and on a GPU whose steps stray by 3%). The step-time model's view of a shape is worth
# ``PRIOR_STEPS`` of its steps; the drift at the start is unknown (the default model is a GPU's
# costs, ten times off on a CPU).
PRIOR_STEPS = 4.0
DRIFT_PRIOR = 1.0e4
# A measured profile's error, as a fraction of a step's time: the lab's profiled start draws
# each cell 3% off, and the CPU profile priced a served run's steps within 3.8%.
PROFILE_ERROR = 0.03
# A profile-priced shape is worth between 1 and 64 of its steps: never less than a step, and
# not so many that a shape the profile got wrong takes hundreds of steps to correct.
PROFILE_WORTH_RANGE = (1.0, 64.0)
# The noise is estimated from the steps whose predicted variance is under this, in noise units
# (state known to within about a step's noise), with each step's weight at least
# ``NOISE_MIN_WEIGHT`` (the estimate follows the last ~50 such steps once it has seen that many).
NOISE_WELL_KNOWN = 2.0
NOISE_MIN_WEIGHT = 0.02
NOISE_SETTLED = 20
# A part's walk per step: after a thousand steps without running, a shape's standing is as
# uncertain as one step of it.
PART_WALK = 0.001
# The variance at the start of the split's two states, in noise units: how far the machine may
# price speculation against plain decoding otherwise than the step-time model does, per unit of
# a shape's lever (the tilt) and for every speculative shape alike (the offset). Ten of a step's
# noise: a machine whose trees cost twice what the model says against plain decoding is a
# surprise a few steps can take. Both walk as a part does.
SPLIT_PRIOR = 100.0
# The states before the parts: the drift, the tilt, the offset.
_COMMON = 3


class CostModel(Protocol):
    """Predicted step time of a batch under a shape, corrected online by measurements."""

    def predict_ms(self, features: StepFeatures, shape: TreeShape) -> float: ...

    def predict_ms_many(
        self, features: StepFeatures, shapes: Sequence[TreeShape]
    ) -> np.ndarray: ...  # [len(shapes)] ms

    def predict_ms_list(
        self, features: StepFeatures, shapes: Sequence[TreeShape]
    ) -> list[float]: ...  # [len(shapes)] ms, as the policy asks every step

    def observe(self, features: StepFeatures, shape: TreeShape, measured_ms: float) -> None: ...


class StepTimeModel(Protocol):
    """A fixed regressor from feature rows to step time; no online state."""

    def predict_matrix(self, x: np.ndarray) -> np.ndarray: ...  # [rows, NUM_FEATURES] -> [rows]


@dataclass(frozen=True)
class AnalyticStepTime:
    """``ms = c_fixed + c_bs*B' + c_compute*batched_tokens + c_kv*kv_tokens + c_spec*[spec]
    + c_draft_pass*steps + c_draft_token*draft_tokens``.

    ``B'`` is the padded batch size (CUDA-graph replay runs the padded batch; without graphs it is
    the batch size), ``batched_tokens`` the padded verified tokens (what the target computes),
    ``draft_tokens`` ``B' * steps * topk`` (what the draft passes compute), ``kv_tokens`` the sum
    of context lengths (what attention reads). The defaults are the scale of an 8B target with a
    one-layer draft on an H100-class GPU: a 4 ms floor, 0.02 ms per computed token, 0.4 ms per
    draft pass. Fitting replaces them with measurements.
    """

    c_fixed: float = 4.0
    c_bs: float = 0.01
    c_compute: float = 0.02
    c_kv: float = 2.0e-5
    c_spec: float = 0.3
    c_draft_pass: float = 0.4
    c_draft_token: float = 0.002

    @staticmethod
    def design_matrix(x: np.ndarray) -> np.ndarray:
        """``[rows, 7]`` regressors, in the order of the coefficients."""
        assert x.ndim == 2 and x.shape[1] == NUM_FEATURES, f"bad feature matrix {x.shape}"
        c = COLUMN
        padded = x[:, c["padded_batch_size"]]
        return np.stack(
            [
                np.ones(x.shape[0]),
                padded,
                x[:, c["padded_verified_tokens"]],
                x[:, c["sum_context_len"]],
                x[:, c["speculative"]],
                x[:, c["steps"]],
                padded * x[:, c["steps"]] * x[:, c["topk"]],
            ],
            axis=1,
        )

    def predict_matrix(self, x: np.ndarray) -> np.ndarray:
        """``[rows]`` step times in ms for feature rows ``x`` ``[rows, NUM_FEATURES]``."""
        assert x.ndim == 2 and x.shape[1] == NUM_FEATURES, f"bad feature matrix {x.shape}"
        c = COLUMN
        fixed, per_request = self._shape_terms(
            x[:, c["speculative"]], x[:, c["steps"]], x[:, c["topk"]], x[:, c["num_draft_tokens"]]
        )
        return (
            fixed
            + x[:, c["padded_batch_size"]] * per_request
            + self.c_kv * x[:, c["sum_context_len"]]
        )

    def predict_list(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> list[float]:
        """``[len(shapes)]`` step times in ms of one batch, equal to ``predict_matrix`` of its
        feature rows, without building them. The policy prices every candidate each step, and
        in a CPU server each array operation runs in caches the forward has just swept (tens
        of microseconds each), while the interpreter's own loop runs warm: this takes none."""
        # The last shape tuple priced, which a decision asks for every step, with its terms;
        # one read and one write, so a thread pricing another tuple meanwhile cannot mix them.
        last = getattr(self, "_last_terms", None)
        if last is None or last[0] is not shapes:
            cols = shape_columns(shapes)  # [shapes, 3]
            terms = self._shape_terms(cols[:, 0] > 0, cols[:, 0], cols[:, 1], cols[:, 2])
            last = (shapes, terms[0].tolist(), terms[1].tolist())
            # Beside the fields, not one of them: equality, hashing and ``to_dict`` ignore it.
            object.__setattr__(self, "_last_terms", last)
        _, fixed, per_request = last
        padded = features.padded_batch_size
        kv = self.c_kv * features.sum_context_len
        return [f + padded * p + kv for f, p in zip(fixed, per_request, strict=True)]

    def _shape_terms(
        self,
        speculative: np.ndarray,  # [rows] 1 where the shape drafts, else 0
        steps: np.ndarray,  # [rows]
        topk: np.ndarray,  # [rows]
        num_draft_tokens: np.ndarray,  # [rows]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The price's two shape terms, ``[rows]`` each: what a step costs whatever its batch,
        and per padded request; the price is ``fixed + B' * per_request + c_kv * kv_tokens``,
        ``design_matrix`` weighted by the coefficients, in the order both predictions use."""
        fixed = self.c_fixed + self.c_spec * speculative + self.c_draft_pass * steps
        per_request = (
            self.c_bs + self.c_compute * num_draft_tokens + self.c_draft_token * (steps * topk)
        )
        return fixed, per_request

    @classmethod
    def fit(cls, x: np.ndarray, measured_ms: np.ndarray) -> AnalyticStepTime:
        """Least squares on relative error with non-negative coefficients.

        Rows are scaled by ``1 / measured_ms`` so a 1 ms miss on a 5 ms step weighs as much
        as 10 ms on a 50 ms step: the policy compares ratios, not differences.
        """
        y = np.asarray(measured_ms, dtype=np.float64)  # [rows]
        assert y.ndim == 1 and y.shape[0] == x.shape[0] and np.all(y > 0), "bad step times"
        a = cls.design_matrix(x) / y[:, None]  # [rows, 7]
        scale = np.maximum(np.abs(a).max(axis=0), 1e-12)  # column scaling for conditioning
        coef, _ = nnls(a / scale, np.ones_like(y))
        return cls(*(float(v) for v in coef / scale))

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class PriceSplit:
    """How a machine prices steps against the step-time model, as the residual filter
    estimates it (``ResidualCorrection``), in log units: ``drift``, common to every shape (the
    machine's speed); ``tilt``, how much dearer (above 0) or cheaper each unit of a shape's
    lever is; ``offset``, how much dearer or cheaper every speculative shape is against no
    speculation. What makes a server decline speculation that the model, or a profile of another
    hour, would run: here no speculation takes ``exp(drift)`` times the model's time, and a
    shape the model prices at ``r`` times no speculation's is ``exp(offset + ln(r) * tilt)``
    times dearer against no speculation than the model says."""

    drift: float
    tilt: float
    offset: float


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error as a fraction (0.05 = 5%)."""
    measured = np.asarray(measured, dtype=np.float64)
    return float(np.mean(np.abs(np.asarray(predicted) - measured) / measured))


class ResidualCorrection:
    """A Kalman filter over ``log(measured / predicted)``: the drift common to every shape, the
    split (the tilt and the offset) and one part per shape; see the module docstring.

    Its state is a few dozen numbers, kept in plain Python lists. In a CPU server the filter
    runs between two forwards, which sweep the caches. The interpreter's own loop stays warm
    there, since it runs between every two of the forward's operations, but NumPy's machinery
    does not. An update over lists takes less time there than the same update over arrays,
    though more when warm."""

    def __init__(self, decay: float, profile_error: float | None = None) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"residual decay must be in (0, 1], got {decay}")
        if profile_error is not None and not 0.0 < profile_error < 1.0:
            raise ValueError(f"a profile's error must be in (0, 1), got {profile_error}")
        self.decay = decay
        # None: the step-time model's view of a shape is worth ``PRIOR_STEPS`` of its steps.
        # Otherwise the model is a measured profile this far off a step's time (a fraction).
        self.profile_error = profile_error
        # The step's noise, the variance of log(measured / predicted) of one step; until the
        # first well-known steps, what makes a profile worth ``PRIOR_STEPS`` of a shape's steps.
        self.noise_var = PRIOR_STEPS * (profile_error or PROFILE_ERROR) ** 2
        self._noise_steps = 0
        gain = min(MAX_DRIFT_GAIN, DRIFT_GAIN_RATIO * decay)
        # The walk whose steady gain, for one shape running, is ``gain``.
        self.drift_walk = gain * gain / (1.0 - gain)
        # [3 + shapes] the drift, the tilt, the offset, then each shape's part
        self._x = [0.0] * _COMMON
        # [3 + shapes][3 + shapes] in noise units, a list of rows
        self._cov = [
            [DRIFT_PRIOR, 0.0, 0.0],
            [0.0, SPLIT_PRIOR, 0.0],
            [0.0, 0.0, SPLIT_PRIOR],
        ]
        self._position: dict[TreeShape, int] = {}  # a shape's index in ``_x``
        self._measured: dict[TreeShape, int] = {}
        # The factors of the last shape tuple and levers asked for, kept until an update: the
        # policy asks for the same candidate tuple every step.
        self._cached_shapes: Sequence[TreeShape] | None = None
        self._levers_given: Sequence[float] | None = None  # None: the kept factors are stale
        self._cached_spec: list[float] = []  # [shapes] 1.0 for a speculative shape
        self._cached_at: list[int] = []  # [shapes] positions
        self._cached_factors: list[float] = []  # [shapes] the corrections
        self._split: PriceSplit | None = None  # the last ``split``, until an update
        # The last ``relative_sd`` asked for (shapes, levers, reference) and its answer, until
        # an update.
        self._sd_key: tuple[object, object, TreeShape | None] | None = None
        self._sd: list[float] = []

    def _at(self, shape: TreeShape) -> int:
        i = self._position.get(shape)
        if i is None:
            n = len(self._x)
            self._x.append(0.0)
            for row in self._cov:
                row.append(0.0)
            self._cov.append([0.0] * n + [1.0 / PRIOR_STEPS])
            i = self._position[shape] = n
        return i

    def update(
        self, shape: TreeShape, measured_ms: float, predicted_ms: float, lever: float = 0.0
    ) -> None:
        """One measured step of ``shape``; ``lever``: the log of its predicted time over no
        speculation's for the same batch (0: the tilt is not measured)."""
        ratio = math.log(max(measured_ms, MIN_STEP_MS) / max(predicted_ms, MIN_STEP_MS))
        i = self._at(shape)
        x, cov = self._x, self._cov
        n = len(x)
        error = self.profile_error
        if error is not None and shape not in self._measured:
            # The profile's view of the shape, worth as many of its steps as the noise is
            # larger than the profile's error. Its covariances are still 0: a shape's part
            # moves only once the shape is measured.
            cov[i][i] = self._profile_var(error)
        # Time passes: the drift, the split and every part walk.
        cov[0][0] += self.drift_walk
        for k in range(1, n):
            cov[k][k] += PART_WALK
        # The step measures drift + lever * tilt + [speculative] * offset + part i, and its own
        # noise (variance 1).
        spec = 1.0 if shape.speculative else 0.0
        drift, tilt, offset, part = cov[0], cov[1], cov[2], cov[i]
        # [n] covariance of every state with that sum
        row = [
            d + lever * t + spec * o + p
            for d, t, o, p in zip(drift, tilt, offset, part, strict=True)
        ]
        predicted_var = row[0] + lever * row[1] + spec * row[2] + row[i] + 1.0  # noise units
        surprise = ratio - (x[0] + lever * x[1] + spec * x[2]) - x[i]
        if predicted_var < NOISE_WELL_KNOWN:
            # The surprise's variance is the noise's times ``predicted_var``.
            self._noise_steps += 1
            weight = max(NOISE_MIN_WEIGHT, 1.0 / self._noise_steps)
            self.noise_var += weight * (surprise * surprise / predicted_var - self.noise_var)
            if self._noise_steps == NOISE_SETTLED and error is not None:
                self._settle_profile_parts(error)
        # A state uncorrelated with the sum (a shape never measured, the tilt while only no
        # speculation runs) has a gain of 0 and leaves every covariance as it was: only the
        # others are updated, which in a server that runs few of its candidates is a few of
        # the matrix's rows and columns.
        live = [k for k in range(n) if row[k] != 0.0]
        for k in live:
            gain = row[k] / predicted_var
            x[k] += gain * surprise
            cov_k = cov[k]
            for m in live:
                cov_k[m] -= gain * row[m]
        self._measured[shape] = self._measured.get(shape, 0) + 1
        self._levers_given = None  # the kept factors are stale: ``factors`` recomputes them
        self._split = None
        self._sd_key = None

    def _profile_var(self, error: float) -> float:
        """A profile-priced part's variance, in noise units, before its shape is measured."""
        worth = self.noise_var / (error * error)
        return 1.0 / min(max(worth, PROFILE_WORTH_RANGE[0]), PROFILE_WORTH_RANGE[1])

    def _settle_profile_parts(self, error: float) -> None:
        """Every part wider than the profile's worth now is shrunk to it: those of the shapes
        measured before the noise was known took the worth of an unknown noise. Each keeps its
        correlations with the other states (a congruence, so the covariance stays positive)."""
        cov, target = self._cov, self._profile_var(error)
        for i in self._position.values():
            if cov[i][i] > target:
                f = math.sqrt(target / cov[i][i])
                cov[i] = [c * f for c in cov[i]]
                for row in cov:
                    row[i] *= f

    @property
    def step_noise(self) -> float | None:
        """The estimated noise of one step's time (the standard deviation of its log, about
        the fraction a step strays by), or None before ``NOISE_SETTLED`` well-known steps."""
        if self._noise_steps < NOISE_SETTLED:
            return None
        return math.sqrt(self.noise_var)

    def split(self) -> PriceSplit:
        """The drift, the tilt and the offset as they stand (one object until an update)."""
        split = self._split
        if split is None:
            split = self._split = PriceSplit(self._x[0], self._x[1], self._x[2])
        return split

    def factor(self, shape: TreeShape, lever: float = 0.0) -> float:
        i = self._position.get(shape)
        x = self._x
        spec = x[2] if shape.speculative else 0.0
        return math.exp(x[0] + lever * x[1] + spec + (x[i] if i is not None else 0.0))

    def factors(self, shapes: Sequence[TreeShape], levers: Sequence[float]) -> list[float]:
        """``[len(shapes)]`` multiplicative corrections; ``levers`` ``[len(shapes)]`` as in
        ``update``. Pass the same objects while nothing changed: the result is kept for them."""
        if shapes is not self._cached_shapes or levers is not self._levers_given:
            if shapes is not self._cached_shapes:
                self._cached_at = [self._at(s) for s in shapes]
                self._cached_spec = [1.0 if s.speculative else 0.0 for s in shapes]
            self._cached_shapes = shapes
            self._levers_given = levers
            x = self._x
            drift, tilt, offset = x[0], x[1], x[2]
            self._cached_factors = [
                math.exp(drift + lever * tilt + spec * offset + x[at])
                for lever, spec, at in zip(levers, self._cached_spec, self._cached_at, strict=True)
            ]
        return self._cached_factors

    def relative_sd(
        self,
        shapes: Sequence[TreeShape],
        levers: Sequence[float],
        reference: TreeShape | None = None,
    ) -> list[float]:
        """``[len(shapes)]`` how far each shape's price may be off against ``reference``'s (one
        of ``shapes``): the standard deviation of its correction less the reference's, in log
        units (about the fraction by which its price relative to the reference's may be off).
        The drift is common to both and drops out; what is left is the split's share (where the
        two shapes' levers differ) and the two shapes' parts. The reference itself reads 0, a
        shape measured beside it lately little, one that has not run for a while more, by its
        part's walk. ``reference`` None: against the machine's speed alone. ``levers`` as in
        ``update``; pass the same objects while nothing changed: the result is kept for them."""
        key = (shapes, levers, reference)
        old = self._sd_key
        if old is not None and old[0] is shapes and old[1] is levers and old[2] == reference:
            return self._sd
        at = [self._at(s) for s in shapes]  # a shape never seen joins the state first
        spec = [1.0 if s.speculative else 0.0 for s in shapes]
        ref_lever = ref_spec = 0.0
        ref_at = -1
        if reference is not None:
            r = list(shapes).index(reference)
            ref_lever, ref_spec, ref_at = levers[r], spec[r], at[r]
        cov, noise = self._cov, math.sqrt(self.noise_var)
        out = []
        for lever, sp, i in zip(levers, spec, at, strict=True):
            # The difference's coefficients on the tilt (state 1), the offset (2) and the parts.
            terms = {1: lever - ref_lever, 2: sp - ref_spec}
            terms[i] = terms.get(i, 0.0) + 1.0
            if ref_at >= 0:
                terms[ref_at] = terms.get(ref_at, 0.0) - 1.0
            live = [(k, c) for k, c in terms.items() if c]
            var = sum(ca * cb * cov[a][b] for a, ca in live for b, cb in live)
            out.append(noise * math.sqrt(max(var, 0.0)))
        self._sd_key, self._sd = key, out
        return out

    def measured(self, shape: TreeShape) -> int:
        """Steps of ``shape`` whose time was measured."""
        return self._measured.get(shape, 0)


class OnlineCostModel:
    """The ``CostModel`` the policy uses: step-time model, optional table, residual correction.

    With a ``table``, predictions for the table's own shape tuple and batches inside its grid
    are table lookups (microseconds); anything else is predicted directly by ``step_time``.
    ``profile_error``: ``step_time`` is a measured profile of the deployment, this far off a
    step's time (``ResidualCorrection``); ``starting_cost_model`` sets it for a profile.
    """

    def __init__(
        self,
        step_time: StepTimeModel,
        residual_decay: float,
        table: CostTable | None = None,
        batch_floor: StepFeatures | None = None,
        profile_error: float | None = None,
    ) -> None:
        self.step_time = step_time
        self.table = table
        self.residual = ResidualCorrection(residual_decay, profile_error)
        # The smallest batch the step-time model was fitted on (its batch and padded batch
        # sizes): a smaller batch is priced as that one (``at_floor``).
        self.batch_floor = batch_floor
        # The last batch priced for a shape tuple, with its row: a step is priced for every
        # candidate when it is decided and for its own shape when it is observed.
        self._last: tuple[StepFeatures, Sequence[TreeShape], list[float]] | None = None
        self._last_index: dict[TreeShape, int] = {}
        # ``[len(shapes)]`` the levers of the last row (``ResidualCorrection.update``).
        self._last_levers: list[float] = []
        # A step-time model that prices one batch's shapes directly (``predict_list``, as
        # ``step_profile.ProfileStepTime`` and ``AnalyticStepTime`` do) is asked so, without
        # feature rows.
        self._predict_list = getattr(step_time, "predict_list", None)

    def at_floor(self, features: StepFeatures) -> StepFeatures:
        """``features``, or a batch of the floor's size with the same mean and longest context
        when ``features`` is smaller than the smallest batch the model was fitted on.

        A fit on steps of one batch size cannot tell a step's fixed cost from its cost per
        request (the two regressors are proportional there), and the least-squares fit may put
        it all on the requests: it then prices a one-request step at a fraction of its cost,
        and as a closed loop's batch drains the policy runs plain decoding and short chains
        far from the best shape. Below the batches it has seen the model does not extrapolate:
        a GPU's step costs about the same there (the weights are read whatever the batch), and
        on a CPU the next refit, which sees the smaller batches, lowers the floor."""
        floor = self.batch_floor
        if floor is None or features.batch_size >= floor.batch_size:
            return features
        scale = floor.batch_size / features.batch_size
        return StepFeatures(
            floor.batch_size,
            floor.padded_batch_size,
            round(features.sum_context_len * scale),
            features.max_context_len,
        )

    def raw_ms_many(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> np.ndarray:
        """``[len(shapes)]`` uncorrected predictions."""
        return np.array(self._raw_list(features, shapes))

    def _raw_list(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> list[float]:
        """``raw_ms_many`` as a list, kept with its levers for the step's observation: read
        it, do not write to it."""
        features = self.at_floor(features)
        last = self._last
        if last is not None and last[1] is shapes and last[0] == features:
            return last[2]
        row = self._raw_row(features, shapes)
        if last is None or last[1] is not shapes:
            self._last_index = {s: i for i, s in enumerate(shapes)}
        plain = self._last_index.get(NO_SPEC)
        plain_ms = row[plain] if plain is not None else self._raw_row(features, (NO_SPEC,))[0]
        self._last_levers = [math.log(ms / plain_ms) for ms in row]
        self._last = (features, shapes, row)
        return row

    def lever(self, features: StepFeatures, shape: TreeShape) -> float:
        """The log of ``shape``'s uncorrected time over no speculation's for this batch: how
        much of the step the tilt acts on (``ResidualCorrection``)."""
        return self._raw_and_lever(features, shape)[1]

    def _raw_and_lever(self, features: StepFeatures, shape: TreeShape) -> tuple[float, float]:
        """``shape``'s uncorrected time for this batch, and its lever."""
        last = self._last
        if last is not None and (last[0] is features or last[0] == self.at_floor(features)):
            # The step's own shape, observed after it was priced with its candidates.
            i = self._last_index.get(shape)
            if i is not None and NO_SPEC in self._last_index:
                return last[2][i], self._last_levers[i]
        raw = self._raw_one(features, shape)
        return raw, math.log(raw / self._raw_one(features, NO_SPEC))

    def _raw_row(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> list[float]:
        """``[len(shapes)]`` uncorrected predictions, as a list: the policy prices its
        candidates so every step, in caches a CPU server's forward has just swept, where the
        interpreter's loop runs warmer than an array operation (``ResidualCorrection``)."""
        table = self.table
        if table is not None and (shapes is table.shapes or shapes == table.shapes):
            row = table.lookup(features)
            if row is not None:
                return row.tolist()
        if self._predict_list is not None:
            return [max(ms, MIN_STEP_MS) for ms in self._predict_list(features, shapes)]
        x = feature_matrix(features, shapes)
        return np.maximum(self.step_time.predict_matrix(x), MIN_STEP_MS).tolist()

    def predict_ms_many(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> np.ndarray:
        """``[len(shapes)]`` corrected step times in ms."""
        return np.array(self.predict_ms_list(features, shapes))

    def predict_ms_list(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> list[float]:
        """``predict_ms_many`` as a list, as the policy asks every step."""
        row = self._raw_list(features, shapes)
        factors = self.residual.factors(shapes, self._last_levers)
        return [ms * f for ms, f in zip(row, factors, strict=True)]

    def relative_sd(
        self,
        features: StepFeatures,
        shapes: Sequence[TreeShape],
        reference: TreeShape | None = None,
    ) -> list[float]:
        """``[len(shapes)]`` how far each shape's corrected price for this batch may be off
        against ``reference``'s, in log units (``ResidualCorrection.relative_sd``)."""
        self._raw_list(features, shapes)
        return self.residual.relative_sd(shapes, self._last_levers, reference)

    def predict_ms(self, features: StepFeatures, shape: TreeShape) -> float:
        raw, lever = self._raw_and_lever(features, shape)
        return raw * self.residual.factor(shape, lever)

    def observe(self, features: StepFeatures, shape: TreeShape, measured_ms: float) -> None:
        """Pull the prediction for ``shape`` towards ``measured_ms``."""
        self.residual.update(shape, measured_ms, *self._raw_and_lever(features, shape))

    def split(self) -> PriceSplit:
        """How this machine prices steps against the step-time model, as the residual
        correction stands (``PriceSplit``)."""
        return self.residual.split()

    def replay(
        self,
        x: np.ndarray,  # [rows, NUM_FEATURES], from ``features.feature_rows``
        shapes: Sequence[TreeShape],
        measured_ms: np.ndarray,  # [rows]
    ) -> None:
        """Observe measured steps, oldest first, as if this model had served them.

        A model that replaces another (a refit, a trained policy version) then starts with the
        corrections the measurements imply instead of none: otherwise every shape the step-time
        model gets wrong is chosen again on the same error until it has run for a while, after
        every refit (``refit.MeasuredSteps`` refits as soon as every candidate was measured,
        then at doubling intervals up to every 128 measured steps).
        """
        if not (len(x) == len(shapes) == len(measured_ms)):
            raise ValueError("replay needs one shape and one time per feature row")
        if not len(x):
            return
        # One matrix prediction for all rows (a row at a time took 0.3 s for 4096 rows, in a
        # thread beside the scheduler's). Against the step-time model itself, not the table,
        # which interpolates the same model.
        raw = np.maximum(self.step_time.predict_matrix(x), MIN_STEP_MS)  # [rows]
        c = COLUMN
        plain = build_feature_matrix(  # [rows, NUM_FEATURES] the same batches unspeculated
            x[:, c["batch_size"]],
            x[:, c["padded_batch_size"]],
            x[:, c["sum_context_len"]],
            x[:, c["max_context_len"]],
            shape_columns((NO_SPEC,)),
        )
        levers = np.log(raw / np.maximum(self.step_time.predict_matrix(plain), MIN_STEP_MS))
        # In order, a row at a time: the drift links every shape's rows (4096 rows take
        # tens of ms).
        update = self.residual.update
        times = np.asarray(measured_ms, dtype=np.float64).tolist()
        for shape, ms, predicted, lever in zip(
            shapes, times, raw.tolist(), levers.tolist(), strict=True
        ):
            update(shape, ms, predicted, lever)

    def _raw_one(self, features: StepFeatures, shape: TreeShape) -> float:
        features = self.at_floor(features)
        last = self._last
        if last is not None and last[0] == features:
            i = self._last_index.get(shape)
            if i is not None:
                return float(last[2][i])
        table = self.table
        if table is not None:
            i = table.index.get(shape)
            if i is not None:
                row = table.lookup(features)
                if row is not None:
                    return float(row[i])
        return float(self._raw_row(features, (shape,))[0])


def starting_cost_model(residual_decay: float, profile: StepTimeModel | None) -> OnlineCostModel:
    """The cost model a step controller starts with, or hands back on a rollback: the
    deployment's measured profile (off by ``PROFILE_ERROR``) or, without one, the default
    analytic model until the first refit."""
    if profile is None:
        return OnlineCostModel(AnalyticStepTime(), residual_decay)
    return OnlineCostModel(profile, residual_decay, profile_error=PROFILE_ERROR)
