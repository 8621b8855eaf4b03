"""The recorded steps a cost model may learn from: the store's side of one rule.

A step teaches a cost model when its decision source prices its shape and its time was measured
(``core.policy.teaches_cost_model``): a catch-up step costs no speculation plus the draft's extend
and would make plain decoding look dearer. The online refit applies the rule as steps finish;
retrain and the dashboard's cost page read recorded steps through ``learnable`` below, built
from the same sources, so all three agree on which steps count.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, and_

from sglang_adatree.core.policy import UNPRICED_SOURCES
from sglang_adatree.telemetry.models import Step


def learnable() -> ColumnElement[bool]:
    """The ``WHERE`` condition of ``steps`` rows a cost model may learn from."""
    return and_(
        Step.measured_step_ms > 0,
        Step.decision_source.not_in([str(s) for s in UNPRICED_SOURCES]),
    )
