"""The scheduler wired into the embedded gateway: requests carry the stage's parameter bytes and key flag,
keep_cached is pinned on the hosts, and /metrics carries hit rate, ready time by source and host use."""

from __future__ import annotations

import asyncio
import itertools
import re
import time

import pytest
import requests
from quart_kernel.scheduling import HostView, make_placer
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment
from quart_provider.gateway import EmbeddedGateway
from quart_provider.hosts import ReplicaSpec, ReplicaStatus, Started
from support.embedded_system import ThreadedSystem

from keysmanager.types import StartOrder


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text format (labels in any order)."""
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"no sample {name}{labels} in /metrics")


class FakeStageHost:
    """A host whose KeysManager holds `cached` stages: forks those at once, 'cold-starts' others (no process)."""

    def __init__(self, name: str, cached: set[str], slots: int = 4) -> None:
        self.name, self.cached, self.slots = name, set(cached), slots
        self.live: dict[str, ReplicaStatus] = {}
        self.pins: list[list[str]] = []
        self._ids = itertools.count(1)

    async def report(self) -> HostView:
        running: dict[str, int] = {}
        for r in self.live.values():
            running[r.function] = running.get(r.function, 0) + 1
        return HostView(self.name, self.slots, len(self.live), 10 << 30, 0, frozenset(self.cached), running)

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        source = "fork" if spec.function in self.cached else "cold"  # what a KeysManager's start path says
        out = []
        for _ in range(order.count):
            self.cached.add(spec.function)
            rid = f"{self.name}-{next(self._ids)}"
            self.live[rid] = ReplicaStatus(rid, spec.function, self.name, "http://127.0.0.1:9", "ready", source)
            out.append(self.live[rid])
        return Started(out, source)

    async def stop(self, replica_id: str) -> None:
        self.live.pop(replica_id, None)

    async def replicas(self) -> list[ReplicaStatus]:
        return list(self.live.values())

    async def invalidate(self, function: str) -> None:
        self.cached.discard(function)

    async def close(self) -> None:
        self.live.clear()

    async def pin(self, functions: list[str], sole: list[str] | None = None) -> list[str]:
        self.pins.append(functions)
        self.sole = sole
        return functions


class RecordingPlacer:
    def __init__(self, inner) -> None:
        self.inner, self.name, self.requests = inner, inner.name, []

    def place(self, hosts, requests, key_history=None):
        self.requests.append(list(requests))
        return self.inner.place(hosts, requests, key_history)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from quart_tools.partition import partition

    out = tmp_path_factory.mktemp("model")
    partition("tiny", 2, str(out), weights="random", progress=False)
    return out


def test_gateway_places_with_parameter_bytes_pins_kept_zygotes_and_counts_hits(tmp_path, tiny_model):
    from keysmanager.stage import resolve_stage

    function = "tiny-stage-1"
    env = {"QUART_MODEL_DIR": str(tiny_model), "QUART_STAGE_INDEX": "1", "QUART_COMPUTE": "emulated"}
    size = resolve_stage(function, env).param_bytes
    assert size > 0

    async def scenario() -> None:
        hosts = [FakeStageHost("h0", {function}), FakeStageHost("h1", set())]
        placer = RecordingPlacer(make_placer("cache-aware"))
        gw = EmbeddedGateway(GatewayConfig(port=0, state_dir=tmp_path, reconcile_interval_s=0.02), hosts, placer)
        await gw.start()
        try:
            await gw.registry.deploy(FunctionDeployment.from_json(
                {"service": function, "image": "tiny-stage", "envVars": env,
                 "labels": {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "6"}}, gw.config.namespace))
            deadline = time.monotonic() + 10
            while gw.scheduler_metrics.snapshot().scale_ups < 1:  # the deploy's replica first
                assert time.monotonic() < deadline, "first replica not ready"
                await asyncio.sleep(0.01)
            await gw.registry.scale(function, 3, key=True)
            while len(gw.functions[function].ready) < 3 or gw.scheduler_metrics.snapshot().scale_ups < 3:
                assert time.monotonic() < deadline, "replicas not ready"
                await asyncio.sleep(0.01)
            assert all(r.param_bytes == size for batch in placer.requests for r in batch)
            assert any(r.key for batch in placer.requests for r in batch)
            assert {e.host for e in gw.functions[function].ready} == {"h0"}  # the cached host, all forks
            assert hosts[0].pins[-1] == [function] and hosts[1].pins == []  # keep_cached, made binding
            assert hosts[0].sole == [function]  # no other host holds it: evicted after any duplicate
            snap = gw.scheduler_metrics.snapshot()
            assert (snap.hits, snap.scale_ups) == (3, 3) and snap.key_hit_rate == 1.0
            assert snap.key_scale_ups == 2  # the deploy's first replica was not a key-stage scale-up
            assert 0 < snap.ready["fork"].max_ms < 10_000
            assert [h.name for h in snap.hosts] == ["h0", "h1"]
            text = gw.metrics.render().decode()
            assert _sample(text, "quart_scheduler_cache_hit_ratio", stages="key") == 1.0
            assert _sample(text, "quart_scheduler_replica_ready_ms_count", source="fork") == 3
            assert _sample(text, "quart_scheduler_scale_ups_total", source="fork", key="true") == 2
            assert _sample(text, "quart_host_gpu_slots", host="h1") == 4
        finally:
            await gw.close()

    asyncio.run(scenario())


def test_metrics_endpoint_has_scale_up_and_ready_time_series_after_a_scale_up(tmp_path):
    system = ThreadedSystem(tmp_path, hosts=2, gpus_per_host=2)
    try:
        body = {"service": "echo", "image": "quart/echo:latest",
                "labels": {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "4"}}
        assert requests.post(f"{system.url}/system/functions", json=body, auth=system.auth, timeout=30).ok
        gateway = system.system.gateway
        deadline = time.monotonic() + 30
        while gateway.scheduler_metrics.snapshot().scale_ups < 1:  # the deploy's replica first
            assert time.monotonic() < deadline, "first echo replica not ready"
            time.sleep(0.02)
        assert system.call(gateway.registry.scale("echo", 3, key=True)) == 3
        while gateway.scheduler_metrics.snapshot().scale_ups < 3:
            assert time.monotonic() < deadline, "echo replicas not ready"
            time.sleep(0.02)
        text = requests.get(f"{system.url}/metrics", timeout=10).text
        # process replicas have no parameter cache: every start is cold, none is a hit
        assert _sample(text, "quart_scheduler_scale_ups_total", source="cold", key="true") == 2
        assert _sample(text, "quart_scheduler_scale_ups_total", source="cold", key="false") == 1
        assert _sample(text, "quart_scheduler_cache_hit_ratio", stages="all") == 0.0
        count = _sample(text, "quart_scheduler_replica_ready_ms_count", source="cold")
        total = _sample(text, "quart_scheduler_replica_ready_ms_sum", source="cold")
        assert count == 3 and 0 < total / count < 30_000
        assert _sample(text, "quart_scheduler_schedules_total") >= 2
        used = sum(_sample(text, "quart_host_gpu_used", host=h) for h in ("host-0", "host-1"))
        assert used == 1  # host use as reported before the scale-up's placement: the deploy's replica
        assert _sample(text, "gateway_service_count", function_name="echo.openfaas-fn") == 3
    finally:
        system.close()


class FakePeerHost(FakeStageHost):
    """A FakeStageHost with a KeysManager address: records the chain orders (prefetch) and the peers and
    live flag each start is given."""

    def __init__(self, name: str, cached: set[str], slots: int, told: list) -> None:
        super().__init__(name, cached, slots)
        self.told = told

    @property
    def peer_address(self) -> str:
        return f"http://{self.name}:7077"

    async def prefetch(self, spec: ReplicaSpec, peers=()) -> dict:
        self.told.append(("prefetch", self.name, list(peers)))
        return {}

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        self.told.append(("start", self.name, list(order.peers), order.mode))
        return await super().start(spec, order)


def test_scale_up_onto_hosts_without_the_stage_multicasts_from_the_holder_and_starts_live(tmp_path):
    """Three hosts need a stage only h0 holds: the reconciler orders the chain (h0 → h1 → h2 → h3) before the
    starts, each start names its predecessor then the source as peers, and with live_scaling each starts live."""
    function = "m-stage-0"
    told: list = []

    async def scenario() -> None:
        hosts = [FakePeerHost("h0", {function}, 1, told)] + [FakePeerHost(f"h{i}", set(), 1, told) for i in (1, 2, 3)]
        gw = EmbeddedGateway(GatewayConfig(port=0, state_dir=tmp_path, reconcile_interval_s=0.02, live_scaling=True),
                             hosts, make_placer("first-fit"))
        await gw.start()
        try:
            await gw.registry.deploy(FunctionDeployment.from_json(
                {"service": function, "image": "m-stage", "envVars": {  # a registry stage: its bytes are fetched
                    "QUART_MODEL_URL": "s3://models/m", "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "emulated"},
                 "labels": {"com.openfaas.scale.min": "1", "com.openfaas.scale.max": "4"}}, gw.config.namespace))
            deadline = time.monotonic() + 10
            while len(gw.functions[function].ready) < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            told.clear()
            await gw.registry.scale(function, 4)
            while len(gw.functions[function].ready) < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        finally:
            await gw.close()

    asyncio.run(scenario())
    src = "http://h0:7077"
    prefetches = [t for t in told if t[0] == "prefetch"]
    assert prefetches == [("prefetch", "h1", [src]), ("prefetch", "h2", ["http://h1:7077", src]),
                          ("prefetch", "h3", ["http://h2:7077", src])]
    starts = sorted(t for t in told if t[0] == "start")
    assert starts == [("start", "h1", [src], "live"), ("start", "h2", ["http://h1:7077", src], "live"),
                      ("start", "h3", ["http://h2:7077", src], "live")]
    assert told.index(prefetches[-1]) < min(told.index(s) for s in starts)  # the chain is told before the starts
