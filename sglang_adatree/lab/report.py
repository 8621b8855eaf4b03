"""The lab's outputs: JSON rows, the terminal table, the grid's summary and the HTML report.

One row per (scenario, policy) with the fields ``adatree simulate --out`` promises: ``policy,
scenario, goodput_tok_s, tpot_ms_p50, tpot_ms_p99, accept_len_mean, steps, shape_shares,
ratio_to_oracle_static, ratio_to_per_step_oracle`` and what the scenario replayed; adatree's row
also splits its gap to the per-step oracle by cause (``gap_by_cause``), and every policy that
runs the step controller says how its predictions held on the steps it ran (``estimates``,
``simulator.EstimateErrors``). The summary names the best single static shape over the grid
(the one with the best geometric mean of its ratio to each scenario's oracle static shape) and
adatree's geometric-mean ratios to it, to the oracle static shape and to the per-step oracle,
its worst ratio to ``ar``, and how far its predictions ran above what its chosen speculative
steps emitted.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly
import plotly.graph_objects as go

from sglang_adatree.lab.runner import ScenarioResult
from sglang_adatree.lab.scenarios import Scenario
from sglang_adatree.lab.simulator import EstimateErrors

SHOWN = ("adatree", "oracle-static", "ar", "turbospec", "sglang-adaptive", "per-step-oracle")


@dataclass(frozen=True)
class Replayed:
    """One scenario's result with what it replayed."""

    scenario: Scenario
    traces_label: str  # the trace set's label: name, kind, pair
    trace_kind: str  # exact or parametric
    profile_label: str  # profile name and source
    result: ScenarioResult


def rows(replayed: Sequence[Replayed]) -> list[dict[str, Any]]:
    """The JSON rows, one per scenario and policy."""
    out = []
    for rep in replayed:
        res = rep.result
        for policy, run in res.runs.items():
            out.append(
                {
                    "policy": policy,
                    "scenario": rep.scenario.name,
                    "condition": rep.scenario.condition,
                    "traces": rep.traces_label,
                    "trace_kind": rep.trace_kind,
                    "profile": rep.profile_label,
                    "load": rep.scenario.sim.arrivals.describe(),
                    "goodput_tok_s": round(run.goodput_tok_s, 4),
                    "tpot_ms_p50": round(run.tpot_ms_p50, 3),
                    "tpot_ms_p99": round(run.tpot_ms_p99, 3),
                    "accept_len_mean": round(run.accept_len_mean, 4),
                    "steps": run.steps,
                    "shape_shares": {k: round(v, 4) for k, v in run.shape_shares.items()},
                    "ratio_to_oracle_static": round(res.ratio(policy, "oracle-static"), 4),
                    "ratio_to_per_step_oracle": round(res.ratio(policy, "per-step-oracle"), 4),
                    "ratio_to_ar": round(res.ratio(policy, "ar"), 4),
                    "oracle_static_shape": res.oracle_static,
                }
            )
            if run.estimates is not None:
                out[-1]["estimates"] = _estimates_row(run.estimates)
            if policy == "adatree" and res.decomposition:
                # adatree's gap to the per-step oracle by cause, as shares of the oracle's goodput
                out[-1]["gap_by_cause"] = {k: round(v, 4) for k, v in res.decomposition.items()}
    return out


def _estimates_row(e: EstimateErrors) -> dict[str, Any]:
    def r(x: float) -> float | None:
        return round(x, 4) if math.isfinite(x) else None

    return {
        "chosen_steps": e.chosen_steps,
        "chosen_predicted": r(e.chosen_predicted),
        "chosen_emitted": r(e.chosen_emitted),
        "chosen_bias": r(e.chosen_bias),
        "explored_steps": e.explored_steps,
        "explored_bias": r(e.explored_bias),
        "declined_steps": e.declined_steps,
        "declined_bias": r(e.declined_bias),
        "declined_time_bias": r(e.declined_time_bias),
        "emitted_abs_error": r(e.emitted_abs_error),
        "step_ms_rel_error": r(e.step_ms_rel_error),
        "candidate_abs_error": r(e.candidate_abs_error),
        "shape_abs_error": r(e.shape_abs_error),
        "hindsight_abs_error": r(e.hindsight_abs_error),
    }


