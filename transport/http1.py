"""HTTP/1.1 message framing shared by our raw-asyncio peers: the ``quart/echo`` replica (:mod:`.echo`), the
proxy's client to replicas (:mod:`.upstream`) and the gateway's own front (``quart_provider.front``, which reads
chunked bodies incrementally, counting each chunk in the byte gate as it is announced, with the same rules).

The grammar is RFC 9112's as h11 reads it (the oracle of tests/unit/test_http1_conformance.py): a field
name is a token; a field value has no NUL, CR, LF, VT nor FF, leading and trailing spaces and tabs
dropped; a chunk-size line is 1 to 20 hex digits, then maybe ``;`` and an extension, then spaces or tabs.
"""

from __future__ import annotations

import re

TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_VALUE = re.compile(r"[^\x00\s]+(?:[ \t]+[^\x00\s]+)*")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*")
_LENGTH = re.compile(r"[0-9]{1,20}")


def field_value(value: str) -> str | None:
    """``value`` (what follows the colon) without its surrounding spaces and tabs, or None if not a field value."""
    value = value.strip(" \t")
    return value if not value or _VALUE.fullmatch(value) else None


def field_line_ok(line: bytes) -> bool:
    """``line`` is a ``name: value`` field line (a trailer's)."""
    name, sep, value = line.decode("latin-1").partition(":")
    return bool(sep) and TOKEN.fullmatch(name) is not None and field_value(value) is not None


def content_length(value: str, seen: int | None = None) -> int:
    """The length a ``Content-Length`` value says (``5`` or ``5, 5``), the same as ``seen`` (an earlier one's);
    ValueError otherwise."""
    values = {v.strip(" \t") for v in value.split(",")}
    if len(values) != 1:
        raise ValueError(f"conflicting Content-Length {value[:40]!r}")
    text = values.pop()
    if not _LENGTH.fullmatch(text):
        raise ValueError(f"bad Content-Length {value[:40]!r}")
    length = int(text)
    if seen is not None and seen != length:
        raise ValueError("conflicting Content-Length headers")
    return length


def chunk_size(line: bytes | bytearray) -> int:
    """The size a chunk-size line (without its CRLF) announces; ValueError if it is not one."""
    match = _CHUNK_SIZE.fullmatch(line)
    if match is None:
        raise ValueError(f"bad chunk size line {bytes(line[:40])!r}")
    return int(match.group(1), 16)


def next_chunk(buffer: bytearray, pos: int) -> tuple[bytes | None, int] | None:
    """The chunk of a chunked message at ``buffer[pos]`` and the offset just past it; ``(None, end)`` for the
    last (zero-size) chunk, its trailers included; None while incomplete; ValueError when malformed."""
    eol = buffer.find(b"\r\n", pos)
    if eol < 0:
        return None
    size = chunk_size(buffer[pos:eol])
    pos = eol + 2
    if size == 0:
        while True:  # trailer fields, up to an empty line
            eol = buffer.find(b"\r\n", pos)
            if eol < 0:
                return None
            if eol == pos:
                return None, eol + 2
            if not field_line_ok(bytes(buffer[pos:eol])):
                raise ValueError(f"bad trailer field {bytes(buffer[pos:eol][:40])!r}")
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
