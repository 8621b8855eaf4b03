"""How a step's acceptance follows the draft's own confidence in it.

Before a decode step is decided, the draft has already scored the first token it will propose
for each request: the draft's extend at the end of the step before (or the prefill's) leaves its
top-k probabilities for the next position (SGLang's ``topk_p``). The probability of its top-1
token, the **draft confidence**, is well calibrated on the bundled head
(``docs/notes/2026-12-02-draft-confidence.md``) and moves from step to step inside one answer,
where the per-request factor (``acceptance.RequestAcceptance``) follows only a request's
level. Where a speculative step costs well over a plain decode, declining the steps the draft
is unsure of and drafting deeper where it is sure is worth more than any one shape.

The engine hands over the whole relayed top-k, the **draft's first layer**: per request a
``FirstLayer``, its probabilities in descending order, the first of them the confidence. A chain
drafts only the top-1 token at the first depth, a tree also the tokens ranked after it, and
their chances fall with the top-1's: where the draft is unsure of its best guess, a tree's
second-ranked tokens carry it and a chain has nothing else; where it is sure, a chain's deep
tokens follow. With ``draft_first_layer`` the policy prices each request under each shape by
the tree the estimates keep (the positional model, ``core.acceptance``), each first-layer
branch weighed by the draft's own probability of its first token
(``AcceptanceEstimator.first_layer_weights``), so one number per step does not have to stand
for every shape. It is off by default: in the lab it gains where speculation costs well over a
plain decode, and served on a CPU where it costs little it ran behind the top-1 alone
(``docs/notes/2026-12-07-the-drafts-first-layer.md``).

``ConfidenceAcceptance`` keeps a factor on the expected accepted draft tokens for each bin of
the confidence (``BIN_EDGES``), learnt from the speculative steps whose confidence was known:
the ratio of the draft tokens its requests accepted to those expected of them (each one's
expectation under the shape before this factor, times its request's factor; the mean of each
step's ratio, or under the draft's first layer the ratio of the sums, as
``acceptance.RequestAcceptance``'s), each bin shrunk towards 1 by ``PRIOR_STEPS``
pseudo-steps and its older evidence kept ``KEEP`` per observation so that it
follows a change of workload. It takes up how far the draft's probabilities are off as a
whole, as where the draft is very unsure and its second choice fails as well. A request's
expectation for the step is ``1 + f_r * c(q_r) * (E_r(shape) - 1)``, ``E_r`` the shape's
estimate under the request's first layer (``E``, the shape's estimate, without
``draft_first_layer``); a request whose draft is behind (after a step without speculation) has
no first layer, ``E_r = E`` and ``c = 1``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# The draft's first-layer probabilities for one request: its top-k at the next token, in
# descending order; the first is its confidence.
FirstLayer = tuple[float, ...]

# Upper edges of the bins of the draft's top-1 probability: tenths.
BIN_EDGES: tuple[float, ...] = tuple(i / 10 for i in range(1, 10))
# Pseudo-steps at factor 1 in each bin: a bin's first few steps move it little.
PRIOR_STEPS = 8.0
# Each observation in a bin keeps its older evidence at this weight (about 500 steps' memory).
KEEP = 0.998


def confidence_of(first_layer: FirstLayer | None) -> float | None:
    """The draft's confidence: the top-1 of ``first_layer`` (None where unknown)."""
    return None if first_layer is None else first_layer[0]


class ConfidenceAcceptance:
    """Per-bin factors on expected accepted draft tokens; see the module docstring."""

    def __init__(
        self,
        edges: Sequence[float] = BIN_EDGES,
        prior_steps: float = PRIOR_STEPS,
        keep: float = KEEP,
        ratio_of_sums: bool = False,
    ) -> None:
        if list(edges) != sorted(edges) or prior_steps < 0 or not 0.0 < keep <= 1.0:
            raise ValueError(f"bad confidence settings: {edges=}, {prior_steps=}, {keep=}")
        self.edges = tuple(edges)
        self.prior_steps = prior_steps
        self.keep = keep
        self.ratio_of_sums = ratio_of_sums
        self._ratio_sum = [0.0] * (len(self.edges) + 1)  # [bins]
        self._accepted = [0.0] * (len(self.edges) + 1)  # [bins]
        self._expected = [0.0] * (len(self.edges) + 1)  # [bins]
        self._weight = [0.0] * (len(self.edges) + 1)  # [bins]

    def bin(self, confidence: float) -> int:
        return bisect.bisect_right(self.edges, confidence)

    def factor(self, confidence: float | None) -> float:
        """The factor for a request whose draft confidence is ``confidence`` (None: unknown)."""
        if confidence is None:
            return 1.0
        return self._factor(self.bin(confidence))

    def _factor(self, b: int) -> float:
        """Bin ``b``'s ratio of accepted to expected draft tokens (the mean of its steps', or
        with ``ratio_of_sums`` the ratio of their sums), shrunk towards 1 by ``prior_steps``
        pseudo-steps against its (decayed) verify steps."""
        w = self._weight[b]
        if not self.ratio_of_sums:
            return (self._ratio_sum[b] + self.prior_steps) / (w + self.prior_steps)
        ratio = self._accepted[b] / self._expected[b] if self._expected[b] > 0.0 else 1.0
        return (w * ratio + self.prior_steps) / (w + self.prior_steps)

    def factors(self, confidences: Sequence[float | None]) -> list[float]:
        """``[batch]`` factors."""
        return [self.factor(q) for q in confidences]

    def observe(
        self,
        confidences: Sequence[float | None],
        accepted: Sequence[int],
        expected: Sequence[float],
    ) -> None:
        """One verify step: ``accepted`` ``[batch]`` draft tokens each request accepted, where
        ``expected`` ``[batch]`` were expected of it before its confidence is counted. Requests
        whose confidence is unknown teach nothing."""
        for q, a, e in zip(confidences, accepted, expected, strict=True):
            if q is None or e <= 0.0:
                continue
            b = self.bin(q)
            self._ratio_sum[b] = self.keep * self._ratio_sum[b] + a / e
            self._accepted[b] = self.keep * self._accepted[b] + a
            self._expected[b] = self.keep * self._expected[b] + e
            self._weight[b] = self.keep * self._weight[b] + 1.0

    def table(self) -> list[tuple[float, float, float]]:
        """``(upper edge, factor, weight)`` per bin, for reports."""
        uppers = (*self.edges, 1.0)
        return [(hi, self._factor(b), self._weight[b]) for b, hi in enumerate(uppers)]