def _estimates_line(e: EstimateErrors) -> str:
    """The table's line under adatree's row; a kind of step that never ran is left out."""

    def bias(x: float) -> str:
        return f"{x:+.1%}" if math.isfinite(x) else "-"

    parts = [
        f"chosen speculative steps {e.chosen_steps}, emitted {e.chosen_emitted:.2f} predicted "
        f"{e.chosen_predicted:.2f} ({bias(e.chosen_bias)})",
        f"explored {e.explored_steps} ({bias(e.explored_bias)})",
    ]
    if e.declined_steps:
        parts.append(
            f"declined {e.declined_steps} (emitted {bias(e.declined_bias)}, "
            f"priced {bias(e.declined_time_bias)} against no speculation)"
        )
    parts.append(f"|error| {e.emitted_abs_error:.2f} tokens, step time {e.step_ms_rel_error:.1%}")
    if math.isfinite(e.candidate_abs_error):
        parts.append(
            f"every candidate's |error| {e.candidate_abs_error:.3f} tokens (the shape's "
            f"estimate alone {e.shape_abs_error:.3f}, fitted in hindsight "
            f"{e.hindsight_abs_error:.3f})"
        )
    return "; ".join(parts)


def geomean(values: Sequence[float]) -> float:
    finite = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in finite) / len(finite)) if finite else math.nan


@dataclass(frozen=True)
class Summary:
    scenarios: int
    best_single_static: str
    vs_oracle_static: float  # geometric mean over scenarios
    vs_best_single_static: float
    vs_per_step_oracle: float
    worst_vs_ar: float
    worst_vs_oracle_static: float
    # adatree's chosen speculative steps: predicted over emitted tokens less 1, mean over the
    # scenarios that had any
    chosen_bias: float

    def lines(self) -> list[str]:
        bias = []
        if math.isfinite(self.chosen_bias):
            bias = [
                "adatree's chosen speculative steps, predicted over emitted tokens:",
                f"  mean over scenarios          {self.chosen_bias:+.1%}",
            ]
        return [
            f"{self.scenarios} scenarios; geometric means of adatree's goodput ratio:",
            f"  to the oracle static shape   {self.vs_oracle_static:.3f}"
            f" (worst scenario {self.worst_vs_oracle_static:.3f})",
            f"  to the best single static    {self.vs_best_single_static:.3f}"
            f" ({self.best_single_static})",
            f"  to the per-step oracle       {self.vs_per_step_oracle:.3f}",
            f"  worst ratio to ar            {self.worst_vs_ar:.3f}",
            *bias,
        ]


