"""Tracing headers as the OpenFaaS gateway sets them: X-Call-Id (the client's, else a UUID4) upstream and on
every answer of /function and /async-function, X-Start-Time (unix ns) and X-Duration-Seconds on answers."""

from __future__ import annotations

import time
import uuid

import requests
from aiohttp import web
from support.faas_cli import faas_cli_deploy_body
from support.router_cluster import Cluster, routed, with_cluster


def check_trace(res: requests.Response, before_ns: int, call_id: str | None = None) -> str:
    got = res.headers["X-Call-Id"]
    if call_id is None:
        assert uuid.UUID(got).version == 4
    else:
        assert got == call_id
    assert before_ns <= int(res.headers["X-Start-Time"]) <= time.time_ns()
    assert 0 <= float(res.headers["X-Duration-Seconds"]) < 30
    return got


def test_function_answers_carry_call_id_start_time_and_duration(gw):
    assert gw.deploy(faas_cli_deploy_body("echo")).status_code == 202
    gw.wait_available("echo", 1)
    before = time.time_ns()
    res = requests.post(f"{gw.url}/function/echo", data=b"x", headers={"X-Call-Id": "client-chosen-1"}, timeout=10)
    assert res.status_code == 200
    check_trace(res, before, "client-chosen-1")
    ids = {check_trace(requests.post(f"{gw.url}/function/echo", data=b"x", timeout=10), before) for _ in range(3)}
    assert len(ids) == 3
    # errors too: unknown function, unknown namespace
    check_trace(requests.post(f"{gw.url}/function/nope", timeout=10), before)
    check_trace(requests.post(f"{gw.url}/function/echo.elsewhere", headers={"X-Call-Id": "e"}, timeout=10), before,
                "e")


def test_upstream_sees_the_call_id_and_start_time(gw):
    """The invoke hooks (the plugin's router) get the request with the tracing headers set."""
    seen: list[dict] = []

    async def hook(request: web.Request, name: str, tail: str) -> web.StreamResponse | None:
        if name != "headers":
            return None
        seen.append(dict(request.headers))
        return web.Response(text="ok")

    gw.system.gateway.add_invoke_hook(hook)
    before = time.time_ns()
    res = requests.post(f"{gw.url}/function/headers", headers={"X-Call-Id": "abc"}, timeout=10)
    check_trace(res, before, "abc")
    assert seen[-1]["X-Call-Id"] == "abc" and seen[-1]["X-Start-Time"] == res.headers["X-Start-Time"]
    res = requests.post(f"{gw.url}/function/headers", timeout=10)
    assert seen[-1]["X-Call-Id"] == check_trace(res, before)


def test_async_keeps_the_client_call_id_through_to_the_callback(gw, callbacks):  # noqa: F811
    assert gw.deploy(faas_cli_deploy_body("echo")).status_code == 202
    gw.wait_available("echo", 1)
    before = time.time_ns()
    res = requests.post(f"{gw.url}/async-function/echo", data=b"later", timeout=10,
                        headers={"X-Call-Id": "mine-1", "X-Callback-Url": callbacks.url})
    assert res.status_code == 202
    check_trace(res, before, "mine-1")
    headers, body = callbacks.next()
    assert headers["X-Call-Id"] == "mine-1" and body == b"later"
    res = requests.post(f"{gw.url}/async-function/echo", data=b"x", timeout=10)
    check_trace(res, before)
    check_trace(requests.get(f"{gw.url}/async-function/echo", timeout=10), before)  # 405 too


@with_cluster
async def test_router_answers_carry_the_call_id(cluster: Cluster) -> None:
    async with routed(cluster) as (_router, client):
        ok = await client.post("/function/m", data=b"x", headers={"X-Call-Id": "given"})
        assert ok.status == 200 and ok.headers["X-Call-Id"] == "given"
        missing = await client.post("/function/nope", data=b"x")
        assert missing.status == 404 and uuid.UUID(missing.headers["X-Call-Id"]).version == 4
        wrong = await client.get("/function/m", headers={"X-Call-Id": "g2"})
        assert wrong.status == 405 and wrong.headers["X-Call-Id"] == "g2"
