"""Fake stage replicas on loopback HTTP and a Router over them (the pipeline router tests)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from gateway_plugin.config import PluginConfig
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.router import Router, StaticReplica, StaticReplicas


class FakeReplica:
    """A tiny HTTP/1.1 server (raw asyncio) standing in for one stage replica: appends its tag after a
    delay. ``kill`` aborts every open connection at once, like a process dying mid-request."""

    def __init__(self, tag: str, delay_s: float = 0.0, status: int = 200) -> None:
        self.tag, self.delay_s, self.status = tag, delay_s, status
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.url = ""
        self.calls = 0
        self.accepts: list[str] = []  # the Accept header of each call ("" when none)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length, accept = 0, ""
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                    elif line.lower().startswith(b"accept:"):
                        accept = line.split(b":", 1)[1].strip().decode()
                self.accepts.append(accept)
                body = await reader.readexactly(length)
                self.calls += 1
                await asyncio.sleep(self.delay_s)
                if self.status == 200:
                    out, ctype, reason = body + b"|" + self.tag.encode(), b"application/octet-stream", b"OK"
                else:
                    out, ctype, reason = b'{"error": "boom"}', b"application/json", b"ERR"
                writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                             b"X-Quart-Compute-Ms: %.3f\r\n\r\n" % (self.status, reason, ctype, len(out),
                                                                   1000 * self.delay_s) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.writers.discard(writer)
            writer.transport.abort()

    async def start(self) -> FakeReplica:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/"
        return self

    async def kill(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in list(self.writers):
                writer.transport.abort()
            self.server = None



class Cluster:
    """Fake replicas per stage function, the StaticReplicas view the router uses, and cleanup."""

    def __init__(self) -> None:
        self.source = StaticReplicas()
        self.fakes: dict[str, FakeReplica] = {}
        self._n = 0

    async def add(self, function: str, delay_s: float = 0.0, status: int = 200) -> FakeReplica:
        self._n += 1
        fake = await FakeReplica(f"{function}#{self._n}", delay_s, status).start()
        rid = f"r{self._n}"
        self.fakes[rid] = fake
        self.source.replicas.setdefault(function, []).append(StaticReplica(rid, fake.url))
        return fake

    async def kill(self, rid: str, unlist: bool = True) -> None:
        await self.fakes[rid].kill()
        if unlist:
            for reps in self.source.replicas.values():
                reps[:] = [r for r in reps if r.id != rid]

    async def close(self) -> None:
        for fake in self.fakes.values():
            await fake.kill()



def with_cluster(body):
    """Run ``body(cluster)`` on a fresh event loop; the fake replicas are always stopped."""

    async def main() -> None:
        c = Cluster()
        try:
            await body(c)
        finally:
            await c.close()

    def test() -> None:
        asyncio.run(main())

    test.__name__ = body.__name__
    return test



def make_router(cluster: Cluster, stages: int = 2, **cfg) -> Router:
    names = [f"m-stage-{i}" for i in range(stages)]
    return Router(cluster.source, lambda: {"m": names}, PluginConfig(**cfg), MetricsCollector(10.0), dispatch_poll_s=0.005)


@asynccontextmanager
async def routed(cluster: Cluster, stages: int = 2, **cfg) -> AsyncIterator[tuple[Router, TestClient]]:
    """Two stage replicas ``m-stage-0`` and ``m-stage-1`` of model ``m`` and a router over them serving
    ``/function/{model}`` on a test client; the client and the router are closed after."""
    await cluster.add("m-stage-0")
    await cluster.add("m-stage-1")
    router = make_router(cluster, stages, **cfg)
    app = web.Application()
    app.router.add_route("*", "/function/{model}", lambda r: router.handle(r, r.match_info["model"]))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield router, client
    finally:
        await client.close()
        await router.close()
