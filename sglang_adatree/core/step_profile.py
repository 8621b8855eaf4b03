"""Step-time profiles: what a decode step of each shape costs on one deployment.

A profile answers ``step_ms(features, shape)``. The policy lab's simulator charges it as the
true step time (before any noise the scenario adds); a server started with
``step_time_profile`` prices its candidates by it (``ProfileStepTime``), so the shapes it seldom
runs are priced by their own measured times, not by an analytic model fitted to the few
steps they ran. ``TableProfile`` holds measured or computed times on a grid of batch sizes and
mean context lengths per shape and interpolates between grid points:

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

from sglang_adatree.core.features import COLUMN, NO_GRAPHS, GraphPadding, StepFeatures
from sglang_adatree.core.shapes import TreeShape

SOURCES = ("measured", "analytic", "telemetry")


class StepTimeProfile(Protocol):
    """A decode step's step time per shape: the simulator's truth, or a server's base model."""

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
        # The last shape tuple priced and its rows of the table, as lists: a decision prices
        # the same candidates every step.
        object.__setattr__(self, "_last_rows", (None, []))

    def missing(self, shapes: Sequence[TreeShape]) -> list[TreeShape]:
        """The shapes of ``shapes`` this profile has no step time for."""
        index = self._index  # type: ignore[attr-defined]
        return [s for s in shapes if s not in index]

    def step_ms(self, features: StepFeatures, shape: TreeShape) -> float:
        """One shape's step time, read without the rows kept for the last shape tuple (a
        simulator's truth asks a shape at a time, the policy its candidates)."""
        return self._interpolated([self.ms[self._row(shape)].tolist()], features)[0]

    def step_ms_many(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> np.ndarray:
        """``[len(shapes)]`` step times of one batch; KeyError for a shape not profiled."""
        return np.array(self.step_ms_list(features, shapes))

    def step_ms_list(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> list[float]:
        """``step_ms_many`` as a list. A server prices its candidates so at every step, in
        caches the forward has just swept, where each array operation costs tens of
        microseconds and the interpreter's own loop runs warm (``core.cost_model``)."""
        last, rows = self._last_rows  # type: ignore[attr-defined]
        if last is not shapes:
            # [shapes][batch_sizes][context_lens]
            rows = self.ms[[self._row(s) for s in shapes]].tolist()
            object.__setattr__(self, "_last_rows", (shapes, rows))
        return self._interpolated(rows, features)

    def _row(self, shape: TreeShape) -> int:
        """``shape``'s row of the table; KeyError for a shape not profiled."""
        i = self._index.get(shape)  # type: ignore[attr-defined]
        if i is None:
            raise KeyError(f"profile {self.name} has no step time for shape {shape}")
        return i

    def _interpolated(self, rows: list[list[list[float]]], features: StepFeatures) -> list[float]:
        """``rows`` ``[shapes][batch_sizes][context_lens]`` interpolated at this batch."""
        b = float(self.padding.padded(features.batch_size))
        mean = features.sum_context_len / features.batch_size
        j, wj = _bracket(self.context_lens, mean, extrapolate=False)
        if len(self.batch_sizes) == 1:
            return [_at_context(row[0], j, wj) for row in rows]
        k, wk = _bracket(self.batch_sizes, b, extrapolate=True)
        out = []
        for row in rows:
            lo = _at_context(row[k], j, wj)
            out.append(lo + wk * (_at_context(row[k + 1], j, wj) - lo))
        return out

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


def _at_context(times: list[float], j: int, wj: float) -> float:
    """``times`` ``[context_lens]`` interpolated at grid index ``j`` and weight ``wj``."""
    return times[j] * (1.0 - wj) + times[j + 1] * wj if wj else times[j]


def _bracket(axis: Sequence[int], value: float, extrapolate: bool) -> tuple[int, float]:
    """Lower grid index and interpolation weight; clamped at the ends unless ``extrapolate``
    (then the weight runs past 1 on the last segment, and stays 0 below the first point)."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, value) - 1, 0), len(axis) - 2)
    lo, hi = axis[i], axis[i + 1]
    w = (value - lo) / (hi - lo)
    return i, (max(w, 0.0) if extrapolate else min(max(w, 0.0), 1.0))


class ProfileStepTime:
    """A ``StepTimeModel`` (``core.cost_model``) that prices feature rows by a profile."""

    def __init__(self, profile: TableProfile) -> None:
        self.profile = profile
        # The shapes of the last shape columns asked for: a decision asks for the same
        # candidates every step.
        self._last_cols = b""
        self._last_shapes: list[TreeShape] = []

    def predict_list(self, features: StepFeatures, shapes: Sequence[TreeShape]) -> list[float]:
        """``[len(shapes)]`` step times in ms of one batch, as ``predict_matrix`` prices its
        feature rows, without building them: the policy prices every candidate each step
        (``TableProfile.step_ms_list``). The profile pads the batch size as the deployment it
        was measured on did, whatever ``features`` padded."""
        return self.profile.step_ms_list(features, shapes)

    def predict_matrix(self, x: np.ndarray) -> np.ndarray:
        """``[rows]`` step times in ms for feature rows ``x`` ``[rows, NUM_FEATURES]``. The
        profile pads each batch size as the deployment it was measured on did."""
        c = COLUMN
        if x.shape[0] == 0:
            return np.empty(0)
        batch = x[:, [c["batch_size"], c["sum_context_len"], c["max_context_len"]]]
        shape_cols = x[:, [c["steps"], c["topk"], c["num_draft_tokens"]]].astype(np.int64)
        batch = batch.astype(np.int64)  # [rows, 3]
        if (batch == batch[0]).all():
            # A decision prices every candidate of one batch: one lookup.
            size, total, longest = batch[0].tolist()
            key = shape_cols.tobytes()
            if key != self._last_cols:
                self._last_cols = key
                self._last_shapes = [TreeShape(*cols) for cols in shape_cols.tolist()]
            shapes = self._last_shapes
            return self.profile.step_ms_many(StepFeatures(size, size, total, longest), shapes)
        keys, group = np.unique(batch, axis=0, return_inverse=True)
        group = group.reshape(-1)  # [rows]
        out = np.empty(x.shape[0])
        for g, (size, total, longest) in enumerate(keys.tolist()):
            rows = np.flatnonzero(group == g)
            shapes = [TreeShape(*shape_cols[r].tolist()) for r in rows]
            features = StepFeatures(size, size, total, longest)
            out[rows] = self.profile.step_ms_many(features, shapes)
        return out


def load_profile_step_time(path: str | Path, candidates: Sequence[TreeShape]) -> ProfileStepTime:
    """The step-time model of the profile JSON at ``path``; ValueError, naming the file and
    what to do, when it cannot be read or lacks a candidate shape."""
    where = Path(path).expanduser()
    try:
        profile = TableProfile.load(where)
    except OSError as exc:
        raise ValueError(f"step_time_profile {where}: cannot read it ({exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"step_time_profile {where} is not a step-time profile ({exc!r}); write one with "
            "`adatree profile --profile-out FILE`"
        ) from None
    # A server refuses to start without a candidate's times, not fail at its first decision.
    missing = profile.missing(candidates)
    if missing:
        raise ValueError(
            f"step_time_profile {where} has no step times for the candidate shapes "
            f"{', '.join(str(s) for s in missing)}; profile every candidate with `adatree "
            "profile --shapes candidates --profile-out FILE`, or leave those shapes out of "
            "candidate_shapes"
        )
    return ProfileStepTime(profile)
