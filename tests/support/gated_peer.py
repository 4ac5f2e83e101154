"""A fake peer KeysManager on loopback whose stage-file layers each wait behind a gate the test opens (the
live-start and part-start tests)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class GatedServer:
    """The stage file's bytes (``corrupt`` flips a byte of that layer) with one gate per layer span, served by
    ``handler`` (a ``BaseHTTPRequestHandler`` subclass that reads this object as ``self.peer``) on an ephemeral
    loopback port."""

    def __init__(self, data: bytes, spans: list[list[int]], corrupt: int | None = None) -> None:
        self.data, self.spans = bytearray(data), spans
        if corrupt is not None:
            self.data[(spans[corrupt][0] + spans[corrupt][1]) // 2] ^= 0xFF
        self.gates = [threading.Event() for _ in spans]

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        bound = type("Handler", (handler,), {"peer": self, "log_message": lambda *_args: None})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), bound)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def open(self, *layers: int) -> None:
        for i in layers:
            self.gates[i].set()

    def close(self) -> None:
        for g in self.gates:
            g.set()
        self.server.shutdown()
        self.server.server_close()
