"""Pure functions from query results to Plotly figures; no database, no Flask.

A figure is Plotly's own JSON form, ``{"data": [trace, ...], "layout": {...}}``, built as plain
dicts with numpy arrays and serialized once. Building ``plotly.graph_objects`` instead
validates every property on every request: about 100 ms for the overview here, a third of its
budget. The tests build a ``go.Figure`` from each figure, so property names are still checked.

Times go to Plotly as milliseconds since the epoch on ``date`` axes (UTC). Panels that share a
time axis are one figure with stacked y-axis domains.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from markupsafe import Markup
from plotly.io.json import to_json_plotly
from sglang_adatree.admin.queries.costs import CostReport
from sglang_adatree.admin.queries.shapes import ShapeUsage
from sglang_adatree.admin.queries.sums import Points

Figure = dict[str, Any]  # Plotly's figure JSON: {"data": [...], "layout": {...}}

FONT = {"family": "system-ui, sans-serif", "size": 12}
MARGIN = {"l": 70, "r": 20, "t": 40, "b": 40}


def _ms(unix_s: np.ndarray) -> np.ndarray:
    return np.asarray(unix_s, dtype=np.float64) * 1000.0  # [points] ms since the epoch


def _trace(kind: str, **props: Any) -> dict[str, Any]:
    return {"type": kind, **props}


def _layout(title: str, **extra: Any) -> dict[str, Any]:
    return {"title": {"text": title}, "font": FONT, "margin": MARGIN, **extra}


def _shape_key(label: str) -> tuple[int, tuple[int, ...], str]:
    try:
        return (0, tuple(int(x) for x in label.split(",")), "")
    except ValueError:
        return (1, (), label)


def _shape_order(labels: Sequence[str]) -> list[str]:
    """Shape labels in (steps, topk, num_draft_tokens) order, for categorical axes."""
    return sorted(set(labels), key=_shape_key)


# Panels of the overview, top to bottom: (field of Points, axis title, line colour).
OVERVIEW_PANELS = (
    ("goodput", "goodput (tok/s)", "#1f77b4"),
    ("accept_len", "acceptance length", "#2ca02c"),
    ("batch_size", "batch size", "#9467bd"),
    ("step_ms", "step time (ms)", "#d62728"),
)


def overview_figure(points: Points, title: str = "") -> Figure:
    """Goodput, acceptance length, batch size, step time and the chosen shape, one panel each,
    on one shared time axis."""
    n_panels = len(OVERVIEW_PANELS) + 1
    gap = 0.03
    height = (1.0 - gap * (n_panels - 1)) / n_panels
    x = _ms(points.time)
    mode = "lines" if len(points) > 300 else "lines+markers"
    traces: list[dict[str, Any]] = []
    layout = _layout(title, height=980, showlegend=False, hovermode="x unified")
    # The shared time axis sits under the bottom panel (the shape).
    layout["xaxis"] = {"type": "date", "title": {"text": "time (UTC)"}, "anchor": f"y{n_panels}"}
    for i, (field, label, colour) in enumerate(OVERVIEW_PANELS):
        axis = "y" if i == 0 else f"y{i + 1}"
        traces.append(
            _trace(
                "scatter",
                x=x,
                y=getattr(points, field),
                mode=mode,
                name=label,
                yaxis=axis,
                line={"color": colour, "width": 1.5},
            )
        )
        top = 1.0 - i * (height + gap)
        layout[f"yaxis{'' if i == 0 else i + 1}"] = {
            "domain": [top - height, top],
            "title": {"text": label},
            "rangemode": "tozero",
        }
    traces.append(
        _trace(
            "scatter",
            x=x,
            y=list(points.shape),
            mode="markers",
            name="shape",
            yaxis=f"y{n_panels}",
            marker={"size": 5, "color": "#ff7f0e"},
        )
    )
    layout[f"yaxis{n_panels}"] = {
        "domain": [0.0, height],
        "title": {"text": "chosen shape"},
        "type": "category",
        "categoryorder": "array",
        "categoryarray": _shape_order(points.shape),
    }
    return {"data": traces, "layout": layout}


def _share_matrix(
    cells: dict[str, dict[str, int]], shapes: Sequence[str], bins: Sequence[str]
) -> np.ndarray:
    """``[len(shapes), len(bins)]`` share of each bin's steps per shape (columns sum to 1)."""
    z = np.array([[cells.get(s, {}).get(b, 0) for b in bins] for s in shapes], dtype=np.float64)
    totals = z.sum(axis=0, keepdims=True)  # [1, bins]
    return np.divide(z, totals, out=np.zeros_like(z), where=totals > 0)


