"""The benchmark's pure parts: loads, workloads, configurations, rows, comparisons, reports,
telemetry readout and server process management (with a real, tiny HTTP process)."""

import dataclasses
import itertools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, NO_SPEC, ShapeError, TreeShape
from sglang_adatree.tools.bench.client import Load, PointResult, RequestResult, poisson_offsets
from sglang_adatree.tools.bench.commands import split_items
from sglang_adatree.tools.bench.configurations import (
    DEFAULT_SWEEP,
    Models,
    ServerSettings,
    chains_of,
    detect_draft_kind,
    parse_configurations,
    with_instances,
)
from sglang_adatree.tools.bench.report import (
    bound_lines,
    table_lines,
    top_shapes,
    write_html,
    write_json,
)
from sglang_adatree.tools.bench.results import (
    ROW_FIELDS,
    compare,
    geomean,
    make_row,
    percentile,
    with_speedups,
)
from sglang_adatree.tools.bench.servers import (
    ServerError,
    ephemeral_range,
    free_port,
    how_it_ended,
    running_server,
    stop_process_group,
)
from sglang_adatree.tools.bench.steps import (
    EMPTY,
    StepPoint,
    read_steps,
    shape_goodputs,
    summarize_steps,
)
from sglang_adatree.tools.bench.workloads import (
    HIGH_ACCEPTANCE_PROMPTS,
    LOW_ACCEPTANCE_PROMPTS,
    load_workload,
)

# -- loads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, kind, value, shown",
    [("c4", "concurrency", 4, "c4"), ("concurrency:16", "concurrency", 16, "c16"),
     ("r0.5", "rate", 0.5, "r0.5"), ("rate:2", "rate", 2, "r2")],
)  # fmt: skip
def test_load_parse(text, kind, value, shown):
    load = Load.parse(text)
    assert (load.kind, load.value, str(load)) == (kind, value, shown)
    assert Load.parse(str(load)) == load


@pytest.mark.parametrize("text", ["4", "x2", "c0", "r-1", "c2.5", "c"])
def test_load_parse_rejects(text):
    with pytest.raises(ValueError):
        Load.parse(text)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = poisson_offsets(4000, rate=2.0, seed=7)
    assert a == poisson_offsets(4000, rate=2.0, seed=7)
    assert a != poisson_offsets(4000, rate=2.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.5, rel=0.05)  # mean gap 1 / rate


# -- workloads ------------------------------------------------------------------------------------


def test_named_sets_are_seeded_draws():
    first = load_workload("mtbench", 5, seed=0)
    assert first == load_workload("mtbench", 5, seed=0)
    assert first.prompts != load_workload("mtbench", 5, seed=1).prompts
    assert len(first) == 5 and len(set(first.prompts)) == 5 and first.phases == ("",) * 5
    gsm = load_workload("gsm8k", 3)
    assert gsm.name == "gsm8k" and all("?" in p or "." in p for p in gsm.prompts)
    assert load_workload("humaneval", 2).prompts[0].startswith("Complete this Python function")


def test_jsonl_prompts_cycle_when_the_file_is_short(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", "id": 3}\n')
    workload = load_workload(str(path), 5)
    assert workload.name == "mine"
    assert sorted(set(workload.prompts)) == ["a", "b"] and len(workload) == 5
    path.write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match=r"mine\.jsonl:1: no string 'prompt'"):
        load_workload(str(path), 1)
    with pytest.raises(ValueError, match="neither a named set"):
        load_workload(str(tmp_path / "missing.jsonl"), 1)


def test_transition_alternates_low_and_high_phases():
    workload = load_workload("transition", 10)
    assert workload.phases == ("low-1",) * 3 + ("high-1",) * 3 + ("low-2",) * 2 + ("high-2",) * 2
    for prompt, phase in zip(workload.prompts, workload.phases, strict=True):
        pool = LOW_ACCEPTANCE_PROMPTS if phase.startswith("low") else HIGH_ACCEPTANCE_PROMPTS
        assert prompt in pool


