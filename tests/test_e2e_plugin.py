"""The plug-in end to end: real SGLang servers on the CPU, tiny seeded models.

* adatree's greedy output equals SGLang's own non-speculative server's, token for token, while
  the shape changes every step (a warm-up that never ends cycles chain, trees and no
  speculation; telemetry shows which ran);
* one telemetry row per decode step; ``/server_info`` and ``/metrics`` carry adatree's state
  and the telemetry writer's counters;
* speculation right after a step without speculation drafts from a caught-up draft;
* a pin written to the store is obeyed within a second, and clearing it hands control back;
* greedy steps without speculation run as the target's plain decode; sampled ones (temperature
  0.8) take SGLang's one-token verify and complete with well-formed output;
* bad input (a candidate set, a draft, a flag, a database, a step-time profile) is refused at
  start-up with a message, before any model is loaded.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
import requests
from sglang_servers import (
    adatree_command,
    free_port,
    reference_command,
    run_to_exit,
    sglang_server,
)
from sqlalchemy import func, insert, select, update
from test_grafana_dashboard import DASHBOARD, metric_names
from test_grafana_dashboard import queries as dashboard_queries

from sglang_adatree.core.confidence import BIN_EDGES
from sglang_adatree.core.policy import DecisionSource
from sglang_adatree.core.shapes import parse_candidates
from sglang_adatree.core.step_profile import TableProfile
from sglang_adatree.telemetry.models import PinRow, Run, Step
from sglang_adatree.telemetry.store import get_engine, upgrade

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a quiet village by the sea,",
    "def fibonacci(n):",
    "Three primes:",
]
MAX_NEW_TOKENS = 32
# Chain, two trees with topk > 1, and no speculation. A warm-up longer than the test cycles
# through them in order, one per decode step, so the shape really changes every step.
CANDIDATES = "0;3,1,4;2,2,4;4,4,8"
PINNED = "2,2,4"


def _greedy(server, prompts=PROMPTS, max_new_tokens=MAX_NEW_TOKENS):
    out = server.generate(
        {
            "text": list(prompts),
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        }
    )
    return out


@pytest.fixture(scope="module")
def reference_ids(tiny_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("reference") / "server.log"
    port = free_port()
    with sglang_server(reference_command(tiny_models.target, port), log) as server:
        return [r["output_ids"] for r in _greedy(server)]


@pytest.fixture(scope="module")
def db_url(tmp_path_factory) -> str:
    url = f"sqlite:///{tmp_path_factory.mktemp('telemetry') / 'adatree.sqlite'}"
    upgrade(url)
    return url


@pytest.fixture(scope="module")
def adatree(tiny_models, db_url, tmp_path_factory):
    log = tmp_path_factory.mktemp("adatree") / "server.log"
    env = {
        "ADATREE_DB_URL": db_url,
        "ADATREE_WARMUP_STEPS": "100000",
        "ADATREE_CONTROL_POLL_S": "0.2",
        "ADATREE_TELEMETRY_FLUSH_S": "0.05",
    }
    command = adatree_command(
        tiny_models.target,
        tiny_models.draft,
        free_port(),
        "--candidate-shapes",
        CANDIDATES,
        "--enable-metrics",
    )
    with sglang_server(command, log, env=env) as server:
        yield server


def _steps_since(db_url: str, since: float) -> list[tuple]:
    time.sleep(0.5)  # the writer flushes every 50 ms here
    with get_engine(db_url).connect() as conn:
        return conn.execute(
            select(Step.steps, Step.topk, Step.num_draft_tokens, Step.decision_source)
            .where(Step.wall_time >= since)
            .order_by(Step.step_index)
        ).all()


def _plain_decode_steps(server) -> int:
    return server.server_info()["internal_states"][0]["adatree_plain_decode_steps"]


def test_greedy_output_equals_reference_while_shape_changes(adatree, reference_ids, db_url):
    started = time.time()
    plain_before = _plain_decode_steps(adatree)
    outputs = _greedy(adatree)
    assert [r["output_ids"] for r in outputs] == reference_ids
    # Greedy steps without speculation ran as the target's plain decode.
    assert _plain_decode_steps(adatree) > plain_before
    shapes = {(s, k, n) for s, k, n, _ in _steps_since(db_url, started)}
    assert (0, 1, 1) in shapes, "no speculation never ran"
    assert any(k == 1 and s > 0 for s, k, _ in shapes), "no chain ran"
    assert any(k > 1 for _, k, _ in shapes), "no tree with topk > 1 ran"
    assert len(shapes) >= 3


def test_one_step_row_per_decode_step(adatree, db_url):
    started = time.time()
    out = adatree.generate(
        {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 20, "temperature": 0}}
    )
    verify_steps = out["meta_info"]["spec_verify_ct"]
    assert verify_steps > 0
    assert len(_steps_since(db_url, started)) == verify_steps
    # Each row holds how the machine priced steps against the model when it was decided.
    with get_engine(db_url).connect() as conn:
        split = conn.execute(
            select(Step.price_drift, Step.price_tilt, Step.price_offset).where(
                Step.wall_time >= started
            )
        ).all()
    assert len(split) == verify_steps and all(None not in row for row in split)


def test_speculation_after_no_speculation_drafts_from_a_caught_up_draft(adatree, db_url):
    # The warm-up cycles 0 -> 2,2,4 -> 3,1,4 -> 4,4,8. The step without speculation skips the
    # draft's extend (skip_idle_draft_extend, on by default), so the 2,2,4 after it would draft
    # from SGLang's placeholder input and accept nothing; a catch-up step comes between.
    started = time.time()
    _greedy(adatree)
    time.sleep(0.5)
    with get_engine(db_url).connect() as conn:
        rows = conn.execute(
            select(Step.steps, Step.decision_source, Step.accepted_tokens)
            .where(Step.wall_time >= started)
            .order_by(Step.step_index)
        ).all()
    after_catch_up = [
        rows[i + 1] for i in range(len(rows) - 1) if rows[i].decision_source == "catch-up"
    ]
    assert len(after_catch_up) >= 3
    for i, row in enumerate(rows):
        if row.decision_source == "catch-up":
            assert i > 0 and rows[i - 1].steps == 0 and rows[i - 1].decision_source != "catch-up"
            assert row.steps == 0
    assert all(r.steps > 0 for r in after_catch_up)
    # About half of this draft's tokens agree with the target's: from placeholder inputs
    # (before catch-ups existed) every one of these steps accepted 0 tokens.
    assert sum(r.accepted_tokens for r in after_catch_up) > 0


def test_server_info_and_metrics(adatree):
    _greedy(adatree, PROMPTS[:1], 8)
    state = adatree.server_info()["internal_states"][0]
    assert state["adatree_shape"] in [*CANDIDATES.split(";"), "0,1,1"]
    assert state["adatree_decision_source"] in {str(s) for s in DecisionSource}
    assert "adatree_policy_version" in state
    assert state["adatree_recent_accept_length"] >= 1.0
    # None until the cost model has seen enough steps to tell, then a fraction of a step.
    assert state["adatree_step_noise"] is None or 0.0 < state["adatree_step_noise"] < 5.0
    assert set(state["adatree_price_split"]) == {"drift", "tilt", "offset"}
    assert len(state["adatree_draft_confidence"]) == len(BIN_EDGES) + 1
    time.sleep(0.5)  # the writer flushes every 50 ms here
    state = adatree.server_info()["internal_states"][0]
    # Every finished step is a row (nothing dropped, rejected or held on a healthy database).
    assert state["adatree_telemetry_rows_written"] == state["adatree_steps"] > 0
    assert state["adatree_telemetry_queued"] == state["adatree_telemetry_dropped"] == 0
    assert state["adatree_telemetry_database_down"] is False
    time.sleep(1.5)  # the writer's health is sampled into /metrics once a second
    metrics = requests.get(f"{adatree.url}/metrics", timeout=30).text
    for series in (
        "adatree_decode_steps_total",
        "adatree_unfinished_steps_total",
        "adatree_telemetry_queued_records",
        "adatree_telemetry_rows_written_total",
        "adatree_telemetry_write_failures_total",
        "adatree_telemetry_dropped_records_total",
        "adatree_telemetry_rejected_records_total",
        "adatree_telemetry_lost_records_total",
        "adatree_telemetry_database_down",
        "adatree_verify_steps_total",
        "adatree_accepted_tokens_total",
        "adatree_drafted_tokens_total",
        "adatree_steps_total",
        "adatree_current_shape",
        "adatree_step_time_ms",
    ):
        assert series in metrics, f"{series} missing from /metrics"
    # Every series the Grafana dashboard queries is on a real server's /metrics.
    dashboard = json.loads(DASHBOARD.read_text())
    for where, expr in dashboard_queries(dashboard):
        for series in metric_names(expr):
            assert f"\n{series}{{" in metrics, f"{where}: {series} missing from /metrics"


def test_pin_is_obeyed_then_cleared(adatree, db_url):
    engine = get_engine(db_url)
    steps, topk, ndt = (int(x) for x in PINNED.split(","))
    with engine.begin() as conn:
        pin_id = conn.execute(
            insert(PinRow)
            .values(
                steps=steps,
                topk=topk,
                num_draft_tokens=ndt,
                reason="e2e test",
                created_at=time.time(),
                created_by="pytest",
            )
            .returning(PinRow.id)
        ).scalar_one()
    time.sleep(1.0)  # the server polls the store every 0.2 s here
    pinned_from = time.time()
    _greedy(adatree, PROMPTS[:2], 12)
    rows = _steps_since(db_url, pinned_from)
    assert rows and {(s, k, n) for s, k, n, _ in rows} == {(steps, topk, ndt)}
    assert {src for *_, src in rows} == {"pin"}

    with engine.begin() as conn:
        conn.execute(
            update(PinRow)
            .where(PinRow.id == pin_id)
            .values(cleared_at=time.time(), cleared_by="pytest")
        )
    time.sleep(1.0)
    cleared_from = time.time()
    _greedy(adatree, PROMPTS[:2], 12)
    rows = _steps_since(db_url, cleared_from)
    assert rows and "pin" not in {src for *_, src in rows}
    assert len({(s, k, n) for s, k, n, _ in rows}) > 1


def test_sampling_completes(adatree, db_url):
    started = time.time()
    plain_before = _plain_decode_steps(adatree)
    outputs = adatree.generate(
        {
            "text": PROMPTS,
            "sampling_params": {
                "max_new_tokens": 24,
                "temperature": 0.8,
                "top_p": 0.9,
                "top_k": 50,
            },
        }
    )
    for r in outputs:
        assert isinstance(r["text"], str)
        assert 1 <= r["meta_info"]["completion_tokens"] <= 24
        assert all(0 <= t < 49152 for t in r["output_ids"])
    # Sampled steps without speculation take SGLang's one-token verify, not the plain decode.
    assert (0, 1, 1) in {(s, k, n) for s, k, n, _ in _steps_since(db_url, started)}
    assert _plain_decode_steps(adatree) == plain_before


def test_run_row_recorded(adatree, db_url):
    with get_engine(db_url).connect() as conn:
        runs = conn.execute(select(Run.device, Run.config)).all()
        count = conn.execute(select(func.count()).select_from(Step)).scalar_one()
    assert runs and runs[-1].device == "cpu"
    assert runs[-1].config["candidate_shapes"] == ["0,1,1", "2,2,4", "3,1,4", "4,4,8"]
    assert count > 0


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown_shape", "chain (topk 1) verifies"),
        ("other_vocabulary", "vocabulary has 1024 tokens"),
        ("unsupported_flag", "--speculative-adaptive is not supported"),
        ("database", "cannot be opened"),
        ("profile", "has no step times for the candidate shapes 2,2,4"),
    ],
)
def test_bad_input_refused_at_startup(case, message, tiny_models, db_url, tmp_path):
    draft = tiny_models.draft
    extra: list[str] = []
    env = {"ADATREE_DB_URL": db_url}
    if case == "unknown_shape":
        env["ADATREE_CANDIDATE_SHAPES"] = "0;3,1,9"
    elif case == "other_vocabulary":
        draft = tiny_models.other_vocab_draft
    elif case == "unsupported_flag":
        extra = ["--speculative-adaptive"]
    elif case == "database":
        env["ADATREE_DB_URL"] = "postgresql://adatree@127.0.0.1:1/none"
    elif case == "profile":
        # A profile of no speculation and one chain cannot price the trees.
        shapes = parse_candidates("0;3,1,4")
        ms = np.full((len(shapes), 1, 1), 10.0)
        path = tmp_path / "profile.json"
        TableProfile("cpu", "measured", "a test", shapes, (1,), (64,), ms).save(path)
        env["ADATREE_CANDIDATE_SHAPES"] = "0;3,1,4;2,2,4"
        env["ADATREE_STEP_TIME_PROFILE"] = str(path)
    command = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tiny_models.target),
        "--speculative-draft-model-path",
        str(draft),
        "--speculative-algorithm",
        "adatree",
        "--device",
        "cpu",
        "--disable-cuda-graph",
        "--port",
        str(free_port()),
        *extra,
    ]
    result = run_to_exit(command, env=env, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert message in output, output[-3000:]
    assert "Scheduler hit an exception" not in output
