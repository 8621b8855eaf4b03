"""The control poller over a real SQLite store: pins and policy versions reach the controller at a
step boundary, refits follow the schedule, and an unreadable store is logged once."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from synthetic import SyntheticSurface, sample_steps
from test_controller import config, outcome

from sglang_adatree.core.controller import BatchView, StepController
from sglang_adatree.core.features import feature_rows
from sglang_adatree.core.policy import DecisionSource, Pin
from sglang_adatree.core.refit import FIRST_REFIT_ROWS
from sglang_adatree.core.shapes import TreeShape
from sglang_adatree.core.xgb_cost import fit_xgboost
from sglang_adatree.sglang import allocator
from sglang_adatree.telemetry import control
from sglang_adatree.telemetry import poller as poller_module
from sglang_adatree.telemetry.poller import ControlPoller
from sglang_adatree.telemetry.store import get_engine, upgrade

CHAIN = TreeShape(3, 1, 4)
TREE = TreeShape(2, 2, 4)


def store(tmp_path) -> str:
    url = f"sqlite:///{tmp_path / 'adatree.sqlite'}"
    upgrade(url)
    return url


def pin(url: str, shape: TreeShape, actor: str = "pytest") -> int:
    candidates = control.CandidateSet(config().candidate_shapes, "config", None)
    with get_engine(url).begin() as conn:
        return control.create_pin(conn, candidates, Pin(shape), "test", actor).id


def wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def activate_trained_version(url: str, controller: StepController) -> int:
    """A small XGBoost version over the controller's candidates, stored and activated."""
    surface = SyntheticSurface()
    rng = np.random.default_rng(0)
    x = feature_rows(*sample_steps(300, controller.candidate_shapes, rng, max_batch_size=8))
    model = fit_xgboost(x, surface.step_ms(x, rng), num_rounds=20)
    with get_engine(url).begin() as conn:
        return control.add_policy_version(
            conn,
            artifact=model.to_bytes(),
            feature_names=model.info.feature_names,
            training_rows=model.info.training_rows,
            validation_metrics={},
            activate=True,
            actor="pytest",
        )


def test_a_pin_from_the_store_applies_at_the_next_step(tmp_path):
    url = store(tmp_path)
    controller = StepController(config(skip_idle_draft_extend=False))
    poller = ControlPoller(controller, url, poll_s=0.1)
    try:
        controller.begin(BatchView(("a",), (10,)))
        pin_id = pin(url, TREE)
        wait(lambda: len(controller._updates) > 0)
        ticket = controller.begin(BatchView(("a",), (11,)))
        assert (ticket.decision.shape, ticket.decision.source) == (TREE, DecisionSource.PIN)
        with get_engine(url).begin() as conn:
            control.clear_pin(conn, pin_id, "pytest")
        wait(lambda: len(controller._updates) > 0)
        assert controller.begin(BatchView(("a",), (12,))).decision.source != DecisionSource.PIN
    finally:
        poller.close()


def test_a_pin_set_before_start_applies_from_the_first_step(tmp_path):
    # The poller reads once at start, then every poll_s (a minute here, the most allowed): a
    # pin made before the server started must not wait a minute.
    url = store(tmp_path)
    pin(url, CHAIN)
    controller = StepController(config())
    poller = ControlPoller(controller, url, poll_s=60.0)
    try:
        wait(lambda: len(controller._updates) > 0)
        ticket = controller.begin(BatchView(("a",), (10,)))
        assert (ticket.decision.shape, ticket.decision.source) == (CHAIN, DecisionSource.PIN)
    finally:
        poller.close()


def test_refits_come_through_the_poller_until_a_version_is_active(tmp_path):
    url = store(tmp_path)
    controller = StepController(config(skip_idle_draft_extend=False, warmup_steps=30))
    poller = ControlPoller(controller, url, poll_s=60.0, start=False)
    # The warm-up measures every shape; the first refit is the controller's own, the second
    # (due once the measured steps have doubled) the poller's.
    for i in range(2 * FIRST_REFIT_ROWS):
        ticket = controller.begin(BatchView(("a",), (50 + i,)))
        controller.finish(ticket, outcome(ticket, 40.0 + 10.0 * ticket.decision.shape.steps))
    update = poller.poll()
    assert update is not None and update.model_source == "refit"
    # A trained version, activated by an operator, replaces the refits.
    version = activate_trained_version(url, controller)
    update = poller.poll()
    assert update is not None and update.model_source == "policy"
    assert update.policy_version == version and update.cost_model.table is not None
    controller.begin(BatchView(("a",), (90,)))
    assert controller.policy_version == version
    assert poller.poll() is None  # nothing changed: no refit while a version is active
    # Rolled back to no version: the refitted analytic model again, at once.
    with get_engine(url).begin() as conn:
        conn.exec_driver_sql("UPDATE policies SET active = 0")
    update = poller.poll()
    assert update is not None and update.model_source == "refit" and update.policy_version is None


