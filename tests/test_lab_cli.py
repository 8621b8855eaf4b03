"""``adatree simulate`` end to end on the smoke scenarios (parametric traces, the H100 roofline):
seconds, in CI."""

from __future__ import annotations

import json

import pytest

from sglang_adatree import cli
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
    assert "shapes chosen over time" in page.read_text()
    assert "adatree" in capsys.readouterr().out
    # Deterministic: the same command gives the same rows.
    again = tmp_path / "again.json"
    assert cli.main([*args, "--out", str(again)]) == 0
    assert json.loads(again.read_text()) == rows


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scenario", "nope"], "unknown scenario nope"),
        (["--scenario", "smoke-h100-c1", "--profile-from-db", "sqlite:////nonexistent/x.db"], ""),
    ],
)
def test_bad_input_is_refused_with_a_message(args, message, capsys):
    assert cli.main(["simulate", *args, "--quiet"]) == 2
    assert message in capsys.readouterr().err
