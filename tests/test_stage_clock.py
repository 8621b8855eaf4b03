"""Reading SGLang's scheduler stage clock from a Prometheus text exposition."""

from __future__ import annotations

import pytest

from sglang_adatree.tools.bench.stage_clock import ms_per_token, parse_stage_clock

LABELS = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0"'


def exposition(run_batch: float, process: float, idle: float, tokens: float) -> str:
    """A /metrics page of two tensor-parallel ranks, as SGLang writes it."""
    lines = [
        "# HELP sglang:scheduler_stage_seconds_total Wall seconds per stage.",
        "# TYPE sglang:scheduler_stage_seconds_total counter",
    ]
    for rank in (0, 1):
        for stage, seconds in (
            ("run_batch", run_batch),
            ("process_batch_result", process),
            ("idle", idle),
        ):
            lines.append(
                f'sglang:scheduler_stage_seconds_total{{category="{stage}",{LABELS},'
                f'forward_overlap="False",tp_rank="{rank}"}} {seconds / 2}'
            )
        lines.append(
            f'sglang:scheduler_stage_seconds_created{{category="run_batch",{LABELS},'
            f'forward_overlap="False",tp_rank="{rank}"}} 1.7e9'
        )
    lines.append(f'sglang:generation_tokens_total{{{LABELS},tp_rank="0"}} {tokens}')
    lines.append('sglang:per_stage_req_latency_seconds_sum{stage="prefill"} 3.0')
    return "\n".join(lines) + "\n"


def test_stages_are_summed_over_ranks_and_read_per_generated_token():
    before = parse_stage_clock(exposition(10.0, 1.0, 50.0, 100.0))
    assert before.seconds == {"run_batch": 10.0, "process_batch_result": 1.0, "idle": 50.0}
    assert before.generated_tokens == 100.0
    after = parse_stage_clock(exposition(18.0, 1.5, 90.0, 300.0))
    ms = ms_per_token(before, after)
    # 8 s and 0.5 s over 200 tokens; waiting for requests is not a cost of the tokens.
    assert ms == pytest.approx({"run_batch": 40.0, "process_batch_result": 2.5})
    assert list(ms) == ["run_batch", "process_batch_result"]


def test_a_server_without_metrics_or_without_new_tokens_is_refused():
    with pytest.raises(ValueError, match="--enable-metrics"):
        parse_stage_clock('sglang:generation_tokens_total{tp_rank="0"} 5.0\n')
    clock = parse_stage_clock(exposition(1.0, 1.0, 1.0, 10.0))
    with pytest.raises(ValueError, match="no tokens"):
        ms_per_token(clock, clock)
