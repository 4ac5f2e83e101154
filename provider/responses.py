"""How the provider's HTTP handlers answer what is not a result: ``{"error": ..., "field": ...}`` JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web
from quart_stage.errors import QuartError


def error_response(status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
                   ) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    return web.json_response(body, status=status, headers=dict(headers) if headers else None)


def error_of(exc: QuartError, retry_after_s: int) -> web.Response:
    """A :class:`QuartError` as its answer; a 429 or 503 carries ``Retry-After`` (the error's own, if it has one)."""
    headers = {"Retry-After": str(retry_after_s)} if exc.status in (429, 503) else {}
    headers.update(exc.headers)
    return error_response(exc.status, exc.message, exc.field, headers)
