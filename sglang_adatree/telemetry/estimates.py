"""What the policy predicted on recorded steps, beside what they measured.

Per shape that ran: its steps' mean predicted and measured acceptance length and step time
(the estimates the policy acted on, against the outcome). Per (shape, runner-up) pair
(``policy.Decision.runner_up``): how often that candidate was priced next best, by how much the
chosen shape's predicted goodput led it, and what was predicted for it beside what it measured
on its own steps of the same selection. A runner-up predicted below what it measures when it
runs was underrated; a shape predicted above what it measures was chosen on an error.

The dashboard's shapes page and ``adatree compare`` read both; the means are over the steps the
caller's ``WHERE`` selects, at whatever batch sizes those steps ran. Step times are averaged over
the steps a cost model learns from (``learning.learnable``): a catch-up step is predicted as no
speculation but also runs the draft's extend, so it would read as no speculation's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, case, func, select

from sglang_adatree.telemetry.learning import learnable
from sglang_adatree.telemetry.models import Step


@dataclass(frozen=True)
class ShapeEstimate:
    """One shape's steps: how many, and the means of what was predicted and measured."""

    shape: str  # "S,K,N"
    num_steps: int
    predicted_accept_len: float | None  # None: no step of it was predicted
    measured_accept_len: float
    predicted_step_ms: float | None  # None: no step of it a cost model learns from
    measured_step_ms: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "steps": self.num_steps,
            "predicted_accept_len": self.predicted_accept_len,
            "measured_accept_len": self.measured_accept_len,
            "predicted_step_ms": self.predicted_step_ms,
            "measured_step_ms": self.measured_step_ms,
        }


@dataclass(frozen=True)
class RunnerUp:
    """One (shape run, runner-up) pair over the selected steps."""

    shape: str  # "S,K,N", the shape the steps ran
    runner_up: str  # "S,K,N", the candidate priced next best on them
    num_steps: int
    share: float  # of the selected steps ``shape`` ran
    # Mean of the chosen shape's predicted goodput over the runner-up's, minus 1.
    predicted_lead: float | None
    predicted_accept_len: float | None  # the runner-up's, mean over these steps
    predicted_step_ms: float | None
    # The runner-up's own selected steps (None: it never ran among them): what it measured.
    measured_accept_len: float | None
    measured_step_ms: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "runner_up": self.runner_up,
            "steps": self.num_steps,
            "share": self.share,
            "predicted_lead": self.predicted_lead,
            "predicted_accept_len": self.predicted_accept_len,
            "predicted_step_ms": self.predicted_step_ms,
            "measured_accept_len": self.measured_accept_len,
            "measured_step_ms": self.measured_step_ms,
        }


@dataclass(frozen=True)
class Estimates:
    """Per shape, shapes in (steps, topk, num_draft_tokens) order; per pair, each shape's
    runner-ups most seen first."""

    shapes: tuple[ShapeEstimate, ...]
    runner_ups: tuple[RunnerUp, ...]

    def runner_ups_of(self, shape: str) -> tuple[RunnerUp, ...]:
        return tuple(r for r in self.runner_ups if r.shape == shape)


def shape_key(label: str) -> tuple[int, ...]:
    """``"3,1,4"`` -> ``(3, 1, 4)``: the order shapes are listed in."""
    return tuple(int(x) for x in label.split(","))


def estimates(conn: Connection, *where: ColumnElement[bool]) -> Estimates:
    """The estimates of the ``steps`` rows ``where`` selects (see the module docstring)."""
    shape = (Step.steps, Step.topk, Step.num_draft_tokens)
    ran = [
        ShapeEstimate(
            shape=f"{s},{k},{n}",
            num_steps=int(count),
            predicted_accept_len=_float(p_acc),
            measured_accept_len=float(m_acc),
            predicted_step_ms=_float(p_ms),
            measured_step_ms=_float(m_ms),
        )
        for s, k, n, count, p_acc, m_acc, p_ms, m_ms in conn.execute(
            select(
                *shape,
                func.count(),
                func.avg(Step.predicted_accept_len),
                func.avg(Step.measured_accept_len),
                func.avg(case((learnable(), Step.predicted_step_ms))),
                func.avg(case((learnable(), Step.measured_step_ms))),
            )
            .where(*where)
            .group_by(*shape)
        )
    ]
    by_shape = {e.shape: e for e in ran}
    # The chosen shape's predicted goodput over the runner-up's, where both were predicted.
    lead = (Step.predicted_accept_len * Step.runner_up_step_ms) / (
        Step.predicted_step_ms * Step.runner_up_accept_len
    )
    pairs = []
    for s, k, n, runner_up, count, mean_lead, accept, ms in conn.execute(
        select(
            *shape,
            Step.runner_up,
            func.count(),
            func.avg(lead),
            func.avg(Step.runner_up_accept_len),
            func.avg(Step.runner_up_step_ms),
        )
        .where(*where, Step.runner_up.is_not(None))
        .group_by(*shape, Step.runner_up)
    ):
        label = f"{s},{k},{n}"
        own = by_shape.get(runner_up)
        pairs.append(
            RunnerUp(
                shape=label,
                runner_up=runner_up,
                num_steps=int(count),
                share=int(count) / by_shape[label].num_steps,
                predicted_lead=None if mean_lead is None else float(mean_lead) - 1.0,
                predicted_accept_len=_float(accept),
                predicted_step_ms=_float(ms),
                measured_accept_len=None if own is None else own.measured_accept_len,
                measured_step_ms=None if own is None else own.measured_step_ms,
            )
        )
    return Estimates(
        tuple(sorted(ran, key=lambda e: shape_key(e.shape))),
        tuple(sorted(pairs, key=lambda r: (shape_key(r.shape), -r.num_steps, r.runner_up))),
    )


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
