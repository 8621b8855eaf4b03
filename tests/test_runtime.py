"""The serving loop without SGLang: decisions, telemetry rows, operator control, refits."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from sqlalchemy import insert, select

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.policy import Pin as PolicyPin
from sglang_adatree.runtime import AdaTreeRuntime, ControlUpdate, accepted_counts, make_policy
from sglang_adatree.shapes import TreeShape
from sglang_adatree.telemetry.models import Pin, Step
from sglang_adatree.telemetry.records import RunRecord
from sglang_adatree.telemetry.store import get_engine, upgrade
from sglang_adatree.tree import AcceptedPathStats

CHAIN = TreeShape(3, 1, 4)
TREE = TreeShape(2, 2, 4)


def _config(tmp_path, **kw) -> AdaTreeConfig:
    url = f"sqlite:///{tmp_path / 'adatree.sqlite'}"
    upgrade(url)
    values = dict(
        candidate_shapes="0;3,1,4;2,2,4",
        db_url=url,
        warmup_steps=0,
        explore_fraction=0.0,
        control_poll_s=0.1,
        telemetry_flush_s=0.05,
    )
    values.update(kw)
    return AdaTreeConfig().replace(**values)


RUN = RunRecord(
    target_model="t", draft_model="d", device="cpu", sglang_version="x", package_version="y"
)


def _stats(batch: int, shape: TreeShape, accepted: int) -> AcceptedPathStats:
    ranks = torch.full((batch, shape.steps), -1, dtype=torch.int64)
    ranks[:, :accepted] = 0
    children = torch.zeros((batch, shape.steps), dtype=torch.int64)
    children[:, : accepted + 1] = shape.topk
    return AcceptedPathStats(children[:, : shape.steps], ranks)


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_decide_and_record_one_row_per_step(tmp_path):
    runtime = AdaTreeRuntime(_config(tmp_path), RUN)
    try:
        for _ in range(5):
            decision, features = runtime.decide([100, 40])
            runtime.complete_step(
                decision,
                features,
                20.0,
                [2, 1],
                _stats(2, decision.shape, 1) if decision.shape.speculative else None,
            )
        runtime.writer.flush()
        with get_engine(runtime.config.resolved_db_url).connect() as conn:
            rows = conn.execute(select(Step).order_by(Step.step_index)).all()
        assert [r.step_index for r in rows] == list(range(5))
        assert all(r.batch_size == 2 and r.sum_context_len == 140 for r in rows)
        assert all(r.emitted_tokens == 5 and r.measured_accept_len == 2.5 for r in rows)
        state = runtime.server_state()
        assert state["adatree_steps"] == 5 and state["adatree_recent_accept_length"] == 2.5
    finally:
        runtime.close()


def test_pin_from_store_applies_at_next_step(tmp_path):
    config = _config(tmp_path)
    runtime = AdaTreeRuntime(config, RUN)
    try:
        with get_engine(config.resolved_db_url).begin() as conn:
            conn.execute(
                insert(Pin).values(
                    steps=2,
                    topk=2,
                    num_draft_tokens=4,
                    reason="test",
                    created_at=time.time(),
                    created_by="pytest",
                )
            )
        _wait(lambda: runtime._pending is not None or runtime.policy.pins)
        decision, _ = runtime.decide([10])
        assert decision.shape == TREE and decision.source == "pin"
        assert runtime.server_state()["adatree_pins"] == ["2,2,4"]
    finally:
        runtime.close()


def test_a_pin_set_before_start_applies_from_the_first_steps(tmp_path):
    # The control thread reads the store once at start, then every control_poll_s (a minute
    # here, the most allowed): a pin made before the server started must not wait a minute.
    config = _config(tmp_path, control_poll_s=60.0)
    with get_engine(config.resolved_db_url).begin() as conn:
        conn.execute(
            insert(Pin).values(
                steps=3, topk=1, num_draft_tokens=4, reason="test", created_at=time.time(),
                created_by="pytest",
            )
        )  # fmt: skip
    runtime = AdaTreeRuntime(config, RUN)
    try:
        _wait(lambda: runtime._pending is not None)
        decision, _ = runtime.decide([10])
        assert decision.shape == CHAIN and decision.source == "pin"
    finally:
        runtime.close()


def test_analytic_model_refits_on_measured_steps(tmp_path):
    runtime = AdaTreeRuntime(_config(tmp_path, record_steps=False), None)
    initial = runtime.policy.cost_model
    try:
        # A CPU-like deployment: 40 ms per step plus 10 ms per verified token.
        for i in range(200):
            shape = runtime.candidate_shapes[i % 3]
            decision, features = runtime.decide([50 + i])
            decision = type(decision)(shape, "explore", 1.0, 1.0)
            measured = 40.0 + 10.0 * shape.num_draft_tokens
            runtime.complete_step(decision, features, measured, [0])
        # The control thread refits once it sees 16 rows of all three shapes, then at 32, 64
        # and 128 (each polled, so maybe later); a refit handed over while the loop still ran
        # was already applied by a decide() there (on a loaded machine the loop can take in
        # the last one, and none comes after it: waiting for a pending one would time out).
        _wait(lambda: runtime._pending is not None or runtime.policy.cost_model is not initial)
        runtime.decide([60])
        predicted = runtime.policy.cost_model.predict_ms_many(features, runtime.candidate_shapes)
        expected = [40.0 + 10.0 * s.num_draft_tokens for s in runtime.candidate_shapes]
        assert predicted == pytest.approx(expected, rel=0.05)
    finally:
        runtime.close()


def test_a_refit_keeps_the_corrections_the_measurements_imply(tmp_path):
    # Step times no analytic fit matches: the 2-step tree costs far more than the 3-step chain
    # with as many draft tokens (non-negative coefficients cannot make a draft pass cheaper).
    truth = {"0,1,1": 40.0, "1,1,2": 55.0, "2,1,3": 60.0, "2,2,4": 150.0, "3,1,4": 70.0}
    config = _config(tmp_path, record_steps=False, candidate_shapes=";".join(truth))
    runtime = AdaTreeRuntime(config, None, control=False)
    measured = {shape: truth[str(shape)] for shape in runtime.candidate_shapes}
    for i in range(400):
        shape = runtime.candidate_shapes[i % len(measured)]
        decision, features = runtime.decide([50 + i % 7])
        decision = type(decision)(shape, "explore", 1.0, 1.0)
        runtime.complete_step(decision, features, measured[shape], [0])
    refit = runtime._refit(force=True)
    assert refit is not None
    # The bare fit is off by more than 20% on some shape...
    raw = refit.raw_ms_many(features, runtime.candidate_shapes)
    expected = np.array(list(measured.values()))
    assert np.max(np.abs(raw / expected - 1)) > 0.2
    # ...but the model the policy gets starts with the corrections of the same history.
    predicted = refit.predict_ms_many(features, runtime.candidate_shapes)
    assert predicted == pytest.approx(expected, rel=0.03)
    assert all(refit.residual.measured(s) == 80 for s in runtime.candidate_shapes)


def _refits(runtime: AdaTreeRuntime, shapes: list[TreeShape], steps: int) -> list[int]:
    """The measured-step counts at which ``_refit`` hands over a model, shapes run in turn."""
    refits = []
    for i in range(1, steps + 1):
        shape = shapes[i % len(shapes)]
        decision, features = runtime.decide([50 + i % 7])
        decision = type(decision)(shape, "explore", 1.0, 1.0)
        runtime.complete_step(decision, features, 40.0 + 10.0 * shape.num_draft_tokens, [0])
        if runtime._refit(force=False) is not None:
            refits.append(i)
    return refits


def test_the_first_refit_comes_once_every_candidate_was_measured(tmp_path):
    from sglang_adatree.runtime import FIRST_REFIT_ROWS, REFIT_EVERY_ROWS

    runtime = AdaTreeRuntime(_config(tmp_path, record_steps=False), None, control=False)
    refits = _refits(runtime, list(runtime.candidate_shapes), 2 * REFIT_EVERY_ROWS + 128)
    # The default model prices a CPU's steps with a GPU's costs: refit as soon as the fit is
    # determined, then each time the measurements have doubled, then at the steady interval.
    first = FIRST_REFIT_ROWS
    assert refits == [first, 2 * first, 4 * first, 8 * first, 256, 384]


def test_without_every_candidate_measured_the_first_refit_waits(tmp_path):
    from sglang_adatree.runtime import MIN_REFIT_ROWS

    runtime = AdaTreeRuntime(_config(tmp_path, record_steps=False), None, control=False)
    # Two of the three candidates (as under a pin, or without warm-up): the fit's terms are
    # less determined, so it waits for more steps.
    refits = _refits(runtime, list(runtime.candidate_shapes[:2]), 2 * MIN_REFIT_ROWS)
    assert refits == [MIN_REFIT_ROWS, 2 * MIN_REFIT_ROWS]


def test_accepted_counts():
    stats = AcceptedPathStats(
        torch.tensor([[2, 2, 0], [2, 0, 0]]), torch.tensor([[0, 1, -1], [-1, -1, -1]])
    )
    offered, by_depth, by_rank = accepted_counts(stats, topk=2)
    assert offered == (4, 2, 0)
    assert by_depth == (1, 1, 0)
    assert by_rank == (1, 1)


def test_unknown_policy_name_is_a_config_error():
    with pytest.raises(ValueError, match="policy"):
        AdaTreeConfig().replace(policy="magic")
    policy = make_policy(AdaTreeConfig(), None, None)  # type: ignore[arg-type]
    assert type(policy).__name__ == "Policy"


def test_a_draft_that_skipped_its_extend_catches_up_before_speculating(tmp_path):
    # Warm-up cycles the candidates in shape order, 0 -> 2,2,4 -> 3,1,4. After the step without
    # speculation (which skipped the draft's extend) the tree waits one step: a catch-up runs
    # first, then the held tree, then the warm-up goes on; no decision is lost or repeated.
    config = _config(tmp_path, record_steps=False, warmup_steps=1000)
    runtime = AdaTreeRuntime(config, None, control=False)
    seen = []
    behind = False
    context = 50
    for _ in range(7):
        decision, features = runtime.decide([context], draft_behind=behind)
        seen.append((str(decision.shape), decision.source))
        behind = not decision.shape.speculative and decision.source != "catch-up"
        stats = _stats(1, decision.shape, 1) if decision.shape.speculative else None
        runtime.complete_step(decision, features, 30.0, [1 if stats else 0], stats)
        context += 2 if stats else 1
    assert seen == [
        ("0,1,1", "warmup"),
        ("0,1,1", "catch-up"),
        ("2,2,4", "warmup"),
        ("3,1,4", "warmup"),
        ("0,1,1", "warmup"),
        ("0,1,1", "catch-up"),
        ("2,2,4", "warmup"),
    ]
    assert runtime.policy.step == 5  # the catch-ups were not policy decisions
    # Catch-ups cost no speculation plus the draft's extend: not taught as no speculation's
    # cost, nor counted as measurements of it.
    assert runtime.policy.measured.tolist() == [2, 2, 1]
    assert len(runtime._history) == 5


def test_without_a_skipped_extend_no_catch_up_runs(tmp_path):
    config = _config(tmp_path, record_steps=False, warmup_steps=1000)
    runtime = AdaTreeRuntime(config, None, control=False)
    sources = []
    for _ in range(6):
        decision, features = runtime.decide([50], draft_behind=False)
        sources.append(decision.source)
        runtime.complete_step(decision, features, 30.0, [0])
    assert sources == ["warmup"] * 6
    # Behind, but the policy chose no speculation: nothing to catch up for.
    decision, _ = runtime.decide([50], draft_behind=True)
    assert (str(decision.shape), decision.source) == ("0,1,1", "warmup")
    decision, _ = runtime.decide([51], draft_behind=True)  # 2,2,4: caught up first
    assert decision.source == "catch-up"
    decision, _ = runtime.decide([52], draft_behind=False)
    assert str(decision.shape) == "2,2,4"


def test_a_held_decision_is_dropped_for_another_batch_or_a_pin(tmp_path):
    config = _config(tmp_path, record_steps=False, warmup_steps=1000)
    runtime = AdaTreeRuntime(config, None, control=False)
    runtime.decide([50, 70])  # 0,1,1
    decision, _ = runtime.decide([51, 71], draft_behind=True)  # 2,2,4 held
    assert decision.source == "catch-up"
    # The batch changed (a request finished, another joined): a decision of its own.
    decision, _ = runtime.decide([52, 30], draft_behind=False)
    assert (str(decision.shape), decision.source) == ("3,1,4", "warmup")
    # An operator's pin arriving between the catch-up and the held step wins at once.
    runtime.decide([53, 31])  # 0,1,1
    decision, _ = runtime.decide([54, 32], draft_behind=True)  # 2,2,4 held
    assert decision.source == "catch-up"
    runtime._pending = ControlUpdate((PolicyPin(CHAIN),), None, None, "")
    decision, _ = runtime.decide([55, 33], draft_behind=False)
    assert (decision.shape, decision.source) == (CHAIN, "pin")


def test_a_catch_up_step_is_recorded_with_its_source(tmp_path):
    runtime = AdaTreeRuntime(_config(tmp_path, warmup_steps=1000), RUN)
    try:
        decision, features = runtime.decide([50])  # 0,1,1
        runtime.complete_step(decision, features, 30.0, [0])
        decision, features = runtime.decide([51], draft_behind=True)
        runtime.complete_step(decision, features, 35.0, [0])
        runtime.writer.flush()
        with get_engine(runtime.config.resolved_db_url).connect() as conn:
            rows = conn.execute(
                select(Step.steps, Step.decision_source, Step.measured_step_ms).order_by(
                    Step.step_index
                )
            ).all()
        assert [tuple(r) for r in rows] == [(0, "warmup", 30.0), (0, "catch-up", 35.0)]
    finally:
        runtime.close()


@pytest.mark.parametrize("policy", ["turbospec", "sglang-adaptive"])
def test_baseline_policies_catch_up_too(tmp_path, policy):
    # The baselines share the serving loop, so their speculation after no speculation waits
    # for a catch-up as adatree's does (they choose among chains and no speculation).
    config = _config(tmp_path, record_steps=False, policy=policy, candidate_shapes="0;1,1,2;3,1,4")
    runtime = AdaTreeRuntime(config, None, control=False)
    decision, _ = runtime.decide([50], draft_behind=True)  # both start on the 3-step chain
    assert (str(decision.shape), decision.source) == ("0,1,1", "catch-up")
    decision, _ = runtime.decide([51], draft_behind=False)
    assert decision.shape == CHAIN and decision.source != "catch-up"
