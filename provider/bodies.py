"""Request bodies read whole, whatever their framing (``Content-Length`` or chunked), under a byte limit.

``StreamReader.read(n)`` returns what has arrived so far, not ``n`` bytes: a body sent in several chunks
(the OpenFaaS gateway forwards bodies chunked) must be read until end of stream.
"""

from __future__ import annotations

from aiohttp import web
from quart_provider.body_gate import Reservation
from quart_stage.errors import QuartError

_PIECE = 64 * 1024


def too_large(limit: int, size: int | None = None) -> QuartError:
    what = f"request body of {size} bytes" if size is not None else "request body"
    return QuartError(413, f"{what} is over the {limit}-byte limit", "body")


async def read_body(request: web.Request, limit: int, reservation: Reservation | None = None) -> bytes:
    """The whole body of ``request``; a 413 :class:`QuartError` as soon as it passes ``limit`` bytes.

    With a ``reservation`` (:mod:`.body_gate`), the body's bytes are counted before they are held:
    ``Content-Length`` up front, a chunked body piece by piece (429 or 413 from the gate)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise too_large(limit, declared)
    if reservation is not None and declared:
        reservation.add(declared)
    if declared:  # filled in place: one copy of the body, not pieces plus their join
        buf, pos = bytearray(declared), 0
        while pos < declared and (piece := await request.content.read(min(_PIECE, declared - pos))):
            buf[pos:pos + len(piece)] = piece
            pos += len(piece)
        if pos < declared:
            raise QuartError(400, f"request body is truncated: Content-Length {declared}, {pos} bytes arrived",
                             "body")
        return bytes(buf) if declared <= _PIECE else buf
    pieces: list[bytes] = []
    size = 0
    while piece := await request.content.read(_PIECE):
        size += len(piece)
        if size > limit:
            raise too_large(limit)
        if reservation is not None and declared is None:
            reservation.add(len(piece))
        pieces.append(piece)
    return b"".join(pieces)