def test_an_unreadable_store_is_logged_once_and_its_return_once(tmp_path, caplog):
    url = store(tmp_path)
    controller = StepController(config())
    poller = ControlPoller(controller, url, poll_s=60.0, start=False)
    path = tmp_path / "adatree.sqlite"
    moved = tmp_path / "away.sqlite"
    caplog.set_level(logging.WARNING, logger="sglang_adatree.telemetry.poller")
    path.rename(moved)
    path.mkdir()  # SQLite cannot open a directory: reads fail until it is back
    try:
        for _ in range(5):
            assert poller.poll() is None
    finally:
        path.rmdir()
        moved.rename(path)
    poller.poll()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot read pins" in m for m in messages) == 1
    assert sum("readable again" in m for m in messages) == 1


def test_the_freed_heap_is_released_once_a_version_has_been_swapped_in_or_out(
    tmp_path, monkeypatch
):
    # A replaced model is freed on the decode loop, at the step boundary that applies its
    # successor: releasing the heap earlier would find nothing freed yet. Refits, frequent and
    # small, release nothing.
    releases = []
    monkeypatch.setattr(poller_module, "release_freed_heap", lambda: releases.append(1) or True)
    url = store(tmp_path)
    controller = StepController(config(skip_idle_draft_extend=False, warmup_steps=30))
    poller = ControlPoller(controller, url, poll_s=60.0, start=False, heap_release_s=0)
    context = iter(range(50, 1000))
    for _ in range(2 * FIRST_REFIT_ROWS):
        ticket = controller.begin(BatchView(("a",), (next(context),)))
        controller.finish(ticket, outcome(ticket, 40.0 + 10.0 * ticket.decision.shape.steps))
    assert poller.poll().model_source == "refit"
    controller.begin(BatchView(("a",), (next(context),)))
    poller.poll()
    assert releases == []
    version = activate_trained_version(url, controller)
    assert poller.poll().policy_version == version
    assert poller.poll() is None and releases == []  # not applied yet
    controller.begin(BatchView(("a",), (next(context),)))
    assert not controller.updates_pending
    poller.poll()
    assert releases == [1]
    poller.poll()
    assert releases == [1]  # once per version
    with get_engine(url).begin() as conn:
        conn.exec_driver_sql("UPDATE policies SET active = 0")
    assert poller.poll().model_source == "refit"  # the rollback
    controller.begin(BatchView(("a",), (next(context),)))
    poller.poll()
    assert releases == [1, 1]


def test_the_freed_heap_is_released_on_a_clock_as_well(tmp_path, monkeypatch):
    # The decode loop's freed tensors leave the heap's high-water mark resident: a release every
    # heap_release_s, counted from the last one, a version's included.
    releases = []
    monkeypatch.setattr(poller_module, "release_freed_heap", lambda: releases.append(1) or True)
    url = store(tmp_path)
    poller = ControlPoller(StepController(config()), url, poll_s=60.0, start=False,
                           heap_release_s=0.5)  # fmt: skip
    poller.poll()
    assert releases == []
    time.sleep(0.6)
    poller.poll()
    poller.poll()
    assert releases == [1]
    time.sleep(0.6)
    poller.poll()
    assert releases == [1, 1]


@pytest.mark.parametrize("preload", ["system", "tcmalloc"])
def test_release_freed_heap_returns_free_pages_to_the_system(preload):
    # 128 MB of 64 KiB blocks (below glibc's mmap threshold: they come from the heap), freed
    # under a block that stays: the heap cannot shrink from its top, so the pages stay resident
    # until released. tcmalloc keeps freed spans mapped until asked, the same way.
    script = textwrap.dedent(
        """
        import numpy as np
        from sglang_adatree.telemetry.poller import release_freed_heap

        def rss_mb():
            for line in open("/proc/self/status"):
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) / 1024

        blocks = [np.ones(8192) for _ in range(2000)]
        kept = np.ones(8192)
        del blocks
        freed = rss_mb()
        released = release_freed_heap()
        print(released, freed - rss_mb())
        """
    )
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload == "tcmalloc":
        library = allocator.find_tcmalloc()
        if library is None:
            pytest.skip("tcmalloc is not installed")
        env["LD_PRELOAD"] = str(library)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    if out[0] == "False":
        pytest.skip("this C library has no malloc_trim")
    assert float(out[1]) > 64.0
