"""What each adatree server of a paired run predicted on its steps, beside what they measured.

``adatree compare`` gives every adatree server a telemetry database of its own; after the
prompts it reads each one over the prompts' span (the warm-up left out) through
``telemetry.estimates`` and prints, per shape the server ran, its steps' predicted and measured
acceptance length and step time, and the runner-ups priced next best on those steps with what
was predicted for them and what they measured when they ran.
"""

from __future__ import annotations

from typing import Any

from sglang_adatree.telemetry.estimates import Estimates, RunnerUp, estimates
from sglang_adatree.telemetry.models import Step
from sglang_adatree.telemetry.store import session_scope

# Runner-ups printed per shape, most seen first (the JSON has them all).
RUNNER_UPS_SHOWN = 2


def read_estimates(db_url: str, span: tuple[float, float]) -> Estimates:
    """The estimates of the steps recorded in ``db_url`` between ``span``'s unix seconds."""
    start, end = span
    with session_scope(db_url) as session:
        return estimates(session.connection(), Step.wall_time >= start, Step.wall_time <= end)


def estimates_json(est: Estimates) -> dict[str, Any]:
    return {
        "shapes": [e.to_json() for e in est.shapes],
        "runner_ups": [r.to_json() for r in est.runner_ups],
    }


def estimate_lines(name: str, est: Estimates) -> list[str]:
    """Per shape ``name``'s server ran: predicted / measured, and its first runner-ups."""
    if not est.shapes:
        return [f"{name}: no steps recorded over the prompts"]
    out = [
        f"{name}'s estimates over the prompts, means of its steps (predicted / measured); "
        "runner-up: share of the shape's steps, the shape's predicted lead, the runner-up's "
        "predicted / measured on its own steps:"
    ]
    for e in est.shapes:
        rivals = est.runner_ups_of(e.shape)
        line = (
            f"  {e.shape:>8} {e.num_steps:>5} steps  acceptance {_num(e.predicted_accept_len, 2)}"
            f" / {e.measured_accept_len:.2f}  step {_num(e.predicted_step_ms, 1)}"
            f" / {_num(e.measured_step_ms, 1)} ms"
        )
        if rivals:
            shown = ", ".join(_rival(r) for r in rivals[:RUNNER_UPS_SHOWN])
            more = len(rivals) - RUNNER_UPS_SHOWN
            line += f"; runner-up {shown}" + (f" (+{more} more)" if more > 0 else "")
        out.append(line)
    return out


def _rival(r: RunnerUp) -> str:
    lead = "-" if r.predicted_lead is None else f"{100 * r.predicted_lead:+.1f}%"
    return (
        f"{r.runner_up} {100 * r.share:.0f}% (lead {lead}; acceptance "
        f"{_num(r.predicted_accept_len, 2)} / {_num(r.measured_accept_len, 2)}, step "
        f"{_num(r.predicted_step_ms, 1)} / {_num(r.measured_step_ms, 1)} ms)"
    )


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