# -- configurations -------------------------------------------------------------------------------


def models(tmp_path, kind="standalone"):
    return Models(tmp_path / "target", tmp_path / "draft", kind)


def flag(command, name):
    return command[command.index(name) + 1]


def test_policies_expand_and_deduplicate():
    items = split_items("ar,static:3,1,4,static:sweep,static:default,turbospec,adatree,ar")
    assert items == [
        "ar", "static:3,1,4", "static:sweep", "static:default", "turbospec", "adatree", "ar",
    ]  # fmt: skip
    configs = parse_configurations(items, "standalone", DEFAULT_CANDIDATES)
    names = [c.name for c in configs]
    # STANDALONE's default is 3,1,4: static:default runs it, the explicit copies are dropped.
    assert "static:3,1,4" not in names
    assert {f"static:{s}" for s in DEFAULT_SWEEP if s != TreeShape(3, 1, 4)} <= set(names)
    assert names[0] == "ar" and names[-3:] == ["static:default", "turbospec", "adatree"]
    eagle = parse_configurations(["static:3,1,4", "static:default"], "eagle", DEFAULT_CANDIDATES)
    assert [c.name for c in eagle] == ["static:3,1,4", "static:default"]  # EAGLE's is 5,4,8
    with pytest.raises(ValueError, match="unknown policy"):
        parse_configurations(["eagle"], "standalone", DEFAULT_CANDIDATES)
    with pytest.raises(ValueError, match="must speculate"):
        parse_configurations(["static:0"], "standalone", DEFAULT_CANDIDATES)


def test_adatree_with_its_own_candidates_or_a_pin():
    items = split_items("ar,adatree:0;3,1,4,adatree@2,2,4,adatree@0,static:2,2,4,adatree")
    assert items == [
        "ar",
        "adatree:0;3,1,4",
        "adatree@2,2,4",
        "adatree@0",
        "static:2,2,4",
        "adatree",
    ]
    _, own, pinned, no_spec, _, ada = parse_configurations(items, "eagle", DEFAULT_CANDIDATES)
    assert own.name == "adatree:0,1,1;3,1,4" and own.pin is None
    assert own.candidate_shapes == (NO_SPEC, TreeShape(3, 1, 4))
    assert pinned.name == "adatree@2,2,4" and pinned.pin == TreeShape(2, 2, 4)
    assert no_spec.pin == NO_SPEC and no_spec.slug == "adatree@0,1,1"
    # A pinned server keeps the whole candidate set, as an operator's pin does.
    assert pinned.candidate_shapes == ada.candidate_shapes == DEFAULT_CANDIDATES
    m = models(Path("/m"), "eagle")
    assert pinned.label(m) == "adatree@2,2,4 (adatree serve, pinned to 2,2,4)"
    assert own.label(m) == "adatree:0,1,1;3,1,4 (adatree serve, candidates 0,1,1; 3,1,4)"
    cmd = own.command(m, ServerSettings(), 1, None)
    assert flag(cmd, "--candidate-shapes") == "0,1,1;3,1,4"
    with pytest.raises(ValueError, match="not a candidate shape; pin one of"):
        parse_configurations(["adatree@7,1,8"], "eagle", DEFAULT_CANDIDATES)
    with pytest.raises(ShapeError):
        parse_configurations(["adatree:0"], "eagle", DEFAULT_CANDIDATES)  # nothing speculates


def test_adatree_priced_by_a_profile_names_it(tmp_path):
    ada, profiled = parse_configurations(
        ["adatree", "adatree+profile"], "eagle", DEFAULT_CANDIDATES, "/p/cpu.json"
    )
    m = models(Path("/m"), "eagle")
    assert profiled.candidate_shapes == ada.candidate_shapes and profiled.decides
    assert profiled.label(m) == "adatree+profile (adatree serve, step times from /p/cpu.json)"
    assert flag(profiled.command(m, ServerSettings(), 1, None), "--step-time-profile") == (
        "/p/cpu.json"
    )
    assert "--step-time-profile" not in ada.command(m, ServerSettings(), 1, None)
    with pytest.raises(ValueError, match="--step-time-profile FILE"):
        parse_configurations(["adatree+profile"], "eagle", DEFAULT_CANDIDATES)


