"""The chart builders are pure: hand-made query results in, Plotly figures out; no browser.
Each figure also goes through ``go.Figure``, which rejects any property Plotly does not know."""

from __future__ import annotations

import itertools
import json

import numpy as np
import plotly.graph_objects as go
import pytest
from sglang_adatree.admin import charts
from sglang_adatree.admin.queries.costs import CostReport, CostSample, ErrorSeries, VersionError
from sglang_adatree.admin.queries.runs import TimeRange
from sglang_adatree.admin.queries.shapes import ShapeUsage
from sglang_adatree.admin.queries.sums import Points

TR = TimeRange("1h", 1000.0, 4600.0)


def points(n: int) -> Points:
    t = 1000.0 + np.arange(n) * 10.0
    shapes = tuple("3,2,6" if i % 3 else "0,1,1" for i in range(n))
    return Points(t, np.ones(n), t / 10, np.full(n, 2.5), np.full(n, 8.0), np.full(n, 12.0), shapes)


def usage() -> ShapeUsage:
    return ShapeUsage(
        time_range=TR,
        truncated=False,
        num_steps=10,
        shapes=("0,1,1", "3,2,6"),
        batch_bins=("1", "3-4"),
        by_batch={"0,1,1": {"3-4": 3}, "3,2,6": {"1": 6, "3-4": 1}},
        accept_bins=("1.00-1.25", "2.00-2.25"),
        by_accept={"0,1,1": {"1.00-1.25": 3}, "3,2,6": {"2.00-2.25": 7}},
        depth_rate={"3,2,6": [0.8, 0.5, 0.2]},
        rank_share=[0.75, 0.25],
    )


def report() -> CostReport:
    sample = CostSample(
        time=np.array([1.0, 2.0, 3.0]),
        version=("fallback", "v1", "v1"),
        predicted_ms=np.array([10.0, 11.0, 12.0]),
        measured_ms=np.array([9.0, 11.5, 12.5]),
        predicted_accept_len=np.array([np.nan, 2.0, 2.5]),
        measured_accept_len=np.array([1.0, 2.2, 2.4]),
        price_drift=np.array([np.nan, 0.1, 0.2]),
        price_tilt=np.array([np.nan, 0.5, 0.5]),
        price_offset=np.array([np.nan, 0.0, 0.1]),
    )
    return CostReport(
        time_range=TR,
        truncated=False,
        bucket_s=2.0,
        versions=(VersionError("v1", 2, 0.04, -0.01, 0.1),),
        sample=sample,
        error_over_time=(ErrorSeries("v1", np.array([2.0, 4.0]), np.array([0.05, 0.03])),),
    )


def valid(fig: dict) -> go.Figure:
    """The figure as Plotly's validated object (raises on unknown or ill-typed properties)."""
    return go.Figure(fig)


def test_overview_has_four_series_and_the_shape_on_one_time_axis():
    fig = valid(charts.overview_figure(points(50)))
    assert [t.name for t in fig.data] == [
        "goodput (tok/s)",
        "acceptance length",
        "batch size",
        "step time (ms)",
        "shape",
    ]
    assert {t.xaxis or "x" for t in fig.data} == {"x"}  # one shared time axis
    assert fig.layout.xaxis.type == "date"
    assert fig.data[0].x[0] == 1_000_000.0  # ms since the epoch
    assert list(fig.data[0].y) == list(np.arange(50) + 100.0)
    shape_axis = fig.layout.yaxis5
    assert shape_axis.type == "category" and list(shape_axis.categoryarray) == ["0,1,1", "3,2,6"]
    domains = [fig.layout[f"yaxis{i if i > 1 else ''}"].domain for i in range(1, 6)]
    assert all(a[0] > b[1] for a, b in itertools.pairwise(domains))  # stacked


def test_overview_of_no_points_still_draws():
    fig = valid(charts.overview_figure(points(0)))
    assert len(fig.data) == 5 and len(fig.data[0].x) == 0


def test_usage_heatmap_columns_are_shares():
    fig = valid(charts.usage_heatmap(usage(), "batch"))
    [heat] = fig.data
    z = np.asarray(heat.z)
    assert list(heat.x) == ["1", "3-4"] and list(heat.y) == ["0,1,1", "3,2,6"]
    assert np.allclose(z.sum(axis=0), 1.0)
    assert z[1, 0] == 1.0 and z[0, 1] == pytest.approx(0.75)
    assert valid(charts.usage_heatmap(usage(), "accept")).data[0].x == ("1.00-1.25", "2.00-2.25")
    with pytest.raises(ValueError):
        charts.usage_heatmap(usage(), "colour")


def test_depth_and_rank_figures():
    depth = valid(charts.depth_figure(usage()))
    assert [t.name for t in depth.data] == ["3,2,6"] and list(depth.data[0].x) == [1, 2, 3]
    rank = valid(charts.rank_figure(usage()))
    assert list(rank.data[0].y) == [0.75, 0.25]


def test_cost_scatter_has_a_trace_per_version_and_the_identity_line():
    fig = valid(charts.cost_scatter(report()))
    assert [t.name for t in fig.data] == ["fallback", "v1", "predicted = measured"]
    identity = fig.data[-1]
    assert list(identity.x) == list(identity.y) == [0.0, 12.5]
    assert list(fig.data[1].x) == [11.5, 12.5] and list(fig.data[1].y) == [11.0, 12.0]


def test_split_figure_prices_speculation_against_the_model():
    fig = valid(charts.split_figure(report()))
    assert [t.name for t in fig.data] == [
        "no speculation's time",
        "a shape at 1.25x no speculation's, against it",
        "a shape at 2x no speculation's, against it",
    ]
    speed, small, large = fig.data
    assert list(speed.x) == [2000.0, 3000.0]  # the step without a split is left out
    assert list(speed.y) == pytest.approx([np.exp(0.1), np.exp(0.2)])
    assert list(small.y) == pytest.approx([1.25**0.5, np.exp(0.1) * 1.25**0.5])
    assert list(large.y) == pytest.approx([2.0**0.5, np.exp(0.1) * 2.0**0.5])


def test_accept_scatter_skips_steps_without_a_prediction():
    fig = valid(charts.accept_scatter(report()))
    assert len(fig.data[0].x) == 0  # the fallback step predicted no acceptance
    assert list(fig.data[1].y) == [2.0, 2.5]


def test_error_figure_is_a_line_per_version():
    fig = valid(charts.error_figure(report()))
    assert [t.name for t in fig.data] == ["v1"] and list(fig.data[0].x) == [2000.0, 4000.0]


def test_script_json_cannot_end_its_script_element():
    pts = points(3)
    hostile = Points(
        pts.time,
        *(getattr(pts, f) for f in Points.__dataclass_fields__ if f not in ("time", "shape")),
        shape=("</script><b>", "&", ">"),
    )
    text = str(charts.script_json(charts.overview_figure(hostile)))
    assert "</" not in text and "<" not in text and "&" not in text
    parsed = json.loads(text)
    assert "</script><b>" in parsed["data"][4]["y"]
    assert charts.to_dict(charts.overview_figure(hostile))["data"][4]["y"][0] == "</script><b>"
