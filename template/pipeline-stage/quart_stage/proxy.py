"""A lean HTTP/1.1 reverse proxy to one replica on a Unix socket (stdlib only: no torch, no flask).

What a stage pod in fork mode serves (``quart_stage.forward``): every request is streamed to the replica the
node's KeysManager forked for it, and the answer streamed back. Client connections are kept alive
(HTTP/1.1, idle ``idle_s``); replica connections are pooled and reused. Bodies are never buffered whole:
a ``Content-Length`` body is sent on in 64 KiB blocks, a chunked one re-chunked; an answer without
``Content-Length`` is sent chunked. Hop-by-hop headers are dropped. Every answer carries
``X-Quart-Start: fork`` (which start path this pod took). Failures are explicit JSON errors naming the
field ``replica``: 502 when the replica cannot be reached or breaks off, 504 when it does not answer within
``timeout_s``. ``GET /_/health`` is the replica's own health (with ``"start": "fork"`` and its id added),
503 when it does not answer: the pod's readiness follows the replica's.
"""

from __future__ import annotations

import http.client
import http.server
import json
import select
import socket
import threading
from dataclasses import dataclass

from quart_stage.unixhttp import UnixHTTPConnection

BLOCK = 1 << 16
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "expect", "proxy-connection"})
START_HEADER = "X-Quart-Start"


@dataclass(frozen=True, slots=True)
class Upstream:
    """The replica behind this proxy: its Unix socket, its id, the start path to report."""

    socket: str
    replica_id: str
    timeout_s: float = 300.0
    start: str = "fork"


class _Pool:
    """Idle keep-alive connections to the replica (a connection the replica closed is dropped, not reused)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._idle: list[UnixHTTPConnection] = []
        self._lock = threading.Lock()

    def get(self) -> UnixHTTPConnection:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if conn.sock is not None and not select.select([conn.sock], [], [], 0)[0]:
                    return conn  # readable while idle means EOF (or garbage): not reusable
                conn.close()
        return UnixHTTPConnection(self.upstream.socket, self.upstream.timeout_s)

    def put(self, conn: UnixHTTPConnection) -> None:
        with self._lock:
            self._idle.append(conn)


class ProxyServer(http.server.ThreadingHTTPServer):
    """Listens on (host, port); forwards to ``upstream``. ``in_flight`` counts requests being answered."""

    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], upstream: Upstream, idle_s: float = 75.0) -> None:
        self.upstream = upstream
        self.pool = _Pool(upstream)
        self.in_flight = 0
        self.lock = threading.Lock()
        handler = type("Handler", (_Forward,), {"timeout": idle_s})
        super().__init__(address, handler)

    def track(self, delta: int) -> None:
        with self.lock:
            self.in_flight += delta


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ProxyServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's names
        if self.path.split("?", 1)[0] == "/_/health":
            self.health()
        else:
            self.forward()

    def do_POST(self) -> None:  # noqa: N802
        self.forward()

    do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_POST

    def log_request(self, code="-", size="-") -> None:  # no per-request log lines
        pass

    # ------------------------------------------------------------------ answers of our own
    def answer_json(self, status: int, doc: dict, close: bool = False) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header(START_HEADER, self.server.upstream.start)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)

    def health(self) -> None:
        up = self.server.upstream
        conn = self.server.pool.get()
        try:
            conn.request("GET", "/_/health")
            resp = conn.getresponse()
            raw = resp.read()
            doc = json.loads(raw) if resp.status == 200 else {"error": raw.decode(errors="replace")[:500]}
        except (OSError, http.client.HTTPException, ValueError) as exc:
            conn.close()
            self.answer_json(503, {"error": f"the forked replica {up.replica_id} does not answer: {exc}",
                                   "field": "replica", "start": up.start})
            return
        self.server.pool.put(conn) if not resp.will_close else conn.close()
        doc.update({"start": up.start, "replica": up.replica_id})
        self.answer_json(200 if resp.status == 200 else 503, doc)

    # ------------------------------------------------------------------ forwarding
    def forward(self) -> None:
        self.server.track(1)
        try:
            self._forward()
        finally:
            self.server.track(-1)

    def _forward(self) -> None:
        up = self.server.upstream
        length = self.headers.get("Content-Length")
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        if length is not None and not length.strip().isdigit():
            self.answer_json(400, {"error": f"Content-Length must be a decimal integer, got {length!r}",
                                   "field": "Content-Length"}, close=True)
            return
        conn = self.server.pool.get()
        # a body not read to its end leaves the client's connection unusable: an error answer then closes it
        has_body = chunked or bool(length and int(length))
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    conn.putheader(name, value)
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            conn.endheaders()
            if chunked:
                self._send_chunked(conn)
            elif length:
                self._send_exact(conn, int(length))
            resp = conn.getresponse()
        except TimeoutError as exc:
            conn.close()
            self.answer_json(504, {"error": f"the forked replica {up.replica_id} did not answer within "
                                            f"{up.timeout_s:g} s: {exc}", "field": "replica"}, close=True)
            return
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            self.answer_json(502, {"error": f"the forked replica {up.replica_id} failed: "
                                            f"{type(exc).__name__}: {exc}", "field": "replica"},
                             close=has_body)
            return
        self._relay(conn, resp)

    def _send_exact(self, conn: UnixHTTPConnection, remaining: int) -> None:
        while remaining:
            block = self.rfile.read(min(BLOCK, remaining))
            if not block:
                raise ConnectionAbortedError("the client closed the connection before its body ended")
            conn.send(block)
            remaining -= len(block)

    def _send_chunked(self, conn: UnixHTTPConnection) -> None:
        while True:
            size_line = self.rfile.readline(1024)
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise ConnectionAbortedError(f"bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers: dropped
                    pass
                conn.send(b"0\r\n\r\n")
                return
            data = self.rfile.read(size)
            self.rfile.readline(8)  # the chunk's CRLF
            conn.send(b"%x\r\n%s\r\n" % (len(data), data))

    def _relay(self, conn: UnixHTTPConnection, resp: http.client.HTTPResponse) -> None:
        """Stream the replica's answer to the client; headers already sent, so a failure closes both ends."""
        length = resp.getheader("Content-Length")
        bodyless = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        rechunk = length is None and not bodyless
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.getheaders():
            if name.lower() not in HOP_BY_HOP and name.lower() not in ("date", "server"):
                self.send_header(name, value)
        self.send_header(START_HEADER, self.server.upstream.start)
        if rechunk:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while not bodyless and (block := resp.read1(BLOCK)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if rechunk else block)
            if rechunk:
                self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException):
            conn.close()
            self.close_connection = True
            return
        resp.close()  # read to its end; read1 never closes a Content-Length answer, and an open one blocks reuse
        if resp.will_close:
            conn.close()
        else:
            self.server.pool.put(conn)


def serve(address: tuple[str, int], upstream: Upstream, idle_s: float = 75.0) -> ProxyServer:
    """A started proxy (its loop on a daemon thread); ``shutdown()`` stops accepting."""
    server = ProxyServer(address, upstream, idle_s)
    server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True, name="proxy").start()
    return server
