"""The plugin's ports (gateway_plugin.ports) and who implements them: every member, on both platforms; and the
standalone plugin over an OpenFaaS gateway whose stages answer ``X-Quart-Layers-Held`` (issue 40's 502)."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from aiohttp import web
from gateway_plugin import ports
from gateway_plugin.actuators.faas_cli import FaasCliActuator
from gateway_plugin.actuators.gateway import GatewayActuator
from gateway_plugin.actuators.rest import RestActuator
from gateway_plugin.config import PluginConfig
from gateway_plugin.replicas import StaticReplica, StaticReplicas
from gateway_plugin.standalone import OpenFaaSView, StandalonePlugin
from gateway_plugin.view import GatewayView
from quart_provider.gateway import EmbeddedGateway


def _members(protocol: type) -> dict[str, object]:
    """Every member a Protocol declares, its own and its bases' (methods, properties, attributes)."""
    out: dict[str, object] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        out.update({name: value for name, value in vars(cls).items() if not name.startswith("_")})
        out.update({name: None for name in getattr(cls, "__annotations__", {}) if not name.startswith("_")})
    return out


def _parameters(function: object) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]  # type: ignore[arg-type]


IMPLEMENTATIONS = [
    (ports.PluginHost, EmbeddedGateway),
    (ports.Platform, OpenFaaSView),
    (ports.ReplicaSource, GatewayView),
    (ports.DecisionNotes, GatewayView),
    (ports.ReplicaSource, StaticReplicas),
    (ports.Scaler, GatewayActuator),
    (ports.Scaler, RestActuator),
    (ports.Scaler, FaasCliActuator),
]


@pytest.mark.parametrize(("port", "implementation"), IMPLEMENTATIONS,
                         ids=[f"{i.__name__}-{p.__name__}" for p, i in IMPLEMENTATIONS])
def test_each_implementation_has_every_member_of_its_port(port: type, implementation: type) -> None:
    """What mypy checks in ``make lint``, at run time too: no member missing, the same parameters."""
    members = _members(port)
    assert members, port
    for name, declared in members.items():
        if declared is None or isinstance(declared, property):
            continue  # an attribute or a property: set on instances (checked by mypy)
        have = getattr(implementation, name, None)
        assert callable(have), f"{implementation.__name__} lacks {port.__name__}.{name}"
        assert _parameters(have) == _parameters(declared), (implementation.__name__, name)
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(declared), (implementation.__name__, name)


def test_the_protocols_list_their_members() -> None:
    assert {"ready", "take", "give_back", "wait", "waiting", "service_times", "note_held", "mark_unreachable",
            "scale_from_zero", "concurrency"} <= set(_members(ports.ReplicaSource))
    assert {"pipelines", "function", "note_decision", "check_placement", "watch_sessions", "watch_demand",
            "ready", "note_held"} <= set(_members(ports.Platform))
    assert {"in_flight", "held", "id", "url", "layers", "part", "state"} == set(_members(ports.Replica))


class FakeOpenFaaS:
    """An OpenFaaS gateway's REST API on loopback: one pipeline of two stages, each answering its body back with
    the layers it holds (as every stage runtime with a manifest does)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def functions(self, request: web.Request) -> web.Response:
        return web.json_response([
            {"name": f"m-stage-{i}", "namespace": "openfaas-fn", "replicas": 1, "availableReplicas": 1,
             "labels": {"com.quart.model": "m", "com.quart.stage": str(i), "com.quart.concurrency": "2"},
             "limits": {"cpu": "500m"}, "envVars": {"QUART_MODEL_DIR": "/models/m"}} for i in range(2)])

    async def invoke(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.calls.append(name)
        body = await request.read()
        held = "0-3" if name.endswith("0") else "3-6"
        return web.Response(body=body + name[-1].encode(), content_type="application/octet-stream",
                            headers={"X-Quart-Layers-Held": held})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/system/functions", self.functions)
        app.router.add_post("/function/{name}", self.invoke)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def test_the_standalone_plugin_runs_stages_that_say_which_layers_they_hold() -> None:
    """Issue 40: ``Router.exchange`` tells its source the layers a stage's answer says it holds; the OpenFaaS view
    has that member (it had not: every one-shot call through the standalone plugin was answered 502)."""

    async def main() -> None:
        gateway = FakeOpenFaaS()
        await gateway.start()
        plugin = StandalonePlugin(PluginConfig(gateway_url=gateway.url, policy="static", actuator="none",
                                               control_period_s=60.0, replica_refresh_s=0.1))
        runner = web.AppRunner(plugin.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                for _ in range(3):
                    async with session.post(f"{url}/function/m", data=b"x") as resp:
                        assert resp.status == 200, await resp.text()
                        assert await resp.read() == b"x01"
            assert gateway.calls == ["m-stage-0", "m-stage-1"] * 3
            view = plugin.view
            assert [r.held for r in view.ready("m-stage-0")] == [(0, 3)]  # noted on the slot
            assert view.concurrency("m-stage-0") == 2 and view.stage_meta("m-stage-1") == (0.5, 0)
            assert view.model_dir("m") == "/models/m" and view.namespace_of("m") == "openfaas-fn"
            state = view.stage_state("m-stage-0")
            assert (state.ready, state.desired, state.cpus, state.concurrency) == (1, 1, 0.5, 2)
        finally:
            await runner.cleanup()
            await gateway.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_openfaas_view_wakes_a_waiter_at_a_release_and_declares_what_it_lacks() -> None:
    async def main() -> None:
        view = OpenFaaSView("http://127.0.0.1:9", None)
        slot = StaticReplica("f#0", "http://127.0.0.1:9/function/f")
        waiter = view.wait("f")
        view.take("f", slot)
        assert slot.in_flight == 1 and not waiter.done()
        view.give_back("f", slot)
        await asyncio.sleep(0)
        assert slot.in_flight == 0 and waiter.done()
        assert view.waiting("f") == 0 and view.function("f") is None and view.pipelines() == {}
        view.scale_from_zero(["f"])  # the OpenFaaS gateway scales from zero itself: nothing to do, no error
        view.mark_unreachable("f", slot)
        view.note_decision("f", "1 -> 2: policy")
        assert view.decisions == {"f": "1 -> 2: policy"}

    asyncio.run(main())