def test_adatree_servers_take_settings_side_by_side():
    assert split_items("ar,adatree@2,2,4/min_gain=0.05,adatree+profile/new_batch_steps=1") == [
        "ar",
        "adatree@2,2,4/min_gain=0.05",
        "adatree+profile/new_batch_steps=1",
    ]
    plain, one, two = parse_configurations(
        ["adatree+profile", "adatree+profile/new_batch_steps=1", "adatree@0/min_gain=0.05"],
        "eagle",
        DEFAULT_CANDIDATES,
        "/p/cpu.json",
    )
    assert one.name == "adatree+profile/new_batch_steps=1" and one.decides
    assert one.step_time_profile == plain.step_time_profile and one.slug != plain.slug
    twin = with_instances([one], 2)[1]
    assert "/" not in twin.slug
    assert twin.label(models(Path("/m"), "eagle")).startswith("adatree+profile#2 (adatree serve")
    assert one.env(ServerSettings())["ADATREE_NEW_BATCH_STEPS"] == "1"
    assert "ADATREE_NEW_BATCH_STEPS" not in plain.env(ServerSettings())
    assert two.pin == NO_SPEC and two.env(ServerSettings())["ADATREE_MIN_GAIN"] == "0.05"
    assert one.command(models(Path("/m"), "eagle"), ServerSettings(), 1, None) == (
        plain.command(models(Path("/m"), "eagle"), ServerSettings(), 1, None)
    )
    assert one.label(models(Path("/m"), "eagle")) == (
        "adatree+profile (adatree serve, step times from /p/cpu.json) with new_batch_steps=1"
    )
    for bad, message in [
        ("adatree/new_batch_steps", "is not KEY=VALUE"),
        ("adatree/new_batch_steps=-1", "allowed"),
        ("adatree/no_such=1", "unknown setting"),
        ("adatree/candidate_shapes=0;1,1,2", "set by the configuration itself"),
        ("static:2,2,4/min_gain=0.1", "adatree serve configurations only"),
        ("ar/min_gain=0.1", "adatree serve configurations only"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_configurations([bad], "eagle", DEFAULT_CANDIDATES)


def test_commands_as_a_user_would_run_them(tmp_path):
    m, s = models(tmp_path), ServerSettings(max_total_tokens=4096, threads=2)
    ar, static, default, adaptive, turbo, ada = parse_configurations(
        ["ar", "static:2,2,4", "static:default", "sglang-adaptive", "turbospec", "adatree"],
        "standalone",
        DEFAULT_CANDIDATES,
    )
    cmd = ar.command(m, s, 1234, None)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--speculative-algorithm" not in cmd
    assert flag(cmd, "--attention-backend") == "adatree_cpu" and flag(cmd, "--port") == "1234"
    assert flag(cmd, "--max-total-tokens") == "4096"
    cmd = static.command(m, s, 1, None)
    assert flag(cmd, "--speculative-algorithm") == "STANDALONE"
    assert [flag(cmd, f"--speculative-{f}") for f in ("num-steps", "eagle-topk")] == ["2", "2"]
    assert flag(cmd, "--speculative-num-draft-tokens") == "4"
    assert "--speculative-num-steps" not in default.command(m, s, 1, None)
    assert default.label(m) == "static:default (SGLang STANDALONE, shape 3,1,4)"
    for config, policy in ((adaptive, "sglang-adaptive"), (turbo, "turbospec")):
        cmd = config.command(m, s, 1, "sqlite:///x.db")
        assert cmd[-len(cmd) :][1] == "serve" and flag(cmd, "--db") == "sqlite:///x.db"
        assert flag(cmd, "--candidate-shapes") == "0,1,1;1,1,2;2,1,3;3,1,4;5,1,6"
        assert config.env(s)["ADATREE_POLICY"] == policy
        assert "re-implemented by sglang-adatree" in config.label(m)
    assert len(flag(ada.command(m, s, 1, None), "--candidate-shapes").split(";")) == 12
    assert {k: v for k, v in ada.env(s).items() if k != "LD_PRELOAD"} == {
        "OMP_NUM_THREADS": "2",
        "TOKENIZERS_PARALLELISM": "false",
        "ADATREE_POLICY": "adatree",
        "ADATREE_RECORD_STEPS": "true",
    }
    assert chains_of(DEFAULT_CANDIDATES)[0] == NO_SPEC


def test_an_eagle_head_gets_sglangs_builtin_adaptive_and_its_token_map(tmp_path):
    m = models(tmp_path, "eagle")
    m.draft.mkdir()
    (m.draft / "token_map.pt").write_bytes(b"")
    (adaptive,) = parse_configurations(["sglang-adaptive"], "eagle", DEFAULT_CANDIDATES)
    cmd = adaptive.command(m, ServerSettings(), 1, None)
    assert flag(cmd, "--speculative-algorithm") == "EAGLE" and "--speculative-adaptive" in cmd
    assert flag(cmd, "--speculative-eagle-topk") == "1"
    assert flag(cmd, "--speculative-token-map") == str(m.draft / "token_map.pt")
    assert adaptive.label(m) == "sglang-adaptive (SGLang EAGLE --speculative-adaptive)"


@pytest.mark.parametrize(
    "architectures, kind",
    [(["LlamaForCausalLM"], "standalone"), (["LlamaForCausalLMEagle"], "eagle"),
     (["LlamaForCausalLMEagle3"], "eagle3"), ([], "standalone")],
)  # fmt: skip
def test_draft_kind_matches_the_plugins_rule(tmp_path, architectures, kind):
    from sglang_adatree.sglang.spec_algo import detect_draft_kind as plugin_rule

    (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
    assert detect_draft_kind(tmp_path) == plugin_rule(str(tmp_path)) == kind


# -- rows and comparisons -------------------------------------------------------------------------


def request(i, tokens, verify, ttft=100.0, latency=1100.0, phase="", error=None, steady=None):
    return RequestResult(i, phase, 0.0, ttft, latency, tokens, verify, error, steady)


def test_row_from_requests():
    point = PointResult(
        (
            request(0, 11, 5, ttft=100, latency=1100, phase="low-1"),
            request(1, 21, 5, ttft=300, latency=2300, phase="high-1"),
            request(2, 0, 0, ttft=None, latency=50, error="HTTP 500"),
        ),
        started_at=1000.0,
        finished_at=1004.0,
    )
    row = make_row("adatree", "adatree", "transition", "c2", [point], EMPTY, machine_load_1m=1.5)
    assert row.goodput_tok_s == pytest.approx(32 / 4.0)
    assert row.accept_len_mean == pytest.approx(32 / 10)
    assert row.tpot_ms_p50 == pytest.approx((100.0 + 100.0) / 2)  # 1000/10 and 2000/20
    assert row.ttft_ms_p50 == pytest.approx(200.0)
    assert row.errors == 1 and row.num_requests == 3 and row.output_tokens == 32
    assert row.accept_len_by_phase == {"low-1": 11 / 5, "high-1": 21 / 5}
    assert row.shapes == {} and row.num_steps == 0 and row.accept_len_steps is None
    static = make_row("static:3,1,4", "s", "mtbench", "c1", [point], EMPTY, "3,1,4")
    assert static.shapes == {"3,1,4": 0}


def test_a_rows_tpot_reads_the_streams_steady_tpot_where_it_had_one():
    point = PointResult(
        (request(0, 11, 5, steady=80.0), request(1, 11, 5), request(2, 1, 1, steady=80.0)),
        started_at=1000.0,
        finished_at=1004.0,
    )
    assert [r.tpot_ms for r in point.requests] == [80.0, 100.0, None]
    row = make_row("ar", "ar", "mtbench", "c1", [point], EMPTY)
    assert row.tpot_ms_p50 == pytest.approx(90.0)


def test_repeated_points_report_the_median_goodput():
    def point(seconds):
        return PointResult((request(0, 10, 10),), 0.0, seconds)

    row = make_row("ar", "ar", "w", "c1", [point(1.0), point(4.0), point(2.0)], EMPTY)
    assert row.goodput_tok_s == 5.0 and row.rounds == 3
    assert row.goodput_tok_s_rounds == (10.0, 2.5, 5.0)
    assert row.accept_len_mean == 1.0  # no speculation: one token per step


def test_percentile_interpolates():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert geomean([2.0, 8.0]) == pytest.approx(4.0) and math.isnan(geomean([]))


def table_rows(goodput):
    """Rows from {(policy, workload, load): goodput}, one token per second of duration."""
    rows = []
    for (policy, workload, load), g in goodput.items():
        p = PointResult((request(0, int(g * 10), int(g * 10)),), 0.0, 10.0)
        rows.append(make_row(policy, policy, workload, load, [p], EMPTY))
    return with_speedups(rows)


def test_compare_finds_the_oracle_and_the_best_single_static_shape():
    rows = table_rows(
        {
            ("ar", "a", "c1"): 10, ("ar", "a", "c8"): 40,
            ("static:3,1,4", "a", "c1"): 20, ("static:3,1,4", "a", "c8"): 30,
            ("static:1,1,2", "a", "c1"): 15, ("static:1,1,2", "a", "c8"): 44,
            ("turbospec", "a", "c1"): 16, ("turbospec", "a", "c8"): 40,
            ("adatree", "a", "c1"): 19.5, ("adatree", "a", "c8"): 44,
        }
    )  # fmt: skip
    assert [r.speedup_vs_ar for r in rows if r.policy == "adatree"] == [1.95, 1.1]
    c = compare(rows)
    assert c.oracle == {("a", "c1"): ("static:3,1,4", 20.0), ("a", "c8"): ("static:1,1,2", 44.0)}
    assert c.best_single_static == "static:1,1,2"  # geomean 25.7 beats 24.5
    assert c.ratios["adatree"][("a", "c1")]["oracle"] == pytest.approx(0.975)
    verdicts = {g.text.split(" ", 1)[1]: g.met for g in c.goals}
    assert verdicts == {
        ">= 0.95x the oracle static shape at every point": True,
        ">= 1.10x the best single static shape (geometric mean)": True,  # sqrt(1.3 * 1.0)
        ">= 1.0x ar at every point": True,
        "ahead of sglang-adaptive (geometric mean)": None,
        "ahead of turbospec (geometric mean)": True,
    }
    worse = table_rows({("ar", "a", "c1"): 10, ("adatree", "a", "c1"): 9.5})
    (oracle, single, ar, *_) = compare(worse).goals
    assert oracle.met is None and single.met is None and ar.met is False
    assert ar.detail == "worst point 0.950x"


# -- reports --------------------------------------------------------------------------------------


def test_json_rows_carry_the_interface_fields_and_html_inlines_plotly(tmp_path):
    rows = table_rows({("ar", "mtbench", "c1"): 10, ("adatree", "mtbench", "c1"): 12})
    rows[1] = dataclasses.replace(rows[1], shapes={"3,1,4": 30, "0,1,1": 10})
    write_json(rows, tmp_path / "rows.json")
    loaded = json.loads((tmp_path / "rows.json").read_text())
    assert [r["policy"] for r in loaded] == ["ar", "adatree"]
    assert all(set(ROW_FIELDS) <= set(r) for r in loaded)
    assert loaded[1]["speedup_vs_ar"] == pytest.approx(1.2) and loaded[1]["ttft_ms_p99"] == 100.0
    assert top_shapes(rows[1]) == "3,1,4 75% 0,1,1 25%"
    lines = table_lines(rows)
    assert lines[0].startswith("policy") and "3,1,4 75%" in lines[2] and len(lines) == 3
    timelines = {"adatree": [(100.0, "3,1,4", "mtbench", "c1"), (100.5, "0,1,1", "mtbench", "c1")]}
    write_html(rows, compare(rows), timelines, {"command": "adatree bench"}, tmp_path / "r.html")
    page = (tmp_path / "r.html").read_text()
    assert "shapes chosen over time" in page and "adatree bench" in page
    assert "<script src" not in page and len(page) > 1_000_000  # plotly.js inlined


# -- telemetry readout ----------------------------------------------------------------------------


def test_steps_of_a_point_from_the_store(tmp_path):
    from step_records import make_step

    from sglang_adatree.telemetry import store
    from sglang_adatree.telemetry.records import RunRecord
    from sglang_adatree.telemetry.writer import TelemetryWriter

    url = f"sqlite:///{tmp_path / 't.sqlite'}"
    store.upgrade(url)
    writer = TelemetryWriter(url, flush_s=0.05)
    run_id = writer.start_run(RunRecord("t", "d", "cpu", None, "0", {}, "n", 0))
    shapes = [(3, 1, 4), (3, 1, 4), (0, 1, 1), (3, 1, 4)]
    for i, (s, k, n) in enumerate(shapes):
        step = make_step(run_id, i)
        writer.record(
            dataclasses.replace(
                step, wall_time=1000.0 + i, steps=s, topk=k, num_draft_tokens=n,
                batch_size=2, emitted_tokens=4 if s else 2, decision_source="model",
                measured_step_ms=10.0 * (i + 1),
            )
        )  # fmt: skip
    writer.close()
    steps = read_steps(url, run_id, 1000.5, 1003.0)  # the first step is outside the window
    assert [s.shape for s in steps] == ["3,1,4", "0,1,1", "3,1,4"]
    summary = summarize_steps(steps)
    assert summary.shape_counts == {"3,1,4": 2, "0,1,1": 1} and summary.top_shape == "3,1,4"
    assert summary.accept_len == pytest.approx(10 / 6) and summary.batch_size_mean == 2.0
    assert summary.step_ms_p50 == 30.0 and summary.source_counts == {"model": 3}
    # 3,1,4: 8 tokens in 20 + 40 ms; 0,1,1 has one step only, below MIN_SHAPE_STEPS.
    assert summary.step_tok_s == pytest.approx(1000 * 10 / 90)
    assert shape_goodputs(steps, min_steps=1)[0].shape == "3,1,4"
    assert [g.shape for g in summary.by_shape] == []  # 2 steps of 3,1,4: also below 3
    store.get_engine(url).dispose()


def test_physical_bound_is_the_best_measured_shape():
    def step(shape: str, ms: float, emitted: int, batch: int = 1) -> StepPoint:
        return StepPoint(0.0, batch, shape, "model", ms, emitted)

    steps = [step("0,1,1", 90.0, 1) for _ in range(10)]
    steps += [step("1,1,2", 110.0, 1), step("1,1,2", 110.0, 2), step("1,1,2", 130.0, 2)]
    steps += [step("3,2,6", 200.0, 4), step("3,2,6", 210.0, 3)]  # too few steps to count
    summary = summarize_steps(steps)
    assert [g.shape for g in summary.by_shape] == ["1,1,2", "0,1,1"]
    best = summary.bound
    assert best.shape == "1,1,2" and best.num_steps == 3 and best.step_ms_p50 == 110.0
    assert best.accept_len == pytest.approx(5 / 3)
    assert best.tok_s == pytest.approx(1000 * 5 / 350)
    assert summary.by_shape[1].tok_s == pytest.approx(1000 / 90)
    point = PointResult((request(0, 10, 10),), 0.0, 10.0)
    row = make_row("adatree", "adatree", "mtbench", "c1", [point], summary)
    assert row.bound_shape == "1,1,2" and row.bound_tok_s == pytest.approx(best.tok_s)
    assert row.shape_goodput["0,1,1"]["steps"] == 10
    lines = bound_lines([row, make_row("ar", "ar", "mtbench", "c1", [point], EMPTY)])
    assert len(lines) == 2 and "bound 1,1,2 14.3 tok/s" in lines[1]
    assert f"adatree {summary.step_tok_s:.1f}" in lines[1]


# -- server processes -----------------------------------------------------------------------------

# A stand-in server with a child process, like SGLang's launcher and scheduler: it answers
# /health after a short start-up and writes its child's pid where the test can read it.
FAKE_SERVER = """
import http.server, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[2], "w").write(str(child.pid))
time.sleep(0.5)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_a_server_and_its_children_are_stopped(tmp_path):
    port, pid_file = free_port(), tmp_path / "child.pid"
    command = [sys.executable, "-c", FAKE_SERVER, str(port), str(pid_file)]
    with running_server(command, {}, port, tmp_path / "s.log", timeout_s=60) as server:
        assert server.url == f"http://127.0.0.1:{port}" and server.process.poll() is None
        child = int(pid_file.read_text())
        assert alive(child)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.process.poll() is not None and not alive(child)


def test_a_server_that_dies_reports_its_log(tmp_path):
    command = [sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"]
    with (
        pytest.raises(ServerError, match=r"exited with code 3(.|\n)*bad flag --foo"),
        running_server(command, {}, free_port(), tmp_path / "s.log", timeout_s=60),
    ):
        pass


def test_a_server_killed_after_start_up_says_how(tmp_path):
    port, pid_file = free_port(), tmp_path / "child.pid"
    command = [sys.executable, "-c", FAKE_SERVER, str(port), str(pid_file)]
    with running_server(command, {}, port, tmp_path / "s.log", timeout_s=60) as server:
        server.check_alive("fake")  # healthy and running
        os.killpg(server.process.pid, signal.SIGKILL)  # as the out-of-memory killer would
        server.process.wait(timeout=10)
        with pytest.raises(ServerError, match=r"fake: the server ended by signal 9.*out-of-memory"):
            server.check_alive("fake")
    # A launcher whose child was killed exits on its own; its log says which.
    died = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    died.wait(timeout=10)
    log = tmp_path / "launcher.log"
    log.write_text("Subprocess scheduler_0 (pid=1) crashed with exit code -9.\n")
    assert how_it_ended(died, log).startswith("exited with code 1; a process of it was killed")
    log.write_text("bad flag --foo\n")
    assert how_it_ended(died, log) == "exited with code 1"


def test_server_ports_avoid_theephemeral_range():
    lo, hi = ephemeral_range()
    for _ in range(20):
        port = free_port()
        assert not lo <= port <= hi
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed


def test_a_server_whose_port_was_taken_is_reported_at_once(tmp_path):
    # SGLang logs the failed bind and its processes stay up; waiting for /health would take
    # the whole start-up timeout.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = (
            "import sys, time; print('ERROR: [Errno 98] error while attempting to bind on "
            "address: address already in use', flush=True); time.sleep(600)"
        )
        started = time.monotonic()
        with (
            pytest.raises(ServerError, match="port was taken"),
            running_server([sys.executable, "-c", script], {}, port, tmp_path / "s.log", 300),
        ):
            pass
    assert time.monotonic() - started < 60


def test_an_interrupted_stop_still_kills_the_group(tmp_path, monkeypatch):
    # A server that ignores SIGTERM, and a second signal arriving during the grace period:
    # the group gets its SIGKILL anyway.
    script = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    time.sleep(0.5)
    real_wait = process.wait
    calls = []

    def interrupted(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_wait(timeout=timeout)

    monkeypatch.setattr(process, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        stop_process_group(process, grace_s=30)
    assert real_wait(timeout=10) == -signal.SIGKILL
