"""Two adaptive schemes others ship, re-implemented by sglang-adatree as alternative policies.

Both implement ``policy.Policy``'s interface (``decide``, ``observe``, ``set_pins``,
``set_cost_model``, ``pins``, ``policy_version``; constructed as ``(config, cost_model,
acceptance)``), so ``controller.make_policy`` runs them in adatree's own serving loop with the same
draft, verifier, telemetry and pins; only the decision rule differs. Both choose among the
*chains* of the candidate set (``topk = 1``) and no speculation, as the originals do.

* ``TurboSpecPolicy`` (TurboSpec, arXiv 2406.14066): chain length ``k`` in ``0..K`` maximising
  goodput ``B * E(k) / T(k)`` with ``E(k) = (1 - a**(k + 1)) / (1 - a)``, one global acceptance
  rate ``a`` tracked as ``a <- 0.85 a + 0.15 accepted / drafted`` (initially 0.7), ``T(k)`` from
  the step-time model it is given (the analytic model adatree starts from, refitted online by
  the step controller: TurboSpec's own closed loop). No speculation must be beaten by 10%. One
  ``k`` for the whole batch, refreshed every 20 steps.
* ``SGLangAdaptivePolicy`` (SGLang's ``--speculative-adaptive``, ``adaptive_spec_params.py``):
  per batch-size slot an EMA (weight 0.2) of accepted draft tokens per request; after 10
  warm-up batches, every 5 batches the slot steps its chain length down while the EMA is at or
  below ``prev - 0.5 + down_hysteresis`` and otherwise up while it is above
  ``current - 0.5 + up_hysteresis``. Slots and tiers are SGLang's defaults; tier step counts map
  to the nearest chain in the candidate set.

Decision sources: ``pin`` for an operator pin, ``warmup`` for SGLang's warm-up batches,
otherwise ``fallback`` (no trained policy version) or ``model`` (one is active; only TurboSpec
reads the cost model to decide).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.acceptance import AcceptanceEstimator, AcceptedPathStats
from sglang_adatree.core.confidence import FirstLayer
from sglang_adatree.core.cost_model import CostModel
from sglang_adatree.core.features import StepFeatures
from sglang_adatree.core.policy import Decision, DecisionSource, Pin, price_split
from sglang_adatree.core.shapes import NO_SPEC, TreeShape

LABEL = "re-implemented by sglang-adatree"

TURBOSPEC_INITIAL_ACCEPT_RATE = 0.7
TURBOSPEC_EMA_KEEP = 0.85  # a <- 0.85 a + 0.15 (accepted / drafted)
TURBOSPEC_NO_SPEC_MARGIN = 0.10
TURBOSPEC_REFRESH_STEPS = 20

# SGLang 0.5.23 DEFAULT_ADAPTIVE_CONFIG: batch-size slot -> candidate steps and hysteresis.
SGLANG_ADAPTIVE_TIERS: dict[int, tuple[int, ...]] = {
    1: (1, 3, 5, 7),
    8: (0, 1, 3),
    32: (0, 1),
    64: (0,),
}
SGLANG_DOWN_HYSTERESIS: dict[int, float] = {1: -0.25, 8: 0.0, 32: 0.0, 64: 0.0}
SGLANG_UP_HYSTERESIS = 0.0
SGLANG_EMA_ALPHA = 0.2
SGLANG_WARMUP_BATCHES = 10
SGLANG_UPDATE_INTERVAL = 5
# The server's --speculative-num-steps that SGLang's slots start from (STANDALONE's default
# shape is 3,1,4); a slot whose tier lacks it starts at the tier's middle candidate.
SGLANG_INITIAL_STEPS = 3


def chain_shapes(candidates: Sequence[TreeShape]) -> dict[int, TreeShape]:
    """Chain length -> shape for the chains (and no speculation) in a candidate set."""
    out = {s.steps: s for s in candidates if s.is_chain}
    if not out:
        raise ValueError(
            "this baseline runs chains (topk 1) only, and the candidate set has none: "
            + ", ".join(str(s) for s in candidates)
        )
    if NO_SPEC in candidates:
        out[0] = NO_SPEC
    return dict(sorted(out.items()))


def nearest_steps(wanted: int, available: Sequence[int]) -> int:
    """The available chain length closest to ``wanted``; ties go to the shorter (cheaper)."""
    return min(available, key=lambda s: (abs(s - wanted), s))


def accepted_per_request(stats: AcceptedPathStats) -> np.ndarray:
    """``[batch]`` accepted draft tokens per request of one verify step."""
    ranks = np.asarray(stats.accepted_rank)  # [batch, steps]
    assert ranks.ndim == 2, f"accepted_rank must be [batch, steps], got {ranks.shape}"
    return (ranks >= 0).sum(axis=1)


class _ChainBaseline:
    """What both baselines share: chain candidates, pins, the cost model and its version."""

    # Neither system reads the draft's confidence (``core.confidence``).
    reads_confidence = False

    def __init__(
        self,
        config: AdaTreeConfig,
        cost_model: CostModel,
        acceptance: AcceptanceEstimator,
        policy_version: int | None = None,
    ) -> None:
        self.config = config
        self.candidates: tuple[TreeShape, ...] = tuple(config.candidate_shapes)
        self.chains = chain_shapes(self.candidates)
        self.cost_model = cost_model
        # Kept for interface parity; these baselines track acceptance their own way.
        self.acceptance = acceptance
        self.policy_version = policy_version
        self.pins: tuple[Pin, ...] = ()
        self.step = 0

    def set_pins(self, pins: Sequence[Pin]) -> None:
        """Replace the pins, in precedence order; each pinned shape must be a candidate."""
        for pin in pins:
            if pin.shape not in self.candidates:
                raise ValueError(f"pinned shape {pin.shape} is not a candidate shape")
        self.pins = tuple(pins)

    def set_cost_model(self, cost_model: CostModel, policy_version: int | None) -> None:
        """Swap in a newly activated (or refitted) step-time model."""
        self.cost_model = cost_model
        self.policy_version = policy_version

    def _pinned(self, features: StepFeatures) -> TreeShape | None:
        for pin in self.pins:
            if pin.covers(features.batch_size):
                return pin.shape
        return None

    def _rule_source(self) -> DecisionSource:
        return DecisionSource.FALLBACK if self.policy_version is None else DecisionSource.MODEL


class TurboSpecPolicy(_ChainBaseline):
    """TurboSpec's chain-length rule; see the module docstring."""

    def __init__(
        self,
        config: AdaTreeConfig,
        cost_model: CostModel,
        acceptance: AcceptanceEstimator,
        policy_version: int | None = None,
    ) -> None:
        super().__init__(config, cost_model, acceptance, policy_version)
        self.accept_rate = TURBOSPEC_INITIAL_ACCEPT_RATE
        self.lengths: tuple[int, ...] = tuple(self.chains)  # k values, ascending
        self.shapes: tuple[TreeShape, ...] = tuple(self.chains.values())
        self.current: TreeShape | None = None

    def expected_emitted(self, k: int) -> float:
        """``E(k) = (1 - a**(k + 1)) / (1 - a)``: emitted tokens per request for chain ``k``."""
        a = self.accept_rate
        if a >= 1.0:
            return float(k + 1)
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def choose(self, features: StepFeatures) -> tuple[TreeShape, float, float]:
        """(shape, predicted step ms, expected emitted) maximising goodput over ``k``; the best
        chain must beat no speculation (when it is a candidate) by 10%."""
        times = self.cost_model.predict_ms_many(features, self.shapes)  # [chains] ms
        emitted = np.array([self.expected_emitted(k) for k in self.lengths])  # [chains]
        goodput = features.batch_size * emitted / times  # [chains] tokens per ms
        spec = [i for i, k in enumerate(self.lengths) if k > 0]
        best = max(spec, key=lambda i: goodput[i])
        if self.lengths[0] == 0 and goodput[best] < goodput[0] * (1.0 + TURBOSPEC_NO_SPEC_MARGIN):
            best = 0
        return self.shapes[best], float(times[best]), float(emitted[best])

    def decide(
        self,
        features: StepFeatures,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> Decision:
        """Pin, else the chain chosen at the last refresh (every 20 steps). TurboSpec keeps one
        acceptance rate for every request and step: the draft's confidence is not read."""
        step = self.step
        self.step += 1
        pinned = self._pinned(features)
        if pinned is not None:
            return self._decision(features, pinned, DecisionSource.PIN)
        if self.current is None or step % TURBOSPEC_REFRESH_STEPS == 0:
            shape, ms, emitted = self.choose(features)
            self.current = shape
            split = price_split(self.cost_model)
            return Decision(shape, self._rule_source(), ms, emitted, split=split)
        return self._decision(features, self.current, self._rule_source())

    def observe(
        self,
        features: StepFeatures,
        shape: TreeShape,
        measured_ms: float,
        stats: AcceptedPathStats | None = None,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> None:
        """Step time to the cost model; accepted / drafted into the global EMA (one rate for
        every request, as TurboSpec keeps)."""
        self.cost_model.observe(features, shape, measured_ms)
        if stats is None or not shape.speculative:
            return
        accepted = float(accepted_per_request(stats).sum())
        drafted = features.batch_size * (shape.num_draft_tokens - 1)
        if drafted > 0:
            keep = TURBOSPEC_EMA_KEEP
            self.accept_rate = keep * self.accept_rate + (1.0 - keep) * accepted / drafted

    def _decision(
        self, features: StepFeatures, shape: TreeShape, source: DecisionSource
    ) -> Decision:
        emitted = self.expected_emitted(shape.steps) if shape.is_chain else 1.0
        if shape.speculative and not shape.is_chain:
            emitted = float(shape.max_emitted)  # a pinned tree: TurboSpec has no tree model
        ms = self.cost_model.predict_ms(features, shape)
        return Decision(shape, source, ms, emitted, split=price_split(self.cost_model))


@dataclass
class AdaptiveSlot:
    """One batch-size slot of SGLang's rule: candidates, EMA, batch count, current steps."""

    candidate_steps: tuple[int, ...]  # ascending, mapped to chains of the candidate set
    down_hysteresis: float
    current_steps: int
    ema_accept_len: float  # accepted draft tokens per request (bonus excluded)
    batch_count: int = 0

    def update(self, accepted: np.ndarray | None) -> None:
        """One verified batch (``accepted``: ``[batch]`` per request, None if it did not
        speculate); every ``SGLANG_UPDATE_INTERVAL`` batches after warm-up, re-choose."""
        if accepted is not None and accepted.size > 0:
            self.ema_accept_len = (
                1.0 - SGLANG_EMA_ALPHA
            ) * self.ema_accept_len + SGLANG_EMA_ALPHA * float(accepted.mean())
        self.batch_count += 1
        past_warmup = self.batch_count - SGLANG_WARMUP_BATCHES
        if past_warmup > 0 and past_warmup % SGLANG_UPDATE_INTERVAL == 0:
            self.current_steps = self.recompute()

    def recompute(self) -> int:
        """SGLang's ``_recompute_params``: probe up from 0, else step down or up by the EMA."""
        steps = self.candidate_steps
        i = steps.index(self.current_steps)
        if self.current_steps == 0:
            i = min(i + 1, len(steps) - 1)
            if steps[i] > 0 and self.ema_accept_len < 0:
                self.ema_accept_len = float(steps[i] - 1)
            return steps[i]
        start = i
        while i > 0:
            prev = steps[i - 1]
            threshold = (0.5 if prev == 0 else prev - 0.5) + self.down_hysteresis
            if self.ema_accept_len <= threshold:
                i -= 1
            else:
                break
        if i == start:
            while i < len(steps) - 1 and self.ema_accept_len > (
                steps[i] - 0.5 + SGLANG_UP_HYSTERESIS
            ):
                i += 1
        return steps[i]


class SGLangAdaptivePolicy(_ChainBaseline):
    """SGLang's ``--speculative-adaptive`` rule over chains; see the module docstring."""

    def __init__(
        self,
        config: AdaTreeConfig,
        cost_model: CostModel,
        acceptance: AcceptanceEstimator,
        policy_version: int | None = None,
        tiers: dict[int, tuple[int, ...]] | None = None,
    ) -> None:
        super().__init__(config, cost_model, acceptance, policy_version)
        available = tuple(self.chains)
        self.slot_sizes: tuple[int, ...] = tuple(sorted((tiers or SGLANG_ADAPTIVE_TIERS).keys()))
        self.slots: dict[int, AdaptiveSlot] = {}
        for bs in self.slot_sizes:
            wanted = (tiers or SGLANG_ADAPTIVE_TIERS)[bs]
            steps = tuple(sorted({nearest_steps(s, available) for s in wanted}))
            initial = nearest_steps(SGLANG_INITIAL_STEPS, available)
            if initial not in steps:
                initial = steps[len(steps) // 2]
            self.slots[bs] = AdaptiveSlot(
                candidate_steps=steps,
                down_hysteresis=SGLANG_DOWN_HYSTERESIS.get(bs, 0.0),
                current_steps=initial,
                # SGLang's neutral start: one fewer accepted token than the chain offers.
                ema_accept_len=float(initial - 1),
            )

    def slot_for(self, batch_size: int) -> AdaptiveSlot:
        """The slot of the largest tier size not above ``batch_size`` (the first if none)."""
        i = bisect.bisect_right(self.slot_sizes, batch_size) - 1
        return self.slots[self.slot_sizes[max(0, i)]]

    def decide(
        self,
        features: StepFeatures,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> Decision:
        """Pin, else the chain the batch size's slot currently runs (SGLang's adaptive mode
        does not read the draft's confidence)."""
        self.step += 1
        pinned = self._pinned(features)
        if pinned is not None:
            return self._decision(features, pinned, DecisionSource.PIN, None)
        slot = self.slot_for(features.batch_size)
        source = (
            DecisionSource.WARMUP
            if slot.batch_count < SGLANG_WARMUP_BATCHES
            else DecisionSource.FALLBACK
        )
        return self._decision(features, self.chains[slot.current_steps], source, slot)

    def observe(
        self,
        features: StepFeatures,
        shape: TreeShape,
        measured_ms: float,
        stats: AcceptedPathStats | None = None,
        request_ids: Sequence[str] = (),
        confidence: Sequence[FirstLayer | None] | None = None,
    ) -> None:
        """Accepted drafts per request into the batch size's slot; step time to the cost model
        (kept so that telemetry's predicted step times stay comparable across policies)."""
        self.cost_model.observe(features, shape, measured_ms)
        accepted = None
        if stats is not None and shape.speculative:
            accepted = accepted_per_request(stats)
        self.slot_for(features.batch_size).update(accepted)

    def _decision(
        self,
        features: StepFeatures,
        shape: TreeShape,
        source: DecisionSource,
        slot: AdaptiveSlot | None,
    ) -> Decision:
        emitted = 1.0
        if shape.speculative:
            expected = slot.ema_accept_len if slot is not None else float(shape.steps)
            emitted = 1.0 + min(max(expected, 0.0), float(shape.max_emitted - 1))
        ms = self.cost_model.predict_ms(features, shape)
        return Decision(shape, source, ms, emitted, split=price_split(self.cost_model))


BASELINE_POLICIES: dict[str, type[_ChainBaseline]] = {
    "turbospec": TurboSpecPolicy,
    "sglang-adaptive": SGLangAdaptivePolicy,
}
