"""Cost model: predicted against measured step time and acceptance length, and the error over
time, per policy version; how the machine priced steps against the step-time model."""

from __future__ import annotations

from flask import Blueprint, jsonify, render_template
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import charts, params, web
from sglang_adatree.admin.queries import runs
from sglang_adatree.admin.queries.costs import cost_report

bp = Blueprint("cost_model", __name__)


@bp.get("/cost-model")
def page() -> ResponseReturnValue:
    """Prediction error of each policy version for the chosen run."""
    range_name = params.range_arg()
    with web.reading() as conn:
        run = web.selected_run(conn)
        report = None
        if run is not None:
            report = cost_report(conn, run.id, runs.resolve_range(conn, run, range_name))
        choices = runs.run_choices(conn)
    figures = {}
    if report is not None:
        figures = {
            "step_time": charts.script_json(charts.cost_scatter(report)),
            "error": charts.script_json(charts.error_figure(report)),
            "accept": charts.script_json(charts.accept_scatter(report)),
            "split": charts.script_json(charts.split_figure(report)),
        }
    return render_template(
        "cost_model.html",
        run=run,
        run_choices=choices,
        range_name=range_name,
        ranges=runs.RANGE_LABELS,
        report=report,
        figures=figures,
    )


@bp.get("/api/cost-model")
def api() -> ResponseReturnValue:
    """Predicted against measured, per policy version, as JSON."""
    range_name = params.range_arg()
    with web.reading() as conn:
        run = web.required_run(conn)
        report = cost_report(conn, run.id, runs.resolve_range(conn, run, range_name))
    return jsonify({"run_id": run.id, **report.to_json()})
