"""Plotly figures of a benchmark: pure functions from rows (and step timelines) to figures.

* ``metric_vs_load``: goodput or TPOT against load, one line per policy, one panel per
  workload;
* ``accept_len_bars``: acceptance length per point and policy;
* ``shapes_over_time``: the shape each adatree-served policy ran at every decode step, over the
  benchmark's time, coloured by workload.
"""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sglang_adatree.tools.bench.client import Load
from sglang_adatree.tools.bench.results import BenchRow

METRIC_TITLES = {
    "goodput_tok_s": "goodput (emitted tokens / s)",
    "tpot_ms_p50": "TPOT p50 (ms)",
    "tpot_ms_p99": "TPOT p99 (ms)",
    "ttft_ms_p50": "TTFT p50 (ms)",
}


def _workloads(rows: Sequence[BenchRow]) -> list[str]:
    return list(dict.fromkeys(r.workload for r in rows))


def _policies(rows: Sequence[BenchRow]) -> list[str]:
    return list(dict.fromkeys(r.policy for r in rows))


def _loads(rows: Sequence[BenchRow]) -> list[str]:
    return sorted({r.load for r in rows}, key=lambda s: Load.parse(s).sort_key)


def metric_vs_load(rows: Sequence[BenchRow], metric: str) -> go.Figure:
    """``metric`` against load, a line per policy, a panel per workload."""
    workloads = _workloads(rows)
    fig = make_subplots(rows=1, cols=max(1, len(workloads)), subplot_titles=workloads)
    loads = _loads(rows)
    for i, policy in enumerate(_policies(rows)):
        for col, workload in enumerate(workloads, start=1):
            mine = {r.load: r for r in rows if r.policy == policy and r.workload == workload}
            xs = [load for load in loads if load in mine]
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[getattr(mine[x], metric) for x in xs],
                    mode="lines+markers",
                    name=policy,
                    legendgroup=policy,
                    showlegend=col == 1,
                    line={"dash": "dot" if policy.startswith("static:") else "solid"},
                    marker={"color": _color(i)},
                    hovertext=[mine[x].label for x in xs],
                ),
                row=1,
                col=col,
            )
        fig.update_xaxes(title_text="load (c = clients, r = requests/s)")
    fig.update_yaxes(title_text=METRIC_TITLES.get(metric, metric), col=1)
    fig.update_layout(title=f"{METRIC_TITLES.get(metric, metric)} against load", height=420)
    return fig


def accept_len_bars(rows: Sequence[BenchRow]) -> go.Figure:
    """Acceptance length (SGLang's: output tokens / verify steps) per point and policy."""
    fig = go.Figure()
    for i, policy in enumerate(_policies(rows)):
        mine = [r for r in rows if r.policy == policy]
        fig.add_trace(
            go.Bar(
                x=[f"{r.workload} {r.load}" for r in mine],
                y=[r.accept_len_mean for r in mine],
                name=policy,
                marker={"color": _color(i)},
            )
        )
    fig.update_layout(
        title="acceptance length per point (emitted tokens per verify step)",
        barmode="group",
        yaxis_title="acceptance length",
        height=380,
    )
    return fig


def shapes_over_time(timelines: dict[str, Sequence[tuple[float, str, str, str]]]) -> go.Figure:
    """A panel per policy: the shape of every decode step against seconds since its start."""
    policies = [p for p, steps in timelines.items() if steps]
    fig = make_subplots(
        rows=max(1, len(policies)), cols=1, subplot_titles=policies, shared_xaxes=False
    )
    workloads = list(dict.fromkeys(w for p in policies for _, _, w, _ in timelines[p]))
    for row, policy in enumerate(policies, start=1):
        steps = timelines[policy]
        origin = min(t for t, _, _, _ in steps)
        shape_order = sorted({s for _, s, _, _ in steps}, key=_shape_key)
        for i, workload in enumerate(workloads):
            mine = [(t, s, load) for t, s, w, load in steps if w == workload]
            if not mine:
                continue
            fig.add_trace(
                go.Scattergl(
                    x=[t - origin for t, _, _ in mine],
                    y=[s for _, s, _ in mine],
                    mode="markers",
                    marker={"size": 4, "color": _color(i)},
                    name=workload,
                    legendgroup=workload,
                    showlegend=row == 1,
                    hovertext=[f"{workload} {load}" for _, _, load in mine],
                ),
                row=row,
                col=1,
            )
        fig.update_yaxes(
            title_text="shape (S,K,N)",
            categoryorder="array",
            categoryarray=shape_order,
            type="category",
            row=row,
            col=1,
        )
        fig.update_xaxes(title_text="seconds since the server's first measured step", row=row)
    fig.update_layout(title="shapes chosen over time", height=max(320, 260 * len(policies)))
    return fig


def _shape_key(shape: str) -> tuple[int, ...]:
    return tuple(int(x) for x in shape.split(","))


_PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#9467bd",
    "#ff7f0e",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def _color(i: int) -> str:
    return _PALETTE[i % len(_PALETTE)]