def usage_heatmap(usage: ShapeUsage, by: str) -> Figure:
    """Share of steps per shape in each batch-size (``by='batch'``) or acceptance-length
    (``by='accept'``) bin."""
    if by == "batch":
        bins, cells, axis = usage.batch_bins, usage.by_batch, "batch size"
    elif by == "accept":
        bins, cells, axis = usage.accept_bins, usage.by_accept, "acceptance length"
    else:
        raise ValueError(f"by must be 'batch' or 'accept', got {by!r}")
    z = _share_matrix(cells, usage.shapes, bins)
    trace = _trace(
        "heatmap",
        x=list(bins),
        y=list(usage.shapes),
        z=z,
        colorscale="Blues",
        zmin=0.0,
        zmax=1.0,
        colorbar={"title": {"text": "share of steps"}},
        hovertemplate="shape %{y}<br>" + axis + " %{x}<br>%{z:.0%} of steps<extra></extra>",
    )
    layout = _layout(
        f"Chosen shape by {axis}",
        height=420,
        xaxis={"title": {"text": axis}, "type": "category"},
        yaxis={"title": {"text": "shape"}, "type": "category"},
    )
    return {"data": [trace], "layout": layout}


def depth_figure(usage: ShapeUsage) -> Figure:
    """Per shape, the chance that a request's accepted path reaches each depth."""
    traces = [
        _trace(
            "scatter",
            x=np.arange(1, len(rates) + 1),
            y=np.asarray(rates),
            mode="lines+markers",
            name=shape,
        )
        for shape, rates in usage.depth_rate.items()
    ]
    layout = _layout(
        "Acceptance by depth",
        height=380,
        xaxis={"title": {"text": "tree depth"}, "dtick": 1},
        yaxis={"title": {"text": "accepted per request"}, "rangemode": "tozero"},
    )
    return {"data": traces, "layout": layout}


def rank_figure(usage: ShapeUsage) -> Figure:
    """Share of accepted draft tokens by sibling rank."""
    trace = _trace(
        "bar",
        x=np.arange(1, len(usage.rank_share) + 1),
        y=np.asarray(usage.rank_share),
        marker={"color": "#2ca02c"},
        name="share",
    )
    layout = _layout(
        "Acceptance by sibling rank",
        height=380,
        xaxis={"title": {"text": "sibling rank"}, "dtick": 1},
        yaxis={"title": {"text": "share of accepted draft tokens"}, "tickformat": ".0%"},
    )
    return {"data": [trace], "layout": layout}


def _by_version(report: CostReport) -> dict[str, np.ndarray]:
    versions = np.asarray(report.sample.version, dtype=object)
    return {v: versions == v for v in sorted(set(report.sample.version))}


def cost_scatter(report: CostReport) -> Figure:
    """Predicted against measured step time per policy version, with the identity line."""
    s = report.sample
    traces: list[dict[str, Any]] = [
        _trace(
            "scatter",
            x=s.measured_ms[mask],
            y=s.predicted_ms[mask],
            mode="markers",
            name=version,
            marker={"size": 4, "opacity": 0.6},
        )
        for version, mask in _by_version(report).items()
    ]
    traces.append(_identity(np.concatenate([s.measured_ms, s.predicted_ms])))
    layout = _layout(
        "Step time: predicted against measured",
        height=460,
        xaxis={"title": {"text": "measured step time (ms)"}},
        yaxis={"title": {"text": "predicted step time (ms)"}},
    )
    return {"data": traces, "layout": layout}


