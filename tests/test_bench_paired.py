"""``adatree compare``'s pure parts: the request order, the paired summary, the table, and the
telemetry databases (shared, separate, pinned) written for real with SQLite."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from sglang_adatree.cli import main
from sglang_adatree.core.shapes import DEFAULT_CANDIDATES, TreeShape
from sglang_adatree.telemetry.models import AuditLog, PinRow
from sglang_adatree.telemetry.store import session_scope
from sglang_adatree.tools.bench.configurations import parse_configurations, with_instances
from sglang_adatree.tools.bench.databases import PIN_ACTOR, database_url, prepare_database
from sglang_adatree.tools.bench.paired import (
    Sample,
    instance_lines,
    request_order,
    summarize,
    table_lines,
)


def test_the_order_reverses_every_prompt():
    names = ["ar", "adatree@0", "static:2,2,4"]
    assert request_order(0, names) == names
    assert request_order(1, names) == names[::-1]
    assert request_order(2, names) == names
    # Over any two prompts every configuration has the same mean position.
    positions = [request_order(0, names).index(n) + request_order(1, names).index(n) for n in names]
    assert len(set(positions)) == 1


def sample(prompt, name, tpot, text="same", error=None, tokens=16, verify=0, latency=None):
    if latency is None and tpot is not None:
        latency = 100.0 + prompt + tpot * (tokens - 1)
    return Sample(prompt, name, 100.0 + prompt, tpot, tokens, verify, text, error, latency)


def test_ratios_are_paired_prompt_by_prompt():
    # Prompt 1 is slow for everyone (a busy moment): the unpaired medians move, the paired
    # ratios do not.
    samples = [
        sample(0, "ar", 100.0), sample(0, "b", 90.0, verify=8),
        sample(1, "ar", 300.0), sample(1, "b", 270.0, verify=8),
        sample(2, "ar", 100.0), sample(2, "b", 120.0, verify=8),
    ]  # fmt: skip
    ar, b = summarize([("ar", "ar (no speculation)"), ("b", "b")], samples)
    assert ar.tpot_ratio == 1.0 and ar.faster == 0 and ar.accept_len is None
    assert ar.identical == ar.compared == 3 and ar.prompts == 3
    assert b.tpot_ms == 120.0 and b.ttft_ms == 101.0
    assert b.tpot_ratio == pytest.approx(0.9)
    assert (b.tpot_ratio_q1, b.tpot_ratio_q3) == pytest.approx((0.9, 1.05))
    assert b.faster == 2 and b.accept_len == pytest.approx(45 / 24)
    assert b.errors == 0 and b.identical == 3


def test_differing_answers_and_failed_requests_are_counted_not_paired():
    samples = [
        sample(0, "ar", 100.0), sample(0, "b", 80.0, text="other"),
        sample(1, "ar", 100.0), sample(1, "b", None, text="", error="HTTP 500: boom"),
        sample(2, "ar", None, error="timeout"), sample(2, "b", 50.0),
    ]  # fmt: skip
    _, b = summarize([("ar", "ar"), ("b", "b")], samples)
    assert b.errors == 1
    assert b.compared == 1 and b.identical == 0  # prompt 0 only: 1 and 2 had an error
    assert b.prompts == 1 and b.tpot_ratio == pytest.approx(0.8)
    lines = table_lines(summarize([("ar", "ar"), ("b", "b")], samples))
    assert "TPOT / ar" in lines[0]
    assert "latency / ar" in lines[0]
    assert lines[3].split() == [
        "b", "65.0", "101", "0.800x", "0.80-0.80", "1/1", "0.812x", "-", "0/1", "1"
    ]  # fmt: skip


def test_a_long_name_keeps_the_columns_in_line():
    long = "adatree+profile/new_batch_steps=1/min_gain=0.05"
    samples = [sample(0, "ar", 100.0), sample(0, long, 90.0)]
    lines = table_lines(summarize([("ar", "ar"), (long, long)], samples))
    column = lines[0].index("TPOT ms") + len("TPOT ms")
    assert lines[2][:column].endswith("100.0") and lines[3][:column].endswith("90.0")
    assert lines[3].startswith(long + " ")


def test_latency_per_token_is_paired_and_blind_to_where_the_first_token_lands():
    # The reference streams its first token a step (100 ms) late and skips the finishing
    # step, as SGLang's overlap scheduler does: the same 31 steps of 100 ms and prefill
    # as "b", yet its TPOT reads 30 / 31 of b's. Its whole latency is the same.
    steps, step_ms, prefill_ms = 32, 100.0, 250.0
    samples = []
    for p in range(3):
        ar_tpot = (steps - 2) * step_ms / (steps - 1)
        samples += [
            Sample(p, "ar", prefill_ms + step_ms, ar_tpot, steps, 0, "same", None,
                   prefill_ms + (steps - 1) * step_ms),
            Sample(p, "b", prefill_ms, step_ms, steps, 31, "same", None,
                   prefill_ms + (steps - 1) * step_ms),
        ]  # fmt: skip
    _, b = summarize([("ar", "ar"), ("b", "b")], samples)
    assert b.tpot_ratio == pytest.approx(31 / 30)
    assert b.latency_ratio == pytest.approx(1.0)
    # A failed request has no latency to pair.
    failed = Sample(3, "b", None, None, 0, 0, "", "HTTP 500", 80.0)
    assert failed.latency_per_token_ms is None


def test_a_configuration_without_usable_requests_shows_dashes():
    samples = [sample(0, "ar", 100.0), sample(0, "b", None, error="down")]
    _, b = summarize([("ar", "ar"), ("b", "b")], samples)
    assert b.tpot_ms is None and b.tpot_ratio is None and b.prompts == 0
    assert "-" in table_lines(summarize([("ar", "ar"), ("b", "b")], samples))[3]


def test_databases_shared_separate_and_pinned(tmp_path):
    ada, pinned = parse_configurations(["adatree", "adatree@2,2,4"], "eagle", DEFAULT_CANDIDATES)
    shared = f"sqlite:///{tmp_path / 'shared.sqlite'}"
    assert database_url(ada, tmp_path, shared) == shared
    own = database_url(pinned, tmp_path, shared)
    assert own != shared and own.endswith("telemetry-adatree@2,2,4.sqlite")
    assert database_url(ada, tmp_path, None).endswith("telemetry-adatree.sqlite")

    prepare_database(own, pinned)
    prepare_database(own, pinned)  # a re-run in the same work directory adds no second pin
    with session_scope(own) as session:
        pins = session.execute(select(PinRow)).scalars().all()
        audit = session.execute(select(AuditLog)).scalars().all()
    assert len(pins) == 1 and len(audit) == 1
    pin = pins[0]
    assert TreeShape(pin.steps, pin.topk, pin.num_draft_tokens) == TreeShape(2, 2, 4)
    assert (pin.min_batch_size, pin.max_batch_size, pin.cleared_at) == (None, None, None)
    assert pin.created_by == audit[0].actor == PIN_ACTOR and audit[0].action == "pin.create"

    prepare_database(shared, ada)  # migrated, nothing pinned
    with session_scope(shared) as session:
        assert session.execute(select(PinRow)).scalars().all() == []


def test_every_configuration_served_by_several_servers_each_its_own(tmp_path):
    configs = parse_configurations(["static:2,2,4", "adatree@2,2,4"], "eagle", DEFAULT_CANDIDATES)
    served = with_instances(configs, 2)
    assert [c.name for c in served] == [
        "static:2,2,4", "static:2,2,4#2", "adatree@2,2,4", "adatree@2,2,4#2",
    ]  # fmt: skip
    assert with_instances(configs, 1) == configs
    with pytest.raises(ValueError, match="at least 1"):
        with_instances(configs, 0)
    first, twin = served[2:]
    assert twin.pin == first.pin == TreeShape(2, 2, 4) and twin.kind == first.kind
    # The twin gets a database of its own, holding the same pin.
    urls = {database_url(c, tmp_path, None) for c in served}
    assert len(urls) == 4 and all("#" not in u for u in urls)
    prepare_database(database_url(twin, tmp_path, None), twin)
    with session_scope(database_url(twin, tmp_path, None)) as session:
        (pin,) = session.execute(select(PinRow)).scalars().all()
    assert TreeShape(pin.steps, pin.topk, pin.num_draft_tokens) == TreeShape(2, 2, 4)


def test_the_servers_of_one_configuration_show_their_spread():
    names = ["ar", "b", "b#2", "c"]
    samples = [
        sample(p, name, tpot)
        for p in range(3)
        for name, tpot in (("ar", 100.0), ("b", 90.0), ("b#2", 95.0), ("c", 80.0))
    ]
    summaries = summarize([(n, n) for n in names], samples)
    (line,) = instance_lines(summaries)
    assert line.startswith("b: 2 servers, TPOT / ar 0.900x-0.950x, latency ")
    assert instance_lines(summarize([("ar", "ar"), ("c", "c")], samples)) == []


def test_compare_refuses_fewer_than_one_server_a_configuration():
    with pytest.raises(SystemExit, match="--instances must be >= 1"):
        main(["compare", "--instances", "0"])
