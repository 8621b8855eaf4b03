"""scripts/replay_step_costs.py: a run's cost side rebuilt from its telemetry predicts what the
server predicted."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sqlalchemy import select
from synthetic import sample_path_stats

from sglang_adatree.config import AdaTreeConfig
from sglang_adatree.core.acceptance import AcceptedPathStats
from sglang_adatree.core.controller import BatchView, StepController, StepOutcome
from sglang_adatree.core.shapes import TreeShape, parse_candidates
from sglang_adatree.core.step_profile import TableProfile, load_profile_step_time
from sglang_adatree.telemetry.models import Run, Step
from sglang_adatree.telemetry.records import RunRecord
from sglang_adatree.telemetry.sink import TelemetrySink
from sglang_adatree.telemetry.store import session_scope

pytest_plugins = ["telemetry_fixtures"]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "replay_step_costs.py"
SHAPES = "0;1,1,2;2,2,4;3,4,8"
STEP_MS = {"0,1,1": 70.0, "1,1,2": 75.0, "2,2,4": 80.0, "3,4,8": 110.0}
HAZARDS = np.array([[0.6, 0.2, 0.1, 0.05]] * 8)


def _script():
    spec = importlib.util.spec_from_file_location("replay_step_costs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def _served_run(url: str, open_writer, steps: int, profile: str | None = None) -> None:
    """``steps`` decode steps of a step controller at concurrency 1 with noisy step times,
    recorded through the telemetry writer; refits on the step they fall due, as the replay
    runs them; priced by the step-time profile at ``profile`` when one is given."""
    config = AdaTreeConfig().replace(candidate_shapes=SHAPES, step_time_profile=profile)
    writer = open_writer(url)
    run_id = writer.start_run(
        RunRecord(
            target_model="t",
            draft_model="d",
            device="cpu",
            sglang_version=None,
            package_version="test",
            config=config.to_dict(),
            node="n",
            rank=0,
        )
    )
    model = load_profile_step_time(profile, config.candidate_shapes) if profile else None
    controller = StepController(config, sinks=[TelemetrySink(writer, run_id)], profile=model)
    rng = np.random.default_rng(0)
    context = 100
    for _ in range(steps):
        ticket = controller.begin(BatchView(("r",), (context,)))
        shape = ticket.decision.shape
        ms = STEP_MS[str(shape)] * math.exp(rng.normal(0.0, 0.15))
        paths, accepted = None, 0
        if shape.speculative:
            children, ranks = sample_path_stats(shape, 1, HAZARDS, rng)
            paths = AcceptedPathStats(torch.from_numpy(children), torch.from_numpy(ranks))
            accepted = int((ranks >= 0).sum())
        controller.finish(ticket, StepOutcome(ms, (accepted,), 0.0, paths))
        update = controller.refit()
        if update is not None:
            controller.apply(update)
        context += 1 + accepted
    assert writer.flush(timeout=10.0)
    writer.stop_run(run_id)


def test_the_replay_predicts_what_the_server_logged(sqlite_url, open_writer, capsys):
    _served_run(sqlite_url, open_writer, steps=200)
    module = _script()
    watched = (TreeShape(3, 4, 8), TreeShape(2, 2, 4))
    with session_scope(sqlite_url) as session:
        run = session.scalars(select(Run)).one()
        rows = session.scalars(select(Step).order_by(Step.step_index)).all()
        replayed = list(module.replay(rows, module.run_config(run), watched))
    assert len(replayed) == 200
    assert sum(r.refit_after for r in replayed) >= 2  # the first refit and later ones
    priced = [r for r in replayed if r.source != "catch-up"]
    assert len({r.shape for r in priced}) == 4
    after_catch_up = {r.step_index + 1 for r in replayed if r.source == "catch-up"}
    for r in priced:
        assert r.replayed_ms == _approx(r.logged_ms), r
        # A watched shape's price is this step's; a held decision was priced a step before.
        if r.shape in watched and r.step_index not in after_catch_up:
            assert r.watched_ms[watched.index(r.shape)] == _approx(r.logged_ms), r

    assert module.main(["--db", sqlite_url, "--shapes", "3,4,8;2,2,4", "--to", "5"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(line.split()[0]) for line in lines] == list(range(6))
    assert "median error 0.00%" in out


def test_a_run_priced_by_a_profile_is_replayed_from_it(sqlite_url, open_writer, tmp_path):
    shapes = parse_candidates(SHAPES + ";2,1,3")  # a watched shape the run never ran
    ms = np.array([[[60.0 + 15.0 * i + 0.01 * c for c in (64, 512)]] for i in range(len(shapes))])
    table = TableProfile("cpu", "measured", "a test", shapes, (1,), (64, 512), ms)
    path = tmp_path / "cpu.json"
    table.save(path)
    _served_run(sqlite_url, open_writer, steps=120, profile=str(path))
    module = _script()
    watched = (TreeShape(2, 1, 3),)
    with session_scope(sqlite_url) as session:
        run = session.scalars(select(Run)).one()
        rows = session.scalars(select(Step).order_by(Step.step_index)).all()
        config = module.run_config(run)
        replayed = list(module.replay(rows, config, watched))
        assert len(replayed) == 120 and not any(r.refit_after for r in replayed)
        for r in replayed:
            if r.source != "catch-up":
                assert r.replayed_ms == _approx(r.logged_ms), r
        # A profile that cannot price a watched shape stops the replay with the reason.
        table.restricted([s for s in shapes if s not in watched]).save(path)
        with pytest.raises(ValueError, match="no step times for the candidate shapes 2,1,3"):
            list(module.replay(rows, config, watched))


def test_bad_arguments_are_refused_with_a_message(sqlite_url, tmp_path, capsys):
    module = _script()
    for argv, message in (
        (["--db", sqlite_url, "--shapes", "3,x,8"], "--shapes"),
        (["--db", sqlite_url, "--shapes", "2,2,4"], "no run in"),
        (["--db", sqlite_url, "--shapes", "2,2,4", "--run", "7"], "no run 7"),
        (["--db", f"sqlite:///{tmp_path}/missing/x.sqlite", "--shapes", "2,2,4"], "x.sqlite"),
    ):
        try:
            module.main(argv)
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
        assert message in capsys.readouterr().err


def _approx(value: float | None):
    assert value is not None
    return pytest.approx(value, rel=1e-9)
