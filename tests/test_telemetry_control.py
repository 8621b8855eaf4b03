"""read_control_state: active pins (newest first, batch-size ranges) and the active policy."""

from __future__ import annotations

import pytest

from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.telemetry import store
from sglang_adatree.telemetry.control import read_control_state
from sglang_adatree.telemetry.models import PinRow, Policy

pytest_plugins = ["telemetry_fixtures"]


def _pin(shape, created_at, low=None, high=None, cleared_at=None) -> PinRow:
    return PinRow(
        steps=shape[0],
        topk=shape[1],
        num_draft_tokens=shape[2],
        min_batch_size=low,
        max_batch_size=high,
        reason="test",
        created_at=created_at,
        created_by="op",
        cleared_at=cleared_at,
        cleared_by="op" if cleared_at else None,
    )


def _policy(version, active) -> Policy:
    return Policy(
        version=version,
        created_at=float(version),
        artifact=b"model-%d" % version,
        feature_names=["batch_size", "sum_context_len"],
        training_rows=1000,
        validation_metrics={"mape": 0.1},
        active=active,
    )


def test_empty_store_has_no_pins_and_no_policy(sqlite_url):
    state = read_control_state(sqlite_url)
    assert (state.pins, state.active_policy_version, state.policy) == ((), None, None)
    assert state.pin_for(8) is None


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_pins_and_active_policy(backend, request):
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    with store.session_scope(url) as s:
        s.add_all(
            [
                _pin((3, 1, 4), created_at=1.0),  # all batches, oldest
                _pin((4, 2, 8), created_at=2.0, low=1, high=4),  # small batches, newer
                _pin((5, 4, 16), created_at=3.0, cleared_at=4.0),  # cleared: ignored
                _pin((2, 9, 99), created_at=5.0),  # not a valid shape: ignored, logged
                _policy(1, active=False),
                _policy(2, active=True),
            ]
        )
    state = read_control_state(url)
    assert [p.shape for p in state.pins] == [TreeShape(4, 2, 8), TreeShape(3, 1, 4)]
    assert state.pin_for(2) == TreeShape(4, 2, 8)
    assert state.pin_for(16) == TreeShape(3, 1, 4)
    assert state.active_policy_version == 2
    assert state.policy is not None and state.policy.artifact == b"model-2"
    assert state.policy.feature_names == ("batch_size", "sum_context_len")
    # The artifact is read only when the caller does not already have that version.
    again = read_control_state(url, known_policy_version=2)
    assert (again.active_policy_version, again.policy) == (2, None)
