"""Router: pipelining through fake replicas, retries on replica death, 429 at the queue cap, and
10,000 requests with random replica kills where every request gets exactly one response."""

from __future__ import annotations

import asyncio
import json
import random

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


@with_cluster
async def test_pipeline_runs_stages_in_order_over_http(cluster: Cluster) -> None:
    await cluster.add("m-stage-0")
    await cluster.add("m-stage-1")
    router = make_router(cluster)
    app = web.Application()
    app.router.add_route("*", "/function/{model}", lambda r: router.handle(r, r.match_info["model"]))
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        resp = await client.post("/function/m", data=b"x")
        assert resp.status == 200
        assert await resp.read() == b"x|m-stage-0#1|m-stage-1#2"
        missing = await client.post("/function/nope", data=b"x")
        assert missing.status == 404 and (await missing.json())["field"] == "model"
        bad = await client.post("/function/m", data=b"x", headers={"X-Quart-Timeout-Ms": "soon"})
        assert bad.status == 400 and "X-Quart-Timeout-Ms" in (await bad.json())["error"]
        # the client's Accept reaches the last stage only (it picks the answer's format; the others exchange bytes)
        resp = await client.post("/function/m", data=b"y", headers={"Accept": "application/json"})
        assert resp.status == 200
        first, last = cluster.fakes["r1"], cluster.fakes["r2"]
        assert last.accepts[-1] == "application/json" and first.accepts[-1] != "application/json"
    finally:
        await client.close()
        await router.close()
    st = router.collector.stage("m-stage-1")
    assert st.total_arrivals == 2 and st.total_completions == 2


@with_cluster
async def test_replica_killed_mid_request_is_retried_elsewhere(cluster: Cluster) -> None:
    await cluster.add("m-stage-0")
    slow = await cluster.add("m-stage-1", delay_s=2.0)  # r2: picked first (listed first, both idle)
    await cluster.add("m-stage-1", delay_s=0.0)  # r3
    router = make_router(cluster)
    try:
        task = asyncio.create_task(router.invoke("m", b"x"))
        for _ in range(200):
            if slow.calls:
                break
            await asyncio.sleep(0.01)
        assert slow.calls == 1
        await cluster.kill("r2", unlist=False)  # dies while serving; still listed (as a stale replica list would)
        reply = await asyncio.wait_for(task, 5)
        assert reply.status == 200 and reply.body.endswith(b"|m-stage-1#3")
    finally:
        await router.close()


@with_cluster
async def test_killed_only_replica_gives_explicit_error(cluster: Cluster) -> None:
    await cluster.add("m-stage-0")
    slow = await cluster.add("m-stage-1", delay_s=2.0)
    router = make_router(cluster, request_timeout_s=3.0)
    try:
        task = asyncio.create_task(router.invoke("m", b"x"))
        while not slow.calls:
            await asyncio.sleep(0.01)
        await cluster.kill("r2", unlist=False)
        reply = await asyncio.wait_for(task, 6)
        assert reply.status in (502, 504)
        err = json.loads(reply.body)
        assert "m-stage-1" in err["error"]
    finally:
        await router.close()
    assert router.accepted == router.answered == 1


@with_cluster
async def test_replica_503_is_retried_and_4xx_and_500_are_passed_back(cluster: Cluster) -> None:
    """Issue 14 item 5: only what another replica can fix is retried (503: a draining or overloaded
    replica); a 4xx or a stage's 500 is the answer to this input, passed back once, never retried."""
    await cluster.add("m-stage-0", status=503)
    await cluster.add("m-stage-0")
    router = make_router(cluster, stages=1)
    try:
        ok = await router.invoke("m", b"x")
        assert ok.status == 200
        cluster.source.replicas["m-stage-0"] = cluster.source.replicas["m-stage-0"][:1]
        for status in (400, 500):
            cluster.fakes["r1"].status = status
            calls = cluster.fakes["r1"].calls
            bad = await router.invoke("m", b"x")
            assert bad.status == status and json.loads(bad.body)["error"] == "boom"
            assert cluster.fakes["r1"].calls == calls + 1  # tried once
    finally:
        await router.close()


@with_cluster
async def test_queue_cap_answers_429_with_retry_after(cluster: Cluster) -> None:
    await cluster.add("m-stage-0", delay_s=0.2)
    router = make_router(cluster, stages=1, queue_cap=2, retry_after_s=3)
    try:
        replies = await asyncio.gather(*(router.invoke("m", b"x") for _ in range(8)))
    finally:
        await router.close()
    codes = sorted(r.status for r in replies)
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and codes.count(200) + codes.count(429) == 8
    refused = next(r for r in replies if r.status == 429)
    assert refused.headers["Retry-After"] == "3"
    assert "cap" in json.loads(refused.body)["error"]


@with_cluster
async def test_no_replica_means_deadline_error_not_silence(cluster: Cluster) -> None:
    router = make_router(cluster, stages=1, request_timeout_s=0.3)
    try:
        reply = await asyncio.wait_for(router.invoke("m", b"x"), 3)
    finally:
        await router.close()
    assert reply.status == 504


@with_cluster
async def test_ten_thousand_requests_with_random_kills_all_answered(cluster: Cluster) -> None:
    rng = random.Random(1)
    for fn in ("m-stage-0", "m-stage-1"):
        for _ in range(3):
            await cluster.add(fn, delay_s=0.0)
    router = make_router(cluster, request_timeout_s=5.0, attempt_timeout_s=1.0, queue_cap=10_000)
    stop = asyncio.Event()
    kills = 0

    async def killer() -> None:
        nonlocal kills
        while not stop.is_set():
            await asyncio.sleep(0.05)
            fn = rng.choice(["m-stage-0", "m-stage-1"])
            victims = cluster.source.replicas[fn]
            if len(victims) > 1:
                victim = rng.choice(victims)
                await cluster.kill(victim.id, unlist=rng.random() < 0.5)  # half the time the list is stale
                kills += 1
                await cluster.add(fn)
                cluster.source.replicas[fn] = [r for r in cluster.source.replicas[fn] if r.id != victim.id]

    sem = asyncio.Semaphore(128)

    async def one(i: int):
        async with sem:
            return await router.invoke("m", str(i).encode())

    killer_task = asyncio.create_task(killer())
    try:
        replies = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(10_000))), 170)
    finally:
        stop.set()
        await killer_task
        await router.close()
    assert len(replies) == 10_000
    statuses = [r.status for r in replies]
    assert all(s in (200, 502, 504) for s in statuses)
    assert statuses.count(200) >= 9_900
    assert router.accepted == router.answered == 10_000
    assert kills >= 5
    for i, r in enumerate(replies):
        if r.status == 200:
            assert r.body.startswith(f"{i}|m-stage-0#".encode())


@with_cluster
async def test_close_answers_queued_and_running_requests(cluster: Cluster) -> None:
    await cluster.add("m-stage-0", delay_s=2.0)
    router = make_router(cluster, stages=1)
    tasks = [asyncio.create_task(router.invoke("m", b"x")) for _ in range(3)]  # 1 running, 2 queued
    await asyncio.sleep(0.2)
    await router.close()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 3)
    assert [r.status for r in replies] == [503, 503, 503]
    assert router.accepted == router.answered == 3
