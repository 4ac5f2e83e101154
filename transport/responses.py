"""How both gateways (the embedded one and the plugin) answer what is not a result: ``{"error", "field"}`` JSON.

:class:`Answer` is an invocation's answer before any HTTP server writes it: the aiohttp handlers and the
fast ``/function`` front (:mod:`.front`) both write the same :class:`Answer` the shared proxy code built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from quart_stage.errors import QuartError

JSON_TYPE = "application/json; charset=utf-8"


@dataclass(slots=True)
class Answer:
    """Status, headers (end-to-end; the server adds framing) and the whole body; ``close``: refused before the
    request's body was read, so the connection closes after the answer (the rest of the body is never read)."""

    status: int
    headers: MutableMapping[str, str]
    body: bytes | bytearray
    close: bool = False


def error_body(message: str, field: str | None = None) -> bytes:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    return json.dumps(body).encode()


def error_headers(exc: QuartError, retry_after_s: int) -> dict[str, str]:
    """A 429 or 503 carries ``Retry-After`` (the error's own, if it has one)."""
    headers = {"Retry-After": str(retry_after_s)} if exc.status in (429, 503) else {}
    headers.update(exc.headers)
    return headers


def error_answer(status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None,
                 close: bool = False) -> Answer:
    return Answer(status, {"Content-Type": JSON_TYPE, **(headers or {})}, error_body(message, field), close)


def answer_of(exc: QuartError, retry_after_s: int, close: bool = False) -> Answer:
    return error_answer(exc.status, exc.message, exc.field, error_headers(exc, retry_after_s), close)


def error_response(status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
                   ) -> web.Response:
    return web.Response(status=status, body=error_body(message, field),
                        headers={"Content-Type": JSON_TYPE, **(headers or {})})


def error_of(exc: QuartError, retry_after_s: int) -> web.Response:
    """A :class:`QuartError` as its answer; a 429 or 503 carries ``Retry-After`` (the error's own, if it has one)."""
    return error_response(exc.status, exc.message, exc.field, error_headers(exc, retry_after_s))
