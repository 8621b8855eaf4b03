"""Draft-tree shapes, candidate sets and the envelope.

A shape is SGLang's triple ``(speculative_num_steps, speculative_eagle_topk,
speculative_num_draft_tokens)``, here ``(steps, topk, num_draft_tokens)``:

* ``steps``: draft forward passes, the tree's depth. ``steps = 0`` is no speculation.
* ``topk``: how many children each expanded node gets, and how many nodes each layer expands.
* ``num_draft_tokens``: nodes the target verifies, the root (the last verified token) included,
  so a step can emit at most ``steps + 1`` tokens and drafts ``num_draft_tokens - 1``.

After ``steps`` passes the draft has scored ``topk + (steps - 1) * topk**2`` candidate nodes
(``topk`` children of the root, then ``topk**2`` per further layer); the tree keeps the best
``num_draft_tokens - 1`` of them, so that many must exist. With ``topk = 1`` every layer has a
single node and the tree is a chain of exactly ``steps`` draft tokens.

Worked example: ``(3, 2, 6)`` drafts 3 layers of a binary expansion (2 + 4 + 4 = 10 scored
candidates) and verifies the best 5 of them plus the root.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Upper bounds keep a typo ("40,4,8") from sizing KV memory for a tree nobody meant.
MAX_STEPS = 16
MAX_TOPK = 16
MAX_NUM_DRAFT_TOKENS = 256


class ShapeError(ValueError):
    """A shape or a candidate set that cannot be run."""


@dataclass(frozen=True, order=True)
class TreeShape:
    """One draft-tree shape ``(steps, topk, num_draft_tokens)``; see the module docstring."""

    steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("steps", "topk", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ShapeError(f"{name} must be an int, got {value!r}")
        s, k, n = self.steps, self.topk, self.num_draft_tokens
        if not 0 <= s <= MAX_STEPS:
            raise ShapeError(f"shape {s},{k},{n}: steps must be in [0, {MAX_STEPS}]")
        if not 1 <= k <= MAX_TOPK:
            raise ShapeError(f"shape {s},{k},{n}: topk must be in [1, {MAX_TOPK}]")
        if not 1 <= n <= MAX_NUM_DRAFT_TOKENS:
            raise ShapeError(
                f"shape {s},{k},{n}: num_draft_tokens must be in [1, {MAX_NUM_DRAFT_TOKENS}]"
            )
        if s == 0:
            if (k, n) != (1, 1):
                raise ShapeError(
                    f"shape {s},{k},{n}: no speculation (steps 0) is written 0,1,1 (or '0')"
                )
            return
        if k == 1 and n != s + 1:
            raise ShapeError(
                f"shape {s},{k},{n}: a chain (topk 1) verifies steps + 1 = {s + 1} tokens"
            )
        if n < 2:
            raise ShapeError(f"shape {s},{k},{n}: speculation needs num_draft_tokens >= 2")
        capacity = self.num_candidates
        if n - 1 > capacity:
            raise ShapeError(
                f"shape {s},{k},{n}: num_draft_tokens - 1 = {n - 1} exceeds the "
                f"{capacity} candidates that topk {k} and steps {s} produce"
            )

    @property
    def speculative(self) -> bool:
        """False for the no-speculation shape."""
        return self.steps > 0

    @property
    def is_chain(self) -> bool:
        return self.steps > 0 and self.topk == 1

    @property
    def num_candidates(self) -> int:
        """Draft nodes scored after ``steps`` passes: ``topk + (steps - 1) * topk**2``."""
        if self.steps == 0:
            return 0
        return self.topk + (self.steps - 1) * self.topk**2

    @property
    def max_emitted(self) -> int:
        """Most tokens one request can gain in one verify step (accepted + bonus)."""
        return min(self.steps, self.num_draft_tokens - 1) + 1

    def dominates(self, other: TreeShape) -> bool:
        """Whether this shape is at least as deep, as wide and as large as ``other`` (and not
        the same shape). Its draft expands at least as many nodes per layer, over at least as
        many layers, and it verifies at least as many of the best-scored candidates: under the
        positional acceptance model (``core.acceptance``) it expects at least as many emitted
        tokens, and in every trace set of the policy lab it emits more on average (though not
        at every position)."""
        return (
            self != other
            and self.steps >= other.steps
            and self.topk >= other.topk
            and self.num_draft_tokens >= other.num_draft_tokens
        )

    @property
    def kv_tokens_reserved(self) -> int:
        """KV slots one request needs for this step: verify window or draft slots, larger."""
        return max(self.num_draft_tokens, self.steps * self.topk)

    def __str__(self) -> str:
        return f"{self.steps},{self.topk},{self.num_draft_tokens}"

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """Parse ``"S,K,N"``; ``"0"``, ``"off"`` and ``"none"`` mean no speculation."""
        raw = text.strip().lower()
        if raw in ("0", "off", "none", "ar"):
            return NO_SPEC
        parts = [p.strip() for p in raw.split(",")]
        if len(parts) != 3:
            raise ShapeError(f"shape {text!r}: expected 'steps,topk,num_draft_tokens' or '0'")
        try:
            s, k, n = (int(p) for p in parts)
        except ValueError:
            raise ShapeError(
                f"shape {text!r}: steps, topk and num_draft_tokens must be ints"
            ) from None
        return cls(s, k, n)


NO_SPEC = TreeShape(0, 1, 1)


@dataclass(frozen=True)
class Envelope:
    """The largest shape over a candidate set: memory and buffers are sized for it."""

    steps: int
    topk: int
    num_draft_tokens: int
    kv_tokens_reserved: int  # per request: max over shapes of max(num_draft_tokens, steps*topk)


def envelope(shapes: Iterable[TreeShape]) -> Envelope:
    """Component-wise maximum of the speculative shapes (no speculation needs nothing extra)."""
    spec = [s for s in shapes if s.speculative]
    if not spec:
        raise ShapeError("the candidate set has no speculative shape; nothing to size for")
    return Envelope(
        steps=max(s.steps for s in spec),
        topk=max(s.topk for s in spec),
        num_draft_tokens=max(s.num_draft_tokens for s in spec),
        kv_tokens_reserved=max(s.kv_tokens_reserved for s in spec),
    )


def parse_candidates(text: str) -> tuple[TreeShape, ...]:
    """Parse ``"0;3,1,4;5,4,8"`` (``;`` or whitespace separated) into a candidate set."""
    items = [t for t in text.replace(";", " ").split() if t]
    return validate_candidates(TreeShape.parse(t) for t in items)


def validate_candidates(shapes: Iterable[TreeShape]) -> tuple[TreeShape, ...]:
    """Sorted, de-duplicated candidate set with at least one speculative shape."""
    unique = tuple(sorted(set(shapes)))
    if not unique:
        raise ShapeError("the candidate set is empty")
    envelope(unique)  # raises when nothing speculates
    return unique


# The default candidate set: no speculation, chains of 1-5 draft tokens and trees of 4-16
# verified tokens. Kept small on purpose: on a GPU every shape costs its own CUDA graphs.
DEFAULT_CANDIDATES: tuple[TreeShape, ...] = validate_candidates(
    [
        NO_SPEC,
        TreeShape(1, 1, 2),
        TreeShape(2, 1, 3),
        TreeShape(3, 1, 4),
        TreeShape(5, 1, 6),
        TreeShape(2, 2, 4),
        TreeShape(3, 2, 6),
        TreeShape(3, 4, 8),
        TreeShape(4, 2, 8),
        TreeShape(5, 4, 8),
        TreeShape(4, 4, 12),
        TreeShape(6, 4, 16),
    ]
)
