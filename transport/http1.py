"""HTTP/1.1 message framing shared by our raw-asyncio peers: the ``quart/echo`` replica (:mod:`.echo`) and the
proxy's client to replicas (:mod:`.upstream`). The gateway's own front (:mod:`.front`) reads chunked bodies
incrementally, counting each chunk in the byte gate as it is announced, so it has its own reader."""

from __future__ import annotations


def next_chunk(buffer: bytearray, pos: int) -> tuple[bytes | None, int] | None:
    """The chunk of a chunked message at ``buffer[pos]`` and the offset just past it; ``(None, end)`` for the
    last (zero-size) chunk, its trailers included; None while incomplete; ValueError when malformed."""
    eol = buffer.find(b"\r\n", pos)
    if eol < 0:
        return None
    size = int(bytes(buffer[pos:eol]).split(b";", 1)[0].strip() or b"x", 16)  # ValueError if not hex
    if size < 0:
        raise ValueError("negative chunk size")
    pos = eol + 2
    if size == 0:
        while True:  # trailer fields, up to an empty line
            eol = buffer.find(b"\r\n", pos)
            if eol < 0:
                return None
            if eol == pos:
                return None, eol + 2
            pos = eol + 2
    if len(buffer) < pos + size + 2:
        return None
    if buffer[pos + size:pos + size + 2] != b"\r\n":
        raise ValueError("chunk not followed by CRLF")
    return bytes(buffer[pos:pos + size]), pos + size + 2


def dechunk(buffer: bytearray, start: int) -> tuple[bytes, int] | None:
    """The body of a chunked message starting at ``buffer[start]`` and the offset just past it (trailers
    included); None while incomplete; ValueError when malformed."""
    pieces, pos = [], start
    while True:
        found = next_chunk(buffer, pos)
        if found is None:
            return None
        piece, pos = found
        if piece is None:
            return b"".join(pieces), pos
        pieces.append(piece)
