"""Shapes: which shapes were chosen against batch size and acceptance length; acceptance by
tree depth and by sibling rank."""

from __future__ import annotations

from flask import Blueprint, jsonify, render_template
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import charts, params, web
from sglang_adatree.admin.queries import runs
from sglang_adatree.admin.queries.shapes import shape_usage

bp = Blueprint("shapes", __name__)


@bp.get("/shapes")
def page() -> ResponseReturnValue:
    """Shape usage heatmaps and acceptance by depth and rank for the chosen run."""
    range_name = params.range_arg()
    with web.reading() as conn:
        run = web.selected_run(conn)
        usage = None
        if run is not None:
            usage = shape_usage(conn, run.id, runs.resolve_range(conn, run, range_name))
        choices = runs.run_choices(conn)
    figures = {}
    if usage is not None:
        figures = {
            "by_batch": charts.script_json(charts.usage_heatmap(usage, "batch")),
            "by_accept": charts.script_json(charts.usage_heatmap(usage, "accept")),
            "depth": charts.script_json(charts.depth_figure(usage)),
            "rank": charts.script_json(charts.rank_figure(usage)),
        }
    return render_template(
        "shapes.html",
        run=run,
        run_choices=choices,
        range_name=range_name,
        ranges=runs.RANGE_LABELS,
        usage=usage,
        figures=figures,
    )


@bp.get("/api/shapes")
def api() -> ResponseReturnValue:
    """Shape usage and acceptance by depth and rank as JSON."""
    range_name = params.range_arg()
    with web.reading() as conn:
        run = web.required_run(conn)
        usage = shape_usage(conn, run.id, runs.resolve_range(conn, run, range_name))
    return jsonify({"run_id": run.id, **usage.to_json()})
