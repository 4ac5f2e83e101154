"""One request path (issue 26): a pipeline request is parsed once, by the fast front, and handed to the
router; one deadline parser (400 on a bad ``X-Quart-Timeout-Ms``, proxy and router alike); a release
wakes the router's stage queue (no polling); ``pipelines()`` is cached; scale from zero goes through
the registry."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import pytest
import requests
from gateway_plugin.config import PluginConfig
from gateway_plugin.router import Router, StaticReplica, StaticReplicas
from quart_kernel.admission import client_deadline_s
from quart_provider.balancer import Balancer, ServiceUnavailable
from quart_provider.config import GatewayConfig
from quart_stage.errors import QuartError
from quart_transport.codec import CodecSettings
from support.embedded_system import ThreadedSystem


def _stage(name: str, stage: int, stages: int) -> dict:
    labels = {"com.quart.model": "pipe", "com.quart.stage": str(stage), "com.quart.stages": str(stages),
              "com.quart.concurrency": "4"}
    return {"service": name, "image": "quart/echo:latest", "labels": labels}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    running = ThreadedSystem(tmp_path_factory.mktemp("path"), attach_plugin=True)
    try:
        for i in range(2):
            res = requests.post(f"{running.url}/system/functions", json=_stage(f"pipe-s{i}", i, 2),
                                auth=running.auth, timeout=30)
            assert res.status_code == 202, res.text
        deadline = time.monotonic() + 60
        while not all(running.system.gateway.functions[f"pipe-s{i}"].ready for i in range(2)):
            assert time.monotonic() < deadline, "stage replicas not ready in 60 s"
            time.sleep(0.05)
        yield running
    finally:
        running.close()


def _raw(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < 5:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data


def test_a_pipeline_request_is_answered_by_the_fast_front_through_every_stage(pipeline):
    answer = _raw(pipeline.url, b"POST /function/pipe HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"hello", answer
    if CodecSettings.from_env().lean:  # QUART_HTTP_CODEC=aiohttp: aiohttp answers every request
        assert b"aiohttp" not in head  # aiohttp's server names itself; the fast front does not
    assert b"X-Call-Id:" in head and b"X-Duration-Seconds:" in head  # the gateway's tracing headers
    calls = {pipeline.system.gateway.functions[f"pipe-s{i}"].invocations for i in range(2)}
    assert min(calls) >= 1  # each stage ran (counted like the proxy counts)


def test_pipeline_errors_are_quart_errors_and_a_bad_deadline_is_a_400_everywhere(pipeline):
    url = pipeline.url
    bad = requests.post(f"{url}/function/pipe", data=b"x", headers={"X-Quart-Timeout-Ms": "soon"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["field"] == "X-Quart-Timeout-Ms", bad.text
    direct = requests.post(f"{url}/function/pipe-s0", data=b"x", headers={"X-Quart-Timeout-Ms": "-3"}, timeout=10)
    assert direct.status_code == 400 and direct.json()["field"] == "X-Quart-Timeout-Ms", direct.text
    sub = requests.post(f"{url}/function/pipe/extra", data=b"x", timeout=10)
    assert sub.status_code == 404 and sub.json()["field"] == "path"
    get = requests.get(f"{url}/function/pipe", timeout=10)
    assert get.status_code == 405 and get.json()["field"] == "method"
    assert requests.post(f"{url}/function/pipe", data=b"again", timeout=10).content == b"again"


def test_pipelines_are_computed_once_per_change(pipeline):
    gateway = pipeline.system.gateway
    first = gateway.registry.pipelines()
    assert gateway.registry.pipelines() is first and first == {"pipe": ["pipe-s0", "pipe-s1"]}
    res = requests.post(f"{pipeline.url}/system/functions", auth=pipeline.auth, timeout=30,
                        json={"service": "other-s0", "image": "quart/echo:latest",
                              "labels": {"com.quart.model": "other", "com.quart.stage": "0",
                                         "com.quart.stages": "1"}})
    assert res.status_code == 202, res.text
    assert gateway.registry.pipelines() is not first and gateway.registry.pipelines()["other"] == ["other-s0"]


def test_the_deadline_parser():
    assert client_deadline_s({}, 30.0) is None
    assert client_deadline_s({"X-Quart-Timeout-Ms": "1500"}, 30.0) == 1.5
    assert client_deadline_s({"X-Quart-Timeout-Ms": "90000"}, 30.0) == 30.0  # capped
    for raw in ("0", "-1", "abc", "nan", "inf"):
        with pytest.raises(QuartError) as err:
            client_deadline_s({"X-Quart-Timeout-Ms": raw}, 30.0)
        assert err.value.status == 400 and err.value.field == "X-Quart-Timeout-Ms"


async def _slow_replica(delay_s: float) -> tuple[asyncio.base_events.Server, str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                await asyncio.sleep(delay_s)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"


def test_a_release_wakes_the_stage_queue_without_polling():
    async def main() -> None:
        server, url = await _slow_replica(0.05)
        source = StaticReplicas({"s": [StaticReplica("r1", url)]}, slots=1)
        router = Router(source, lambda: {"m": ["s"]}, PluginConfig(request_timeout_s=20.0), dispatch_poll_s=30.0)
        try:
            start = time.monotonic()
            answers = await asyncio.gather(*(router.invoke("m", str(i).encode()) for i in range(5)))
            elapsed = time.monotonic() - start
        finally:
            await router.close()
            server.close()
        assert [a.status for a in answers] == [200] * 5 and [a.body for a in answers] == [b"0", b"1", b"2", b"3", b"4"]
        assert elapsed < 5.0  # one slot, five calls of 50 ms: served back to back, never a 30 s poll
        assert source.service_times("s").p90() >= 0.05  # the one estimator admission reads

    asyncio.run(main())


def test_scale_from_zero_goes_through_the_registry():
    asked: list[tuple[str, int]] = []
    fn = SimpleNamespace(name="f", ready=[], replicas={}, pending_starts=0, unplaced=False, waiting=0, desired=0,
                         deployment=SimpleNamespace(concurrency=1, min_replicas=0), add_waiter=lambda fut: None)
    balancer = Balancer(GatewayConfig(ready_wait_s=0.05), {"f": fn}, kick=lambda: None,
                        scale=lambda name, n: asked.append((name, n)))

    async def main() -> None:
        with pytest.raises(ServiceUnavailable) as err:
            await balancer.acquire(fn)
        assert err.value.status == 503

    asyncio.run(main())
    assert asked == [("f", 1)] and fn.desired == 0  # asked of the registry; never written here


def test_calls_waiting_in_the_proxy_count_in_the_queue_the_controller_reads():
    class Source(StaticReplicas):
        def waiting(self, function: str) -> int:
            return 3 if function == "s" else 0

    router = Router(Source({"s": []}), lambda: {"m": ["s"]})
    assert router.queue_len("s") == 3 and router.queue_len("other") == 0
