"""``adatree simulate`` end to end on the smoke scenarios (parametric traces, the H100 roofline):
seconds, in CI."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from sglang_adatree import cli
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES
from sglang_adatree.lab import sources
from sglang_adatree.lab.hardware import analytic_gpu_profile
from sglang_adatree.lab.scenarios import all_scenarios

FIELDS = {
    "policy", "scenario", "goodput_tok_s", "tpot_ms_p50", "tpot_ms_p99", "accept_len_mean",
    "steps", "shape_shares", "ratio_to_oracle_static", "ratio_to_per_step_oracle",
}  # fmt: skip


def test_list_prints_one_scenario_a_line_name_first(capsys):
    assert cli.main(["simulate", "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == list(all_scenarios())


def test_a_small_scenario_end_to_end(tmp_path, capsys):
    out, page = tmp_path / "rows.json", tmp_path / "report.html"
    args = ["simulate", "--scenario", "smoke-h100-c1", "--quiet"]
    assert cli.main([*args, "--out", str(out), "--html", str(page)]) == 0
    rows = json.loads(out.read_text())
    policies = {r["policy"] for r in rows}
    assert {"ar", "adatree", "turbospec", "sglang-adaptive", "oracle-static",
            "per-step-oracle"} <= policies  # fmt: skip
    assert any(p.startswith("static:") for p in policies)
    assert all(set(r) >= FIELDS for r in rows)
    by = {r["policy"]: r for r in rows}
    assert by["oracle-static"]["ratio_to_oracle_static"] == 1.0
    assert by["per-step-oracle"]["ratio_to_per_step_oracle"] == 1.0
    assert abs(sum(by["adatree"]["shape_shares"].values()) - 1.0) < 1e-3
    gap = by["adatree"]["gap_by_cause"]  # the causes add up to the gap to the per-step oracle
    assert set(gap) == {"acceptance", "step-time", "exploration", "switching", "rest"}
    assert sum(gap.values()) == pytest.approx(
        1 - by["adatree"]["ratio_to_per_step_oracle"], abs=2e-3
    )
    # Every policy that runs the step controller says how its predictions held; the
    # references predict nothing.
    controlled = {"adatree", "turbospec", "sglang-adaptive"}
    assert all(
        ("estimates" in r) == (r["policy"] in controlled or "+" in r["policy"]) for r in rows
    )
    estimates = by["adatree"]["estimates"]
    assert 0 < estimates["chosen_steps"] <= by["adatree"]["steps"]
    assert estimates["declined_steps"] >= 0
    assert "declined_bias" in estimates and "declined_time_bias" in estimates
    bias = estimates["chosen_predicted"] / estimates["chosen_emitted"] - 1
    assert estimates["chosen_bias"] == pytest.approx(bias, abs=2e-4)
    assert "shapes chosen over time" in page.read_text()
    printed = capsys.readouterr().out
    assert "adatree" in printed and "estimates: chosen speculative steps" in printed
    assert "nan" not in printed  # a kind of step that never ran is left out, not printed as NaN
    assert "chosen speculative steps, predicted over emitted tokens" in printed
    # Deterministic: the same command gives the same rows.
    again = tmp_path / "again.json"
    assert cli.main([*args, "--out", str(again)]) == 0
    assert json.loads(again.read_text()) == rows


def test_a_profile_file_replaces_the_scenarios_profile(tmp_path):
    """``--profile FILE``: the step times of a profile file (a machine twice as slow here)."""
    h100 = analytic_gpu_profile("h100-sxm", DEFAULT_CANDIDATES)
    slow = dataclasses.replace(h100, name="h100-half-speed", ms=h100.ms * 2.0)
    slow.save(tmp_path / "slow.json")
    args = ["simulate", "--scenario", "smoke-h100-c1", "--quiet", "--no-decompose"]
    base, halved = tmp_path / "base.json", tmp_path / "halved.json"
    assert cli.main([*args, "--out", str(base)]) == 0
    assert cli.main([*args, "--profile", str(tmp_path / "slow.json"), "--out", str(halved)]) == 0
    before = {r["policy"]: r for r in json.loads(base.read_text())}
    after = {r["policy"]: r for r in json.loads(halved.read_text())}
    assert after["ar"]["profile"].startswith("h100-half-speed")
    for policy in ("ar", "static:3,1,4"):
        ratio = after[policy]["goodput_tok_s"] / before[policy]["goodput_tok_s"]
        # Not exactly half: the machine's slow drift is a walk on a fixed time grid, so a run
        # twice as long meets more of it.
        assert ratio == pytest.approx(0.5, rel=0.02)
        assert after[policy]["steps"] == before[policy]["steps"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "nope"], "unknown scenario nope"),
        (["--scenario", "smoke-h100-c1", "--profile-from-db", "sqlite:////nonexistent/x.db"], ""),
        (["--scenario", "smoke-h100-c1", "--profile", "/nonexistent/p.json"], "not found"),
        (["--scenario", "smoke-h100-c1", "--profile", "b200"], "known "),
    ],
)
def test_bad_input_is_refused_with_a_message(args, message, capsys):
    assert cli.main(["simulate", *args, "--quiet"]) == 2
    assert message in capsys.readouterr().err


def test_a_file_that_is_not_a_profile_is_refused(tmp_path, capsys):
    (tmp_path / "rows.json").write_text(json.dumps([{"policy": "ar"}]))
    args = ["simulate", "--scenario", "smoke-h100-c1", "--quiet", "--profile"]
    assert cli.main([*args, str(tmp_path / "rows.json")]) == 2
    assert "not a step-time profile" in capsys.readouterr().err


def test_a_profiled_start_prices_adatree_by_the_profile(tmp_path, monkeypatch):
    """``--profiled-start 0.3``: adatree starts from the scenario's own profile, each shape
    30% off; a configured ``step_time_profile`` of that same profile gives the same run, as
    a server would. (At 0 error the H100's roofline is what the online refit learns anyway.)"""
    args = ["simulate", "--scenario", "smoke-h100-c1", "--quiet", "--no-decompose"]
    paths = {name: tmp_path / f"{name}.json" for name in ("refit", "profiled", "configured")}
    assert cli.main([*args, "--out", str(paths["refit"])]) == 0
    assert cli.main([*args, "--profiled-start", "0.3", "--out", str(paths["profiled"])]) == 0
    scenario = all_scenarios()["smoke-h100-c1"]
    profile = sources.load_profile(scenario.profile, scenario.candidates)
    sources.profiled_start(profile, 0.3, scenario.sim.seed).save(tmp_path / "deployment.json")
    monkeypatch.setenv("ADATREE_STEP_TIME_PROFILE", str(tmp_path / "deployment.json"))
    assert cli.main([*args, "--out", str(paths["configured"])]) == 0
    rows = {
        name: {r["policy"]: r for r in json.loads(path.read_text())} for name, path in paths.items()
    }

    def charged(row: dict) -> dict:
        return {k: v for k, v in row.items() if k != "profile"}

    for policy in ("ar", "static:3,1,4", "oracle-static"):  # the profile prices, not charges
        assert charged(rows["profiled"][policy]) == charged(rows["refit"][policy])
    assert rows["profiled"]["ar"]["profile"].endswith(
        "priced by h100-sxm-llama8b-eagle, profiled (30% a shape)"
    )
    profiled, configured = rows["profiled"]["adatree"], rows["configured"]["adatree"]
    assert profiled["goodput_tok_s"] == pytest.approx(configured["goodput_tok_s"], rel=1e-6)
    assert profiled["shape_shares"] == configured["shape_shares"]
    assert profiled["goodput_tok_s"] != rows["refit"]["adatree"]["goodput_tok_s"]
    # Both at once is a mistake, said as such.
    assert cli.main([*args, "--profiled-start", "0.03"]) == 2


def test_a_tilt_charges_every_policy_by_the_tilted_machine(tmp_path, capsys):
    args = ["simulate", "--scenario", "smoke-h100-c1", "--no-decompose", "--profiled-start", "0.03"]
    paths = {t: tmp_path / f"tilt-{t}.json" for t in ("0", "0.5")}
    for tilt, path in paths.items():
        assert cli.main([*args, "--tilt", tilt, "--out", str(path)]) == 0
    assert "tilt 0.5" in capsys.readouterr().out  # the scenario's line says so
    level, tilted = (
        {r["policy"]: r for r in json.loads(path.read_text())} for path in paths.values()
    )
    # No speculation costs what it did; every tree costs more, so every static tree is slower.
    assert tilted["ar"]["goodput_tok_s"] == pytest.approx(level["ar"]["goodput_tok_s"])
    statics = [p for p in level if p.startswith("static:") and p != "static:0,1,1"]
    assert statics
    for policy in statics:
        assert tilted[policy]["goodput_tok_s"] < level[policy]["goodput_tok_s"]


def test_a_profiled_start_is_off_by_one_seeded_factor_a_shape():
    h100 = analytic_gpu_profile("h100-sxm", DEFAULT_CANDIDATES)
    a = sources.profiled_start(h100, 0.05, seed=3)
    ratio = a.ms / h100.ms  # [shapes, batch_sizes, context_lens]
    per_shape = ratio[:, :1, :1]
    np.testing.assert_allclose(ratio, np.broadcast_to(per_shape, ratio.shape), rtol=1e-12)
    assert len(set(np.round(per_shape.ravel(), 9))) == len(h100.shapes)
    np.testing.assert_array_equal(sources.profiled_start(h100, 0.05, seed=3).ms, a.ms)
    assert not np.array_equal(sources.profiled_start(h100, 0.05, seed=4).ms, a.ms)
    with pytest.raises(sources.SourceError, match="in \\[0, 1\\]"):
        sources.profiled_start(h100, -0.1, seed=3)


def test_the_loss_split_in_another_order(tmp_path, capsys):
    out = tmp_path / "rows.json"
    order = "step-time,acceptance,exploration,switching"
    args = ["simulate", "--scenario", "smoke-h100-c1", "--quiet", "--decompose-order", order]
    assert cli.main([*args, "--out", str(out)]) == 0
    by = {r["policy"]: r for r in json.loads(out.read_text())}
    assert list(by["adatree"]["gap_by_cause"]) == [*order.split(","), "rest"]
    assert "adatree+step-time" in by
    assert "by cause: step-time" in capsys.readouterr().out


def test_a_decomposition_order_that_misses_a_cause_is_refused(capsys):
    args = ["simulate", "--scenario", "smoke-h100-c1", "--quiet"]
    assert cli.main([*args, "--decompose-order", "step-time,acceptance"]) != 0
    assert "a decomposition order names each of" in capsys.readouterr().err
