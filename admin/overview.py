"""Overview: goodput, acceptance length, batch size, step time and the chosen shape over time
for one run, refreshed live by the page's script from ``/api/overview``."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, render_template, url_for
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import charts, params, web
from sglang_adatree.admin.queries import runs, timeseries
from sqlalchemy import Connection

from sglang_adatree.telemetry import control

bp = Blueprint("overview", __name__)


def _overview(conn: Connection, run: runs.RunSummary, range_name: str) -> dict[str, Any]:
    tr = runs.resolve_range(conn, run, range_name)
    data = timeseries.overview(conn, run.id, tr, web.state().granules)
    active_pins, _ = control.list_pins(conn)
    return {
        "overview": data,
        "active_pins": len(active_pins),
        "active_policy_version": control.active_version(conn),
    }


@bp.get("/")
def page() -> ResponseReturnValue:
    """The overview page of the chosen run."""
    range_name = params.range_arg()
    with web.reading() as conn:
        run = web.selected_run(conn)
        context = _overview(conn, run, range_name) if run is not None else {}
        choices = runs.run_choices(conn)
    figure = None
    api_url = None
    if run is not None:
        figure = charts.script_json(charts.overview_figure(context["overview"].points))
        api_url = url_for("overview.api", run=run.id)
    return render_template(
        "overview.html",
        run=run,
        run_choices=choices,
        range_name=range_name,
        ranges=runs.RANGE_LABELS,
        figure=figure,
        api_url=api_url,
        refresh_s=web.REFRESH_S,
        **context,
    )


@bp.get("/api/overview")
def api() -> ResponseReturnValue:
    """The overview as JSON; ``figure=1`` adds the Plotly figure the page draws."""
    range_name = params.range_arg()
    with_figure = params.flag_arg("figure")
    with web.reading() as conn:
        run = web.required_run(conn)
        context = _overview(conn, run, range_name)
    data = context.pop("overview")
    out = {**data.to_json(), **context}
    if with_figure:
        out["figure"] = charts.overview_figure(data.points)
    # Plotly's encoder: the figure's numpy arrays go out without a round trip through lists.
    return Response(charts.to_json(out), mimetype="application/json")
