"""ParaServe through the gateway (issue 17): a cold stage starts as a P-part sub-pipeline on P hosts, every request
sent from the moment of the cold start is answered with the whole stage's output, the workers consolidate and
the surplus (the helpers) drains without losing a request; a part worker's host lost mid-start gives requests an
explicit error or the right answer, never a wrong one.

KeysManagers on Unix sockets (one replica slot each), the registry (moto) behind a proxy that delays every
ranged read (``DELAY_S``), so a part start is still in progress while the test acts; the gateway and the
pipeline router run in this process. The model is a tiny llama computed for real (cpu), so outputs compare
exactly with the stage loaded the ordinary way.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from quart_kernel.scheduling.paraserve import split_parts
from quart_kernel.scheduling.paraserve_groups import Group, layout_of_manifest
from quart_provider.paraserve_start import ParaServeStarts
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from support.keysmanager import Daemon, daemons_in_temp_dir, emulated
from support.live_registry import IDS, URL

DELAY_S = 6.0  # each ranged read after the first FAST_READS: the consolidation is still running while the test acts
FUNCTION = "ps-llama-0"


class SlowRegistry:
    """A proxy in front of the registry that holds every ranged GET after the first ``fast`` for ``delay_s``
    (``fast``: the header and part reads, two a worker)."""

    def __init__(self, target: str, delay_s: float) -> None:
        upstream = urlsplit(target)
        ranged = iter(range(1 << 30))
        self.fast = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                if "Range" in self.headers and next(ranged) >= proxy.fast:
                    time.sleep(delay_s)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for k, v in reply.getheaders():
                    if k.lower() not in {"content-length", "transfer-encoding", "connection"}:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = _forward  # noqa: N815

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_split_parts_balances_bytes_and_tiles_the_layers() -> None:
    assert split_parts([10, 1, 1, 1, 1, 1, 1, 10], 4) == [(0, 1), (1, 4), (4, 7), (7, 8)]
    assert split_parts([3] + [64] * 16 + [40], 4) == [(0, 5), (5, 9), (9, 13), (13, 18)]
    assert split_parts([7, 7], 5) == [(0, 1), (1, 2)]  # at most one part a layer
    assert split_parts([5], 1) == [(0, 1)]
    with pytest.raises(ValueError):
        split_parts([], 2)


def test_layout_and_groups_protect_members_until_all_are_whole() -> None:
    from types import SimpleNamespace

    from quart_kernel.scheduling.starts import StartPlan
    from quart_provider.config import GatewayConfig
    from quart_provider.types import Endpoint

    manifest = {"stages": [{"start": 2, "end": 5, "layer_bytes": [[0, 10], [10, 30], [30, 40]],
                            "layer_sha256": ["a", "b", "c"]}]}
    layout = layout_of_manifest(manifest, 0)
    assert layout.layer_bytes == (10, 20, 10) and layout.parts(2) == [(2, 3), (3, 5)]
    assert layout_of_manifest({"stages": [{"start": 0, "end": 1}]}, 0) is None
    ps = ParaServeStarts(GatewayConfig(paraserve=True))
    plans = [StartPlan("f", "a", "paraserve", group=("a", "b"), helpers=("b",))]
    [group] = ps.plan_groups(plans, {"f": layout}).values()
    assert isinstance(group, Group) and group.part_on("b") == (3, 5) and ps.chosen == [("f", 2)]
    e1 = Endpoint("r1", "f", "a", "u", "ready", "cold", 1, 0.0, layers=(2, 5), held=(2, 3))
    e2 = Endpoint("r2", "f", "b", "u", "ready", "cold", 1, 0.0, layers=(2, 5), held=(3, 5))
    fn = SimpleNamespace(name="f", replicas={"r1": e1, "r2": e2})
    group.started(["r1"])
    assert ps.protected(fn) == {"r1"}
    group.started(["r2"])
    e1.held = (2, 5)
    assert ps.protected(fn) == {"r1", "r2"}  # r2 still holds a part only
    e2.held = (2, 5)
    assert ps.protected(fn) == set() and ps.groups["f"] == []  # consolidated: the surplus rule takes over


@pytest.fixture
def cluster(registry, monkeypatch):  # noqa: F811
    endpoint, _, _ = registry
    proxy = SlowRegistry(endpoint, DELAY_S)
    monkeypatch.setenv("QUART_REGISTRY_ENDPOINT", proxy.url)  # the daemons and the gateway's manifest read
    with daemons_in_temp_dir() as (root, daemons, _pids):
        for i in range(3):
            d = Daemon(root, f"h{i}", "--gpus", "1").start()
            daemons.append(d)
            d.client.ensure_cached(emulated())  # the preloader is up
        yield daemons, proxy
    proxy.close()


def _reference(registry) -> bytes:  # noqa: F811
    _, model, _ = registry
    rt = StageRuntime.load(StageConfig(model_dir=str(model), stage_index=0))
    resp = rt.handle(json.dumps({"input_ids": IDS}).encode(), {"Content-Type": "application/json"})
    assert resp.status == 200
    return resp.body


def _diff(a: bytes, b: bytes):
    ta, tb = wire.decode(a).tensors, wire.decode(b).tensors
    return {k: (ta[k].shape, tb[k].shape, (ta[k] - tb[k]).abs().max().item()) for k in ta if k in tb}, list(ta)


def _same(a: bytes, b: bytes) -> bool:
    ta, tb = wire.decode(a).tensors, wire.decode(b).tensors
    return ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)


async def _run(cluster, tmp_path, parts: int, fault) -> tuple[list, object, object]:
    from gateway_plugin.config import PluginConfig
    from gateway_plugin.plugin import GatewayView
    from gateway_plugin.router import Router
    from quart_kernel.scheduling import make_placer
    from quart_provider.config import GatewayConfig
    from quart_provider.deployment import FunctionDeployment
    from quart_provider.gateway import EmbeddedGateway
    from quart_provider.keysmanager_host import KeysManagerHost

    from keysmanager.client import AsyncKeysManagerClient

    daemons, proxy = cluster[0][:parts], cluster[1]
    proxy.fast = 2 * parts
    config = GatewayConfig(port=0, state_dir=tmp_path / "gw", reconcile_interval_s=0.05, host_timeout_s=2.0,
                           host_down_after_s=1.0, peer_fetch=False, paraserve=True, paraserve_parts=parts,
                           ready_probe_s=0.005, drain_timeout_s=30.0)
    hosts = [KeysManagerHost(d.name, AsyncKeysManagerClient(str(d.socket), timeout=120), 1, 1 << 30) for d in daemons]
    gw = EmbeddedGateway(config, hosts, make_placer("first-fit"))
    await gw.start()
    router = Router(GatewayView(gw), gw.registry.pipelines, PluginConfig(request_timeout_s=60.0, attempt_timeout_s=30.0))
    try:
        await gw.registry.deploy(FunctionDeployment.from_json({
            "service": FUNCTION, "image": "quart/pipeline-stage",
            "envVars": {"QUART_MODEL_URL": URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "cpu"},
            "labels": {"com.quart.model": "live-llama", "com.quart.stage": "0", "com.quart.stages": "1",
                       "com.quart.concurrency": "1", "com.openfaas.scale.min": "1"}}, config.namespace))
        fn = gw.functions[FUNCTION]
        body = json.dumps({"input_ids": IDS}).encode()

        async def one(i: int):
            await asyncio.sleep(0.15 * i)
            reply = await router.invoke("live-llama", body, "application/json")
            return reply.status, reply.body

        sends = asyncio.gather(*(one(i) for i in range(40)))
        seen_partial = faulted = False
        deadline = time.monotonic() + 90
        paraserve = gw.reconciler.paraserve
        while gw.reconciler.pending_starts(FUNCTION) or paraserve.groups.get(FUNCTION) or len(fn.replicas) != 1 or len(fn.ready) != 1:
            parted = [e for e in fn.replicas.values() if not e.whole]
            seen_partial = seen_partial or bool(parted)
            if fault is not None and len(fn.replicas) >= 2 and parted:
                fault(fn)
                fault, faulted = None, True
            assert time.monotonic() < deadline, (fn.replicas, fn.ready, fn.partial)
            await asyncio.sleep(0.01)
        results = await sends
        assert fault is None and (faulted or parts < 3), "the fault never ran: the start consolidated first"
        return results, seen_partial, [(g.hosts, g.parts, len(g.members)) for g in paraserve.history]
    finally:
        await router.close()
        await gw.close()


def test_a_cold_start_in_parts_answers_every_request_and_drains_helpers(registry, cluster, tmp_path):  # noqa: F811
    results, seen_partial, groups = asyncio.run(_run(cluster, tmp_path, 2, None))
    assert seen_partial  # the parts served before they were whole
    assert groups == [(("h0", "h1"), [(0, 3), (3, 6)], 2)]  # both started with their part; one replica remains
    want = _reference(registry)
    assert all(status == 200 and _same(body, want) for status, body in results), [
        (s, _diff(b, want)) for s, b in results]


def test_a_part_workers_host_lost_mid_start_errors_never_wrong(registry, cluster, tmp_path):  # noqa: F811
    def kill_second(fn) -> None:  # the KeysManager of a part worker still loading (its replicas die with it)
        host = max((e for e in fn.replicas.values() if not e.whole), key=lambda e: e.started_at).host
        next(d for d in cluster[0] if d.name == host).kill(signal.SIGKILL)

    results, _, groups = asyncio.run(_run(cluster, tmp_path, 3, kill_second))
    assert [len(g[0]) for g in groups] == [3]
    want = _reference(registry)
    for status, body in results:
        assert status == 200 and _same(body, want) or status >= 500 and b"error" in body.lower(), (status, body[:200])
    assert sum(status == 200 for status, _ in results) >= len(results) // 2
