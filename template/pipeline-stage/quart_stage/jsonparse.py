"""JSON from the outside, parsed so that every malformed document is a 400 naming its field.

``json.loads`` alone lets through what later crashes a handler: ``NaN`` / ``Infinity`` (not JSON, but
Python accepts them: ``"replicas": NaN`` then fails in ``int()``), nesting deep enough to raise
``RecursionError`` (5,000 ``[``), numbers too large for a float (``1e400``: ``inf``), integers of more than 4,300 digits (``ValueError``) and bytes that
are not UTF-8. :func:`loads` turns each into :func:`~quart_stage.errors.invalid` and bounds the depth
(:data:`MAX_DEPTH`) before the decoder recurses.
"""

from __future__ import annotations

import json
import math
from typing import Any

from quart_stage.errors import invalid

MAX_DEPTH = 64  # deepest array/object nesting accepted (deploy bodies, stage inputs, safetensors headers: ≤ 4)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: json.loads would give inf, which int() cannot take
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def nesting_depth(raw: bytes | str) -> int:
    """The deepest ``[``/``{`` nesting of ``raw``, brackets inside strings not counted (a linear scan)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray | memoryview) else raw
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        elif ch in "]}":
            depth -= 1
    return deepest


def loads(raw: bytes | bytearray | memoryview | str, field: str = "body", what: str = "request body",
          max_depth: int = MAX_DEPTH) -> Any:
    """The decoded JSON value of ``raw``; a 400 naming ``field`` for anything that is not plain JSON."""
    data = bytes(raw) if isinstance(raw, bytearray | memoryview) else raw
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise invalid(field, f"{what} is not UTF-8: {exc.reason} at byte {exc.start}") from None
    # str.count runs at C speed: a document with few brackets (every normal one) is never scanned
    if text.count("[") + text.count("{") > max_depth and nesting_depth(text) > max_depth:
        raise invalid(field, f"{what} nests arrays/objects more than {max_depth} deep")
    try:
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except json.JSONDecodeError as exc:
        raise invalid(field, f"{what} is not valid JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:  # NaN/Infinity, a 5,000-digit integer, a decoder limit
        raise invalid(field, f"{what} is not valid JSON: {exc}") from None


def loads_object(raw: bytes | bytearray | memoryview | str, field: str = "body", what: str = "request body"
                 ) -> dict[str, Any]:
    """:func:`loads`, and the value must be a JSON object."""
    if not (raw.strip() if isinstance(raw, bytes | str) else bytes(raw).strip()):
        raise invalid(field, f"{what} is empty; a JSON object is required")
    value = loads(raw, field, what)
    if not isinstance(value, dict):
        raise invalid(field, f"{what} must be a JSON object")
    return value
