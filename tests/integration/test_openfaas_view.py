"""The standalone plugin's ``OpenFaaSView`` as the router's replica source, against a fake OpenFaaS gateway on
loopback (``GET /system/functions``, ``POST /function/<stage>`` answered by a stage that reports the layers it
holds, as every stage runtime with a manifest does): the call is answered (it was a 502 when the view had no
``note_held``), the layers are kept on the slot, and a dispatcher waiting for a slot is woken by its release
and by a refresh that adds slots (not by the router's poll)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from gateway_plugin.config import PluginConfig
from gateway_plugin.router import Router
from gateway_plugin.standalone import OpenFaaSView
from gateway_plugin.view import GatewayView
from support.standalone import serve

LABELS = {"com.quart.model": "m", "com.quart.stages": "2"}


def fake_gateway(available: dict[str, int]) -> web.Application:
    async def functions(request: web.Request) -> web.Response:
        return web.json_response([{"name": f"m-stage-{i}", "availableReplicas": available[f"m-stage-{i}"],
                                   "replicas": available[f"m-stage-{i}"],
                                   "labels": {**LABELS, "com.quart.stage": str(i)}} for i in range(2)])

    async def stage(request: web.Request) -> web.Response:
        body = await request.read()
        index = int(request.match_info["name"].rsplit("-", 1)[1])
        return web.Response(body=body + b"|" + str(index).encode(),
                            headers={"X-Quart-Layers-Held": f"{4 * index}-{4 * index + 4}"})

    app = web.Application()
    app.router.add_get("/system/functions", functions)
    app.router.add_post("/function/{name}", stage)
    return app


async def _run() -> None:
    available = {"m-stage-0": 1, "m-stage-1": 1}
    runner, url = await serve(fake_gateway(available))
    view = OpenFaaSView(url, None)
    plugin_view = GatewayView(view)  # as the standalone plugin hands the platform to its router
    router = Router(plugin_view, plugin_view.pipelines, PluginConfig(), dispatch_poll_s=30.0)  # a poll would time out
    try:
        async with aiohttp.ClientSession() as session:
            await view.refresh(session)
            await router.start()
            answer = await asyncio.wait_for(router.invoke("m", b"x", timeout_s=10), 10)
            assert (answer.status, answer.body) == (200, b"x|0|1"), answer.body
            assert [r.held for r in view.ready("m-stage-1")] == [(4, 8)]  # the slot keeps what its pod said

            slot = view.ready("m-stage-0")[0]
            view.take("m-stage-0", slot)
            released = view.wait("m-stage-0")
            view.give_back("m-stage-0", slot)
            await asyncio.wait_for(released, 1)

            available["m-stage-1"] = 2
            more = view.wait("m-stage-1")
            await view.refresh(session)
            await asyncio.wait_for(more, 1)
            assert len(view.ready("m-stage-1")) == 2
            assert view.service_times("m-stage-0") is view.service_times("m-stage-0")  # one estimator a stage
    finally:
        await router.close()
        await runner.cleanup()


def test_the_openfaas_view_serves_the_router_a_stage_that_reports_its_layers() -> None:
    asyncio.run(_run())
