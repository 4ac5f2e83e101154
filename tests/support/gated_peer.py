"""A fake peer KeysManager on loopback whose stage-file layers each wait behind a gate the test opens (the
live-start and part-start tests)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class GatedServer:
    """The stage file's bytes (``corrupt`` flips a byte of that layer; ``die_at``: the layer not sent, the
    connection closed instead) with one gate per layer span, served by
    ``handler`` (a ``BaseHTTPRequestHandler`` subclass that reads this object as ``self.peer``) on an ephemeral
    loopback port."""

    def __init__(self, data: bytes, spans: list[list[int]], corrupt: int | None = None,
                 die_at: int | None = None) -> None:
        self.data, self.spans, self.die_at = bytearray(data), spans, die_at
        if corrupt is not None:
            self.data[(spans[corrupt][0] + spans[corrupt][1]) // 2] ^= 0xFF
        self.gates = [threading.Event() for _ in spans]

    def serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        bound = type("Handler", (handler,), {"peer": self, "log_message": lambda *_args: None})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), bound)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def send_layers(self, handler: BaseHTTPRequestHandler, start: int, end: int) -> None:
        """Write the bytes of ``[start, end)`` that fall in layers, layer by layer, each once its gate opens; the
        connection closes instead of sending layer ``die_at`` (or a layer whose gate stays shut for 60 s)."""
        for i, (a, b) in enumerate(self.spans):
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            if not self.gates[i].wait(60) or i == self.die_at:
                handler.close_connection = True
                return
            handler.wfile.write(self.data[lo:hi])
            handler.wfile.flush()

    def open(self, *layers: int) -> None:
        for i in layers:
            self.gates[i].set()

    def close(self) -> None:
        for g in self.gates:
            g.set()
        self.server.shutdown()
        self.server.server_close()