def summarize(replayed: Sequence[Replayed]) -> Summary | None:
    results = [r.result for r in replayed if "adatree" in r.result.runs]
    if not results:
        return None
    statics = set.intersection(
        *({p for p in r.runs if p.startswith("static:") or p == "ar"} for r in results)
    )
    best = max(
        sorted(statics), key=lambda p: geomean([r.ratio(p, "oracle-static") for r in results])
    )
    adatree = [
        (r.runs["adatree"].goodput_tok_s, r) for r in results
    ]  # fmt: skip
    return Summary(
        scenarios=len(results),
        best_single_static=best,
        vs_oracle_static=geomean([r.ratio("adatree", "oracle-static") for r in results]),
        vs_best_single_static=geomean([g / r.runs[best].goodput_tok_s for g, r in adatree]),
        vs_per_step_oracle=geomean([r.ratio("adatree", "per-step-oracle") for r in results]),
        worst_vs_ar=min(r.ratio("adatree", "ar") for r in results),
        worst_vs_oracle_static=min(r.ratio("adatree", "oracle-static") for r in results),
        chosen_bias=_mean(
            [e.chosen_bias for r in results if (e := r.runs["adatree"].estimates) is not None]
        ),
    )


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def table(replayed: Sequence[Replayed]) -> str:
    """Per scenario: goodput of the policies shown and adatree's ratios; the decomposition."""
    header = (
        f"{'scenario':32s} {'adatree':>8s} {'oracle-st':>9s} {'ar':>8s} {'turbo':>8s} "
        f"{'sgl-ad':>8s} {'per-step':>8s} {'/orc-st':>7s} {'/ar':>6s} {'/p-step':>7s}"
        "  oracle static"
    )
    lines = [header, "-" * len(header)]
    for rep in replayed:
        res = rep.result
        g = {p: res.runs[p].goodput_tok_s if p in res.runs else math.nan for p in SHOWN}
        lines.append(
            f"{rep.scenario.name:32s} {g['adatree']:8.2f} {g['oracle-static']:9.2f} "
            f"{g['ar']:8.2f} {g['turbospec']:8.2f} {g['sglang-adaptive']:8.2f} "
            f"{g['per-step-oracle']:8.2f} {res.ratio('adatree', 'oracle-static'):7.3f} "
            f"{res.ratio('adatree', 'ar'):6.3f} {res.ratio('adatree', 'per-step-oracle'):7.3f}"
            f"  {res.oracle_static}"
        )
        estimates = res.runs["adatree"].estimates if "adatree" in res.runs else None
        if estimates is not None and estimates.chosen_steps:
            lines.append(f"{'':32s}   estimates: {_estimates_line(estimates)}")
        if res.decomposition and res.ratio("adatree", "oracle-static") < 1.0:
            parts = ", ".join(f"{c} {share:+.1%}" for c, share in res.decomposition.items())
            lines.append(f"{'':32s}   gap to the per-step oracle by cause: {parts}")
    summary = summarize(replayed)
    if summary is not None:
        lines += ["", *summary.lines()]
    return "\n".join(lines)


def goodput_figure(replayed: Sequence[Replayed]) -> go.Figure:
    """Goodput per policy, relative to each scenario's oracle static shape."""
    fig = go.Figure()
    names = [r.scenario.name for r in replayed]
    for policy in SHOWN:
        fig.add_trace(
            go.Bar(
                name=policy,
                x=names,
                y=[
                    r.result.ratio(policy, "oracle-static") if policy in r.result.runs else None
                    for r in replayed
                ],
            )
        )
    fig.update_layout(
        barmode="group",
        title="goodput relative to the oracle static shape",
        yaxis_title="ratio to oracle static",
        height=480,
    )
    return fig


def shapes_figure(rep: Replayed) -> go.Figure:
    """The shape adatree ran at every decode step, beside the per-step oracle's."""
    fig = go.Figure()
    for policy, symbol in (("per-step-oracle", "circle-open"), ("adatree", "circle")):
        run = rep.result.runs.get(policy)
        if run is None or not run.timeline:
            continue
        fig.add_trace(
            go.Scattergl(
                x=[t for t, _ in run.timeline],
                y=[s for _, s in run.timeline],
                mode="markers",
                marker={"symbol": symbol, "size": 4},
                name=policy,
            )
        )
    fig.update_layout(
        title=f"{rep.scenario.name}: shapes chosen over time",
        xaxis_title="simulated time (s)",
        yaxis_title="shape",
        height=360,
    )
    return fig


def write_json(replayed: Sequence[Replayed], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows(replayed), indent=1) + "\n")


def write_html(replayed: Sequence[Replayed], command: str, path: Path) -> None:
    """One self-contained HTML page: the table, the goodput chart, each scenario's shapes."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>adatree simulate</title>",
        f"<script>{plotly.offline.get_plotlyjs()}</script>",
        "<style>body{font-family:sans-serif;margin:1.5em}pre{background:#f6f6f6;"
        "padding:.5em}</style></head><body>",
        "<h1>adatree in the policy lab</h1>",
        f"<p>Command: <code>{html.escape(command)}</code></p>",
        f"<pre>{html.escape(table(replayed))}</pre>",
        goodput_figure(replayed).to_html(full_html=False, include_plotlyjs=False),
    ]
    for rep in replayed:
        parts.append(f"<p>{html.escape(rep.scenario.name)}: {html.escape(rep.traces_label)}, "
                     f"{html.escape(rep.profile_label)}</p>")  # fmt: skip
        parts.append(shapes_figure(rep).to_html(full_html=False, include_plotlyjs=False))
    parts.append("</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
