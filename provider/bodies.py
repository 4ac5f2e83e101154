"""Request bodies read whole, whatever their framing (``Content-Length`` or chunked), under a byte limit.

``StreamReader.read(n)`` returns what has arrived so far, not ``n`` bytes: a body sent in several chunks
(the OpenFaaS gateway forwards bodies chunked) must be read until end of stream.
"""

from __future__ import annotations

from aiohttp import web
from quart_stage.errors import QuartError

_PIECE = 64 * 1024


def too_large(limit: int, size: int | None = None) -> QuartError:
    what = f"request body of {size} bytes" if size is not None else "request body"
    return QuartError(413, f"{what} is over the {limit}-byte limit", "body")


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body of ``request``; a 413 :class:`QuartError` as soon as it passes ``limit`` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit, request.content_length)
    pieces: list[bytes] = []
    size = 0
    while piece := await request.content.read(_PIECE):
        size += len(piece)
        if size > limit:
            raise too_large(limit)
        pieces.append(piece)
    return b"".join(pieces)
