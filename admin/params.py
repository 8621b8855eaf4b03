"""Request parameters: parse and bound every value from a query string, form or JSON body.

Each parser raises ``AdminError(400, ...)`` naming the parameter and what is allowed, so bad
input (wrong types, huge or negative numbers, unknown names) never reaches a query.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import request
from sglang_adatree.admin.errors import AdminError
from sglang_adatree.admin.queries.runs import DEFAULT_RANGE, RANGES

from sglang_adatree.core.shapes import ShapeError, TreeShape

MAX_ID = 2**31 - 1  # ids and versions are 32-bit integers in the schema
MAX_BATCH_SIZE = 1_000_000
MAX_REASON_CHARS = 1000
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_int(value: Any, name: str, low: int, high: int) -> int:
    """An int in ``[low, high]`` from a JSON number or a decimal string."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise AdminError(400, f"{name} must be an integer in [{low}, {high}]")
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.lstrip("-").isdigit()) or len(text) > 20:
            raise AdminError(400, f"{name} must be an integer in [{low}, {high}], got {value!r}")
        value = int(text)
    if not low <= value <= high:
        raise AdminError(400, f"{name} must be in [{low}, {high}], got {value}")
    return value


def parse_optional_int(value: Any, name: str, low: int, high: int) -> int | None:
    """``parse_int``, with ``None`` and an empty form field meaning no value."""
    if value is None or value == "":
        return None
    return parse_int(value, name, low, high)


def parse_bool(value: Any, name: str) -> bool:
    """A JSON boolean or a form value (a ticked checkbox sends ``on``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise AdminError(400, f"{name} must be true or false")


def parse_shape(value: Any, name: str = "shape") -> TreeShape:
    if not isinstance(value, str) or len(value) > 64:
        raise AdminError(400, f"{name} must be a string 'steps,topk,num_draft_tokens' or '0'")
    try:
        return TreeShape.parse(value)
    except ShapeError as exc:
        raise AdminError(400, str(exc)) from None


def parse_reason(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise AdminError(400, "reason must be a non-empty string")
    if len(value) > MAX_REASON_CHARS:
        raise AdminError(400, f"reason must be at most {MAX_REASON_CHARS} characters")
    return value.strip()


def range_arg() -> str:
    """The ``range`` query parameter (default ``DEFAULT_RANGE``)."""
    name = request.args.get("range", DEFAULT_RANGE)
    if name not in RANGES:
        raise AdminError(400, f"range must be one of {', '.join(RANGES)}, got {name!r}")
    return name


def run_arg() -> int | None:
    """The ``run`` query parameter, if given."""
    raw = request.args.get("run")
    return None if raw is None else parse_int(raw, "run", 1, MAX_ID)


def flag_arg(name: str) -> bool:
    raw = request.args.get(name)
    return False if raw is None else parse_bool(raw, name)


def json_body(allowed: set[str], required: set[str] = frozenset()) -> Mapping[str, Any]:
    """The request's JSON object, with only ``allowed`` keys and every ``required`` one."""
    if not request.get_data(cache=True):
        body: Any = {}
    elif not request.is_json:
        raise AdminError(415, "send a JSON object with Content-Type: application/json")
    else:
        body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise AdminError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise AdminError(400, f"unknown field(s): {', '.join(unknown)}")
    missing = sorted(required - set(body))
    if missing:
        raise AdminError(400, f"missing field(s): {', '.join(missing)}")
    return body