def accept_scatter(report: CostReport) -> Figure:
    """Predicted against measured acceptance length per policy version."""
    s = report.sample
    known = ~np.isnan(s.predicted_accept_len)  # [points]
    traces: list[dict[str, Any]] = [
        _trace(
            "scatter",
            x=s.measured_accept_len[mask & known],
            y=s.predicted_accept_len[mask & known],
            mode="markers",
            name=version,
            marker={"size": 4, "opacity": 0.6},
        )
        for version, mask in _by_version(report).items()
    ]
    values = np.concatenate([s.measured_accept_len[known], s.predicted_accept_len[known]])
    traces.append(_identity(values))
    layout = _layout(
        "Acceptance length: predicted against measured",
        height=460,
        xaxis={"title": {"text": "measured acceptance length"}},
        yaxis={"title": {"text": "predicted acceptance length"}},
    )
    return {"data": traces, "layout": layout}


def _identity(values: np.ndarray) -> dict[str, Any]:
    top = float(values.max()) if values.size else 1.0
    return _trace(
        "scatter",
        x=np.array([0.0, top]),
        y=np.array([0.0, top]),
        mode="lines",
        name="predicted = measured",
        line={"color": "#888", "dash": "dash"},
    )


def error_figure(report: CostReport) -> Figure:
    """Step-time MAPE over time, one line per policy version."""
    traces = [
        _trace("scatter", x=_ms(e.time), y=e.mape, mode="lines", name=e.version)
        for e in report.error_over_time
    ]
    layout = _layout(
        "Step-time error over time",
        height=380,
        xaxis={"type": "date", "title": {"text": "time (UTC)"}},
        yaxis={"title": {"text": "mean absolute % error"}, "tickformat": ".0%"},
    )
    return {"data": traces, "layout": layout}


# Shapes the model prices at these multiples of no speculation's time, one line each on the
# price split's figure: a small tree and a large one, for the tilt to show between them.
SPLIT_RATIOS = (1.25, 2.0)


def split_figure(report: CostReport) -> Figure:
    """How the machine priced steps against the step-time model over time: its speed (no
    speculation's time against the model's) and, for shapes the model prices at
    ``SPLIT_RATIOS`` times no speculation's, how much dearer against no speculation they are
    here than the model says (``cost_model.PriceSplit``)."""
    s = report.sample
    known = ~np.isnan(s.price_drift)  # [points]
    time = _ms(s.time[known])
    drift, tilt, offset = s.price_drift[known], s.price_tilt[known], s.price_offset[known]
    traces = [
        _trace("scatter", x=time, y=np.exp(drift), mode="lines", name="no speculation's time")
    ]
    for ratio in SPLIT_RATIOS:
        factor = np.exp(offset + np.log(ratio) * tilt)  # [points]
        name = f"a shape at {ratio:g}x no speculation's, against it"
        traces.append(_trace("scatter", x=time, y=factor, mode="lines", name=name))
    layout = _layout(
        "This machine against the step-time model",
        height=400,
        xaxis={"type": "date", "title": {"text": "time (UTC)"}},
        yaxis={"title": {"text": "times the model's"}},
        legend={"orientation": "h", "y": -0.3},
    )
    return {"data": traces, "layout": layout}


def to_json(fig: Figure) -> str:
    """The figure as JSON text (numpy arrays become lists; orjson when installed)."""
    return to_json_plotly(fig)


def to_dict(fig: Figure) -> dict[str, Any]:
    """The figure as plain JSON data, for embedding in an API answer."""
    return json.loads(to_json(fig))


def script_json(fig: Figure) -> Markup:
    """The figure as JSON that is safe inside a ``<script type="application/json">`` element:
    ``<``, ``>`` and ``&`` only occur inside JSON strings, where their escapes are equivalent."""
    text = to_json(fig)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(text)
