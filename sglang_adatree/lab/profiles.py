"""Step-time profiles: what a decode step of each shape costs on one deployment.

A profile answers ``step_ms(features, shape)`` for the simulator (the true step time, before any
noise the scenario adds). ``TableProfile`` holds measured or computed times on a grid of batch
sizes and mean context lengths per shape and interpolates between grid points:

* batch size: piecewise linear in the *padded* batch size (the engine runs the padded batch, so
  a GPU's step time is flat between capture sizes and jumps at them); past the last grid point,
  the last segment's slope continues;
* mean context per request: piecewise linear, clamped at the grid's ends.

Every profile says where it came from (``source``: ``measured`` on a real server,
``analytic`` from a roofline of published hardware figures, ``telemetry`` from a deployment's
recorded steps) and the command that made it (``made_by``), and round-trips through JSON so a
profile can be committed as data.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from sglang_adatree.core.features import NO_GRAPHS, GraphPadding, StepFeatures
from sglang_adatree.core.shapes import TreeShape

SOURCES = ("measured", "analytic", "telemetry")


class StepTimeProfile(Protocol):
    """The true step time of a decode step, as the simulator charges it."""

    name: str
    source: str

    def step_ms(self, features: StepFeatures, shape: TreeShape) -> float: ...


@dataclass(frozen=True, eq=False)
class TableProfile:
    """Step times on a grid; see the module docstring. Compared by identity (it holds an
    array)."""

    name: str  # e.g. "cpu-2core", "h100-llama8b"
    source: str  # one of SOURCES
    made_by: str  # the command (or computation) that produced it, and when
    shapes: tuple[TreeShape, ...]
    batch_sizes: tuple[int, ...]  # ascending padded batch sizes
    context_lens: tuple[int, ...]  # ascending mean context lengths per request
    ms: np.ndarray  # [shapes, batch_sizes, context_lens] step time
    padding: GraphPadding = NO_GRAPHS
    notes: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"profile source must be one of {SOURCES}, got {self.source!r}")
        expected = (len(self.shapes), len(self.batch_sizes), len(self.context_lens))
        if self.ms.shape != expected:
            raise ValueError(f"profile {self.name}: table {self.ms.shape}, grid {expected}")
        for axis in (self.batch_sizes, self.context_lens):
            if not axis or list(axis) != sorted(set(axis)):
                raise ValueError(f"profile {self.name}: grid axes must increase, got {axis}")
        if not np.all(np.isfinite(self.ms)) or np.any(self.ms <= 0):
            raise ValueError(f"profile {self.name}: step times must be finite and positive")
        object.__setattr__(self, "_index", {s: i for i, s in enumerate(self.shapes)})

    def step_ms(self, features: StepFeatures, shape: TreeShape) -> float:
        i = self._index.get(shape)  # type: ignore[attr-defined]
        if i is None:
            raise KeyError(f"profile {self.name} has no step time for shape {shape}")
        b = float(self.padding.padded(features.batch_size))
        mean = features.sum_context_len / features.batch_size
        table = self.ms[i]  # [batch_sizes, context_lens]
        j, wj = _bracket(self.context_lens, mean, extrapolate=False)
        by_batch = table[:, j] * (1.0 - wj) + table[:, j + 1] * wj if wj else table[:, j]
        k, wk = _bracket(self.batch_sizes, b, extrapolate=True)
        if len(self.batch_sizes) == 1:
            return float(by_batch[0])
        return float(by_batch[k] + wk * (by_batch[k + 1] - by_batch[k]))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "made_by": self.made_by,
            "shapes": [str(s) for s in self.shapes],
            "batch_sizes": list(self.batch_sizes),
            "context_lens": list(self.context_lens),
            "ms": np.round(self.ms, 4).tolist(),
            "cuda_graph_batch_sizes": list(self.padding.capture_sizes),
            "notes": self.notes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TableProfile:
        return cls(
            name=data["name"],
            source=data["source"],
            made_by=data["made_by"],
            shapes=tuple(TreeShape.parse(s) for s in data["shapes"]),
            batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
            context_lens=tuple(int(c) for c in data["context_lens"]),
            ms=np.asarray(data["ms"], dtype=np.float64),
            padding=GraphPadding(tuple(data.get("cuda_graph_batch_sizes", ()))),
            notes=dict(data.get("notes", {})),
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> TableProfile:
        return cls.from_json(json.loads(path.read_text()))

    def restricted(self, shapes: Sequence[TreeShape]) -> TableProfile:
        """The same profile over a subset of its shapes."""
        rows = [self._index[s] for s in shapes]  # type: ignore[attr-defined]
        return TableProfile(
            self.name, self.source, self.made_by, tuple(shapes), self.batch_sizes,
            self.context_lens, self.ms[rows], self.padding, self.notes,
        )  # fmt: skip


def _bracket(axis: Sequence[int], value: float, extrapolate: bool) -> tuple[int, float]:
    """Lower grid index and interpolation weight; clamped at the ends unless ``extrapolate``
    (then the weight runs past 1 on the last segment, and stays 0 below the first point)."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, value) - 1, 0), len(axis) - 2)
    lo, hi = axis[i], axis[i + 1]
    w = (value - lo) / (hi - lo)
    return i, (max(w, 0.0) if extrapolate else min(max(w, 0.0), 1.0))
