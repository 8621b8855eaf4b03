"""The benchmark's outputs: the terminal table, the JSON rows and the HTML report.

The JSON file (``--out``) is a list with one object per (policy, workload, load) row carrying
at least ``results.ROW_FIELDS``. The HTML report is one self-contained file: Plotly's JavaScript
is inlined from the installed package, so it opens without a network.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.offline

from sglang_adatree.tools.bench import charts
from sglang_adatree.tools.bench.results import BenchRow, Comparison


def _num(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def top_shapes(row: BenchRow, limit: int = 3) -> str:
    """``"3,1,4 70% 0,1,1 25%"``: the most used shapes and their share of decode steps."""
    total = sum(row.shapes.values())
    if total == 0:
        return " ".join(row.shapes) or "-"
    items = list(row.shapes.items())[:limit]
    return " ".join(f"{shape} {100 * n / total:.0f}%" for shape, n in items)


TABLE_COLUMNS = (
    ("policy", 22),
    ("workload", 10),
    ("load", 5),
    ("req", 4),
    ("tokens", 6),
    ("goodput", 8),
    ("x ar", 5),
    ("TTFT50", 7),
    ("TPOT50", 7),
    ("TPOT99", 7),
    ("acc len", 7),
    ("err", 3),
    ("shapes (share of steps)", 0),
)


def table_lines(rows: Sequence[BenchRow]) -> list[str]:
    """The summary table, one line per row; times in ms, goodput in tokens/s."""

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if w else c for c, (_, w) in zip(cells, TABLE_COLUMNS, strict=True)
        ).rstrip()

    out = [line([name for name, _ in TABLE_COLUMNS])]
    for r in rows:
        out.append(
            line(
                [
                    r.policy,
                    r.workload,
                    r.load,
                    str(r.num_requests),
                    str(r.output_tokens),
                    _num(r.goodput_tok_s),
                    _num(r.speedup_vs_ar, 2),
                    _num(r.ttft_ms_p50, 0),
                    _num(r.tpot_ms_p50, 1),
                    _num(r.tpot_ms_p99, 1),
                    _num(r.accept_len_mean, 2),
                    str(r.errors),
                    top_shapes(r),
                ]
            )
        )
    return out


def comparison_lines(comparison: Comparison, subject: str = "adatree") -> list[str]:
    """Per point: the oracle static shape and the subject's ratios; then the goals."""
    out = []
    mine = comparison.ratios.get(subject, {})
    if comparison.best_single_static:
        out.append(f"best single static shape (geometric mean): {comparison.best_single_static}")
    for point in comparison.points:
        name, goodput = comparison.oracle.get(point, ("-", float("nan")))
        ratios = mine.get(point, {})
        parts = [f"{k} {v:.2f}x" for k, v in ratios.items()]
        out.append(
            f"{point[0]:>10} {point[1]:>5}: oracle {name} {_num(goodput)} tok/s; "
            f"{subject}: {', '.join(parts) or '-'}"
        )
    for goal in comparison.goals:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[goal.met]
        out.append(f"[{verdict:>6}] {goal.text}: {goal.detail}")
    return out


def bound_lines(rows: Sequence[BenchRow], subject: str = "adatree") -> list[str]:
    """Per point the subject ran: its measured per-shape goodputs and the physical bound."""
    out = []
    for r in rows:
        if r.policy != subject or r.bound_tok_s is None:
            continue
        shapes = ", ".join(
            f"{shape} {g['tok_s']:.1f} ({int(g['steps'])} steps, {g['step_ms_p50']:.0f} ms, "
            f"accept {g['accept_len']:.2f})"
            for shape, g in r.shape_goodput.items()
        )
        own = r.step_tok_s or float("nan")
        out.append(
            f"{r.workload:>10} {r.load:>5}: bound {r.bound_shape} {r.bound_tok_s:.1f} tok/s, "
            f"{subject} {own:.1f} ({own / r.bound_tok_s:.2f}x); per shape: {shapes}"
        )
    if out:
        out.insert(0, f"physical bound from {subject}'s telemetry (tokens / s of step time):")
    return out


def write_json(rows: Sequence[BenchRow], path: Path) -> None:
    """The rows as a JSON list (NaN written as null)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([_clean(r.to_dict()) for r in rows], indent=1) + "\n")


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_html(
    rows: Sequence[BenchRow],
    comparison: Comparison,
    timelines: dict[str, Sequence[tuple[float, str, str, str]]],
    meta: dict[str, Any],
    path: Path,
) -> None:
    """One self-contained HTML file: goals, the table, the charts, how it was run."""
    figures = [
        charts.metric_vs_load(rows, "goodput_tok_s"),
        charts.metric_vs_load(rows, "tpot_ms_p50"),
        charts.accept_len_bars(rows),
    ]
    if any(timelines.values()):
        figures.append(charts.shapes_over_time(timelines))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>adatree bench</title>",
        f"<script>{plotly.offline.get_plotlyjs()}</script>",
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;"
        "font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:.5em}"
        "</style></head><body>",
        "<h1>adatree against the baselines</h1>",
        "<h2>Goals</h2><pre>",
        html.escape("\n".join(comparison_lines(comparison) + bound_lines(rows))),
        "</pre><h2>Rows</h2>",
        _html_table(rows),
    ]
    for figure in figures:
        parts.append(figure.to_html(full_html=False, include_plotlyjs=False))
    parts += [
        "<h2>How it was run</h2><pre>",
        html.escape(json.dumps(_clean(meta), indent=1)),
        "</pre></body></html>",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))


def _html_table(rows: Sequence[BenchRow]) -> str:
    header = (
        "policy", "how it ran", "workload", "load", "goodput tok/s", "x ar", "TTFT p50 ms",
        "TPOT p50 ms", "TPOT p99 ms", "accept len", "accept len by phase", "shapes", "errors",
        "load avg",
    )  # fmt: skip
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>"]
    for r in rows:
        phases = " ".join(f"{k} {v:.2f}" for k, v in r.accept_len_by_phase.items())
        cells = (
            r.policy, r.label, r.workload, r.load, _num(r.goodput_tok_s), _num(r.speedup_vs_ar, 2),
            _num(r.ttft_ms_p50, 0), _num(r.tpot_ms_p50), _num(r.tpot_ms_p99),
            _num(r.accept_len_mean, 2), phases or "-", top_shapes(r), str(r.errors),
            _num(r.machine_load_1m),
        )  # fmt: skip
        out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(out) + "</table>"
