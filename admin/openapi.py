"""The OpenAPI 3.0 document of the JSON API, served at ``/api/openapi.json``.

Written by hand next to the views it describes; a test checks that every ``/api/`` route is in
it and every documented path is routed, and fuzzes each operation (no answer may be a 5xx).
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, jsonify
from flask.typing import ResponseReturnValue
from sglang_adatree.admin import params
from sglang_adatree.admin.queries.runs import DEFAULT_RANGE, RANGES

from sglang_adatree.tools import retrain

bp = Blueprint("openapi", __name__)

INT_ID = {"type": "integer", "minimum": 1, "maximum": params.MAX_ID}
NULLABLE_INT = {"type": "integer", "nullable": True}
NUMBER = {"type": "number"}
NULLABLE_NUMBER = {"type": "number", "nullable": True}


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = list(required)
    return out


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict[str, Any]:
    words = {
        400: "bad parameter or body",
        401: "not logged in",
        403: "CSRF token missing or wrong",
        404: "unknown run, version, pin or job",
        409: "conflicts with the current state",
        415: "body is not JSON",
        422: "shape not in the candidate set",
    }
    return {str(c): {**_json(_ref("Error"), words[c])} for c in (400, 401, *codes)}


QUERY_RUN = {
    "name": "run",
    "in": "query",
    "required": False,
    "description": "run id (default: the latest run)",
    "schema": INT_ID,
}
QUERY_RANGE = {
    "name": "range",
    "in": "query",
    "required": False,
    "description": "time range ending at the run's newest data",
    "schema": {"type": "string", "enum": list(RANGES), "default": DEFAULT_RANGE},
}
QUERY_FIGURE = {
    "name": "figure",
    "in": "query",
    "required": False,
    "description": "also return the Plotly figure the page draws",
    "schema": {"type": "boolean", "default": False},
}


def _path_id(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": INT_ID}


def _get(
    summary: str, schema: str, parameters: list[dict[str, Any]], *errors: int
) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "parameters": parameters,
            "responses": {"200": _json(_ref(schema), "OK"), **_errors(*errors)},
        }
    }


def _post(
    summary: str,
    schema: str,
    status: int,
    parameters: list[dict[str, Any]],
    body: str | None,
    *errors: int,
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "parameters": parameters,
        "security": [{"session": [], "csrf": []}],
        "responses": {str(status): _json(_ref(schema), "OK"), **_errors(403, 415, *errors)},
    }
    if body is not None:
        op["requestBody"] = {
            "required": body == "PinCreate",
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return {"post": op}


SCHEMAS: dict[str, Any] = {
    "Error": _obj({"error": {"type": "string"}, "status": {"type": "integer"}}, ("error",)),
    "Run": _obj(
        {
            "id": {"type": "integer"},
            "started_at": NUMBER,
            "stopped_at": NULLABLE_NUMBER,
            "target_model": {"type": "string"},
            "draft_model": {"type": "string", "nullable": True},
            "device": {"type": "string"},
            "node": {"type": "string"},
            "rank": {"type": "integer"},
            "dropped_steps": {"type": "integer"},
            "rejected_steps": {"type": "integer"},
            "unfinished_steps": {"type": "integer"},
            "last_step_index": NULLABLE_INT,
            "candidate_shapes": {"type": "array", "items": {"type": "string"}},
        },
        ("id", "started_at", "target_model"),
    ),
    "RunList": _obj({"runs": {"type": "array", "items": _ref("Run")}}, ("runs",)),
    "Overview": _obj(
        {
            "run_id": {"type": "integer"},
            "range": {"type": "object"},
            "resolution": _obj(
                {
                    "tier": {"type": "string", "enum": ["step", "scan", "granules"]},
                    "bucket_s": NULLABLE_NUMBER,
                    "rolled_up": {"type": "boolean"},
                    "points": {"type": "integer"},
                }
            ),
            "summary": {"type": "object"},
            "latest": {"type": "object", "nullable": True},
            "series": _obj(
                {
                    name: {"type": "array", "items": {"type": "number"}}
                    for name in ("time", "goodput", "accept_len", "batch_size", "step_ms")
                }
                | {"shape": {"type": "array", "items": {"type": "string"}}}
            ),
            "active_pins": {"type": "integer"},
            "active_policy_version": NULLABLE_INT,
            "figure": {"type": "object", "description": "with figure=true"},
        },
        ("run_id", "series", "summary"),
    ),
    "Shapes": _obj(
        {
            "run_id": {"type": "integer"},
            "num_steps": {"type": "integer"},
            "shapes": {"type": "array", "items": {"type": "string"}},
            "by_batch_size": {"type": "object"},
            "by_accept_len": {"type": "object"},
            "acceptance_by_depth": {"type": "object"},
            "acceptance_by_rank": {"type": "array", "items": NUMBER},
            "runner_ups": {
                "type": "array",
                "description": "per shape run, the candidates priced next best on its steps",
                "items": {"type": "object"},
            },
        },
        ("run_id", "shapes"),
    ),
    "CostModel": _obj(
        {
            "run_id": {"type": "integer"},
            "versions": {"type": "array", "items": {"type": "object"}},
            "sample": {"type": "object"},
            "error_over_time": {"type": "array", "items": {"type": "object"}},
        },
        ("run_id", "versions"),
    ),
    "Policy": _obj(
        {
            "version": {"type": "integer"},
            "created_at": NUMBER,
            "training_rows": {"type": "integer"},
            "artifact_bytes": {"type": "integer"},
            "validation_metrics": {"type": "object"},
            "active": {"type": "boolean"},
            "activated_at": NULLABLE_NUMBER,
            "activated_by": {"type": "string", "nullable": True},
        },
        ("version", "active"),
    ),
    "PolicyList": _obj(
        {"active_version": NULLABLE_INT, "policies": {"type": "array", "items": _ref("Policy")}}
    ),
    "Pin": _obj(
        {
            "id": {"type": "integer"},
            "shape": {"type": "string"},
            "min_batch_size": NULLABLE_INT,
            "max_batch_size": NULLABLE_INT,
            "reason": {"type": "string"},
            "created_at": NUMBER,
            "created_by": {"type": "string"},
            "cleared_at": NULLABLE_NUMBER,
            "cleared_by": {"type": "string", "nullable": True},
            "active": {"type": "boolean"},
        },
        ("id", "shape", "active"),
    ),
    "PinList": _obj(
        {
            "active": {"type": "array", "items": _ref("Pin")},
            "cleared": {"type": "array", "items": _ref("Pin")},
            "candidates": {"type": "object"},
        }
    ),
    "PinCreate": {
        **_obj(
            {
                "shape": {
                    "type": "string",
                    "description": "'steps,topk,num_draft_tokens' or '0'; a candidate shape",
                    "example": "3,2,6",
                },
                "min_batch_size": {**NULLABLE_INT, "minimum": 1, "maximum": params.MAX_BATCH_SIZE},
                "max_batch_size": {**NULLABLE_INT, "minimum": 1, "maximum": params.MAX_BATCH_SIZE},
                "reason": {"type": "string", "minLength": 1, "maxLength": params.MAX_REASON_CHARS},
            },
            ("shape", "reason"),
        ),
        "additionalProperties": False,
    },
    "Empty": {"type": "object", "additionalProperties": False},
    "RetrainRequest": {
        **_obj(
            {
                "force": {"type": "boolean", "default": False},
                "run_id": {**NULLABLE_INT, "minimum": 1, "maximum": params.MAX_ID},
                "min_rows": {
                    "type": "integer",
                    "minimum": retrain.MIN_ROWS_FLOOR,
                    "maximum": retrain.MAX_TRAINING_ROWS,
                    "default": retrain.DEFAULT_MIN_ROWS,
                },
            }
        ),
        "additionalProperties": False,
    },
    "Job": _obj(
        {
            "id": {"type": "integer"},
            "status": {
                "type": "string",
                "enum": ["queued", "running", "succeeded", "refused", "failed"],
            },
            "progress": NUMBER,
            "error": {"type": "string", "nullable": True},
            "rows_used": NULLABLE_INT,
            "policy_version": NULLABLE_INT,
            "force": {"type": "boolean"},
            "finished": {"type": "boolean"},
            "policy": {"type": "object", "nullable": True},
        },
        ("id", "status", "progress"),
    ),
    "JobList": _obj({"jobs": {"type": "array", "items": _ref("Job")}}),
    "AuditList": _obj({"entries": {"type": "array", "items": {"type": "object"}}}),
}

DOCUMENT: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {
        "title": "adatree admin API",
        "version": "1",
        "description": "Read telemetry and control a running adatree server. Log in at /login "
        "(form fields name, token, csrf_token) for the session cookie; state-changing calls "
        "also need the session's CSRF token in the X-CSRF-Token header.",
    },
    "components": {
        "schemas": SCHEMAS,
        "securitySchemes": {
            "session": {"type": "apiKey", "in": "cookie", "name": "adatree_session"},
            "csrf": {"type": "apiKey", "in": "header", "name": "X-CSRF-Token"},
        },
    },
    "security": [{"session": []}],
    "paths": {
        "/api/runs": _get("Runs, newest first", "RunList", []),
        "/api/runs/{run_id}": _get("One run", "Run", [_path_id("run_id")], 404),
        "/api/overview": _get(
            "Goodput, acceptance length, batch size, step time and shape over time",
            "Overview",
            [QUERY_RUN, QUERY_RANGE, QUERY_FIGURE],
            404,
        ),
        "/api/shapes": _get(
            "Chosen shapes by batch size and acceptance; acceptance by depth and rank",
            "Shapes",
            [QUERY_RUN, QUERY_RANGE],
            404,
        ),
        "/api/cost-model": _get(
            "Predicted against measured step time and acceptance, per policy version",
            "CostModel",
            [QUERY_RUN, QUERY_RANGE],
            404,
        ),
        "/api/policies": _get("Policy versions, newest first", "PolicyList", []),
        "/api/policies/{version}/activate": _post(
            "Activate a policy version", "Policy", 200, [_path_id("version")], "Empty", 404, 409
        ),
        "/api/policies/rollback": _post(
            "Re-activate the version activated before the current one",
            "Policy",
            200,
            [],
            "Empty",
            409,
        ),
        "/api/pins": {
            **_get("Active and recently cleared pins, and the candidate set", "PinList", []),
            **_post("Pin a candidate shape", "Pin", 201, [], "PinCreate", 422),
        },
        "/api/pins/{pin_id}/clear": _post(
            "Clear a pin", "Pin", 200, [_path_id("pin_id")], "Empty", 404, 409
        ),
        "/api/retrain": {
            **_get("Recent retrain jobs, newest first", "JobList", []),
            **_post(
                "Start a retrain job in the background", "Job", 202, [], "RetrainRequest", 404, 409
            ),
        },
        "/api/retrain/{job_id}": _get("One retrain job", "Job", [_path_id("job_id")], 404),
        "/api/audit": _get("Audit log, newest first", "AuditList", []),
    },
}


@bp.get("/api/openapi.json")
def document() -> ResponseReturnValue:
    """This API's OpenAPI document."""
    return jsonify(DOCUMENT)
