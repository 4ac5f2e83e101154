"""Server-sent events as OpenAI streams them: ``data: <json>`` blocks, the last one ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
GONE = (ConnectionResetError, ConnectionError, RuntimeError)  # writing to a client that went away


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers={**HEADERS, **(headers or {})})
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, event: Any) -> None:
    """One event (raises one of :data:`GONE` when the client is no longer there)."""
    await response.write(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


async def done(response: web.StreamResponse) -> None:
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


def client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()
