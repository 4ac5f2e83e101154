"""Test helper: an HTTP/1.1 request whose body goes out in several chunks, with pauses, over a raw socket
(as the OpenFaaS gateway forwards bodies)."""

from __future__ import annotations

import base64
import json
import socket
import time
from urllib.parse import urlsplit


def chunked_request(url: str, method: str, path: str, body: bytes, pieces: int = 4,
                    auth: tuple[str, str] | None = None, pause_s: float = 0.05) -> tuple[int, bytes]:
    """Send ``body`` as ``pieces`` chunks (each flushed alone); returns (status, response body)."""
    parts = urlsplit(url)
    head = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", "Transfer-Encoding: chunked",
            "Content-Type: application/json", "Connection: close"]
    if auth:
        head.append("Authorization: Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    step = max(1, -(-len(body) // pieces))
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        for i in range(0, len(body), step):
            chunk = body[i:i + step]
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            time.sleep(pause_s)
        sock.sendall(b"0\r\n\r\n")
        raw = b""
        while data := sock.recv(65536):
            raw += data
    head_raw, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head_raw.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head_raw.lower():
        out, pos = b"", 0
        while True:
            eol = rest.index(b"\r\n", pos)
            size = int(rest[pos:eol], 16)
            if size == 0:
                return status, out
            out += rest[eol + 2:eol + 2 + size]
            pos = eol + 4 + size
    return status, rest


def chunked_json(url: str, method: str, path: str, doc: dict, **kw) -> tuple[int, bytes]:
    return chunked_request(url, method, path, json.dumps(doc).encode(), **kw)
