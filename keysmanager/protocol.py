"""The control channel between the KeysManager and a zygote: JSON lines over a Unix socketpair."""

from __future__ import annotations

import json
import socket
from typing import Any


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Blocking JSON-lines reader over a socket (zygote side; no buffered file objects, no threads)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def read_available(self) -> list[dict[str, Any]] | None:
        """Read what the socket has now; return the complete messages, or None on EOF."""
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]
