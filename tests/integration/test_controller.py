"""Controller: scripted unit steps, then the whole plugin attached to a real embedded gateway."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

import pytest
import requests
from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Controller
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.policies import make_policy
from gateway_plugin.snapshot import snapshot_from_json
from gateway_plugin.snapshot_builder import StageState
from support.embedded_system import ThreadedSystem


class FakeInventory:
    def __init__(self, states: dict[str, StageState]) -> None:
        self.states = states

    def pipelines(self) -> dict[str, list[str]]:
        return {"m": list(self.states)}

    def stage_state(self, function: str) -> StageState:
        return self.states[function]


class FakeQueues:
    def __init__(self, queue: dict[str, int]) -> None:
        self.queue = queue

    def queue_len(self, function: str) -> int:
        return self.queue.get(function, 0)

    def busy(self, function: str) -> int:
        return 1


class RecordingActuator:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        self.calls.append(("scale", function, replicas, key))

    async def set_cpus(self, function: str, cpus: float) -> None:
        self.calls.append(("cpus", function, cpus))


def test_controller_step_scales_the_congested_stage_as_key() -> None:
    now = [100.0]
    collector = MetricsCollector(window_s=10.0)
    # stage-1 sees 4 req/s at 0.5 s per request on 1 replica (ρ = 2); stage-0 is fast
    for k in range(40):
        t = 90.0 + k * 0.25
        collector.stage("m-0").on_arrival(t, 100)
        collector.stage("m-0").on_dispatch(t, 0.0)
        collector.stage("m-0").on_complete(t, 0.01)
        collector.stage("m-1").on_arrival(t, 100)
        if k % 2 == 0:
            collector.stage("m-1").on_dispatch(t, 1.0)
            collector.stage("m-1").on_complete(t, 0.5)
    inventory = FakeInventory({"m-0": StageState(2, 2), "m-1": StageState(1, 1, max_replicas=8)})
    actuator = RecordingActuator()
    log_lines: list[str] = []

    class Sink:
        def write(self, line: str) -> None:
            log_lines.append(line)

    ctl = Controller(inventory, FakeQueues({"m-1": 12}), collector, actuator, lambda: make_policy("quart"),
                     PluginConfig(slo_factor=2.0), clock=lambda: now[0], log_file=Sink())
    decision = asyncio.run(ctl.step())["m"]
    assert decision.key_stages == (1,)
    scale_calls = [c for c in actuator.calls if c[0] == "scale"]
    assert ("scale", "m-1", decision.stages[1].replicas, True) in scale_calls
    assert decision.stages[1].replicas >= 3  # 4 req/s ÷ 2 req/s per replica, ρ < 1
    snap = ctl.last_snapshots["m"]
    assert snap.stages[1].queue_len == 12 and snap.stages[1].arrival_rate == pytest.approx(4.0, rel=0.1)
    assert snap.slo_s == pytest.approx(2.0 * (0.01 + 0.5), rel=0.01)
    import json

    again = snapshot_from_json(json.loads(log_lines[0])["snapshot"])
    assert again == snap
    assert ctl.timeline[0]["key_stages"] == [1]
    assert b"quart_stage_queue_length" in collector.prometheus_text()


class FakeGeneration:
    """The session engine's per-stage view (``SessionEngine.stage_generation``)."""

    def __init__(self, sessions: int = 3) -> None:
        self.sessions = sessions

    def stage_generation(self, function: str) -> tuple[int, int, int]:
        return {"m-0": (self.sessions, 32 * self.sessions, 8192)}.get(function, (0, 0, 0))

    def stage_decode(self, function: str) -> tuple[tuple[tuple[int, int, float], ...], int]:
        if function != "m-0":
            return (), 1
        return ((1, 40, 0.030), (2, 30, 0.040), (4, 20, 0.060)), 4  # S(b) = 20 ms + 10 ms a session, B = 4


def test_the_snapshot_carries_each_stages_sessions_and_kv_occupancy() -> None:
    import json

    collector = MetricsCollector(window_s=10.0)
    inventory = FakeInventory({"m-0": StageState(2, 2), "m-1": StageState(1, 1)})
    ctl = Controller(inventory, FakeQueues({}), collector, RecordingActuator(), lambda: make_policy("static"),
                     clock=lambda: 5.0, generation=FakeGeneration())
    ctl.decide()
    snap = ctl.last_snapshots["m"]
    assert [(s.sessions, s.kv_tokens, s.kv_capacity) for s in snap.stages] == [(3, 96, 8192), (0, 0, 0)]
    assert snap.stages[0].decode_service_s[-1] == (4, 20, 0.060) and snap.stages[0].decode_batch_max == 4
    text = collector.prometheus_text().decode()
    assert 'quart_stage_kv_tokens{function="m-0",model="m",stage="0"} 96.0' in text
    assert 'quart_stage_sessions{function="m-0",model="m",stage="0"} 3.0' in text
    assert snapshot_from_json(json.loads(json.dumps(asdict(snap)))) == snap

    class Idle(FakeQueues):
        def busy(self, function: str) -> int:
            return 0  # nothing in service: only the sessions (between their steps) keep the pipeline busy

    scalable = FakeInventory({"m-0": StageState(2, 2, min_replicas=0), "m-1": StageState(1, 1, min_replicas=0)})

    def to_zero(generation) -> list[int]:
        ctl = Controller(scalable, Idle({}), MetricsCollector(window_s=10.0), RecordingActuator(),
                         lambda: make_policy("static", replicas=0), clock=lambda: 5.0, generation=generation)
        return [s.replicas for s in ctl.decide()[0]["m"].stages]

    assert to_zero(FakeGeneration()) == [1, 1]  # sessions run: no stage goes to 0
    assert to_zero(None) == [0, 0]
    bare = Controller(inventory, FakeQueues({}), MetricsCollector(window_s=10.0), RecordingActuator(),
                      lambda: make_policy("static"), clock=lambda: 5.0)  # no engine (the simulator): zeros
    bare.decide()
    assert all(s.sessions == s.kv_tokens == s.kv_capacity == 0 for s in bare.last_snapshots["m"].stages)


def test_a_generating_stage_is_raised_to_what_its_sessions_need_within_the_tpot_target() -> None:
    """12 sessions on m-0, whose decode step takes 20 ms + 10 ms a session (batches of 4): with a 100 ms TPOT
    target (all of it m-0's share: m-1 decodes nothing) a replica carries 4 × ⌊100 / 60⌋ = 4 sessions, so the
    static policy's 2 replicas become 3; without a target only the KV room counts and 2 stay."""
    inventory = FakeInventory({"m-0": StageState(2, 2), "m-1": StageState(2, 2)})

    def decided(tpot_ms: float) -> list[tuple[int, str]]:
        ctl = Controller(inventory, FakeQueues({}), MetricsCollector(window_s=10.0), RecordingActuator(),
                         lambda: make_policy("static", replicas=2), PluginConfig(tpot_slo_ms=tpot_ms),
                         clock=lambda: 5.0, generation=FakeGeneration(sessions=12))
        return [(s.replicas, s.reason) for s in ctl.decide()[0]["m"].stages]

    (raised, why), (other, _) = decided(100.0)
    assert (raised, other) == (3, 2) and "12 sessions at <= 4 a replica" in why
    assert [r for r, _ in decided(0.0)] == [2, 2]


# ---------------------------------------------------------------- integration with the embedded gateway


class PluginGateway(ThreadedSystem):
    """EmbeddedSystem with the plugin attached, on its own loop thread; echo replicas as stages."""

    def __init__(self, tmp_path) -> None:
        # slots for every replica the static policy asks (2 per stage, 3 stages): with fewer, the placer could
        # fill the host before the last stage got one, and a pipeline request would wait for it forever
        super().__init__(tmp_path, attach_plugin=True, gpus_per_host=8)

    def deploy_stage(self, model: str, index: int, stages: int, **labels: str) -> None:
        body = {"service": f"{model}-stage-{index}", "image": "quart/echo:latest",
                "labels": {"com.quart.model": model, "com.quart.stage": str(index), "com.quart.stages": str(stages),
                           "com.openfaas.scale.min": "1", "com.openfaas.scale.max": "4", **labels}}
        res = requests.post(f"{self.url}/system/functions", json=body, auth=self.auth, timeout=30)
        assert res.status_code == 202, res.text

    def available(self, name: str) -> int:
        res = requests.get(f"{self.url}/system/function/{name}", auth=self.auth, timeout=10)
        return res.json()["availableReplicas"]


@pytest.fixture
def plugin_gw(tmp_path, monkeypatch):
    monkeypatch.setenv("QUART_POLICY", "static")  # static: 2 replicas per stage, whatever the load
    monkeypatch.setenv("QUART_CONTROL_PERIOD_S", "0.2")
    monkeypatch.setenv("QUART_RECORDS", str(tmp_path / "records.jsonl"))
    running = PluginGateway(tmp_path)
    try:
        yield running
    finally:
        running.close()


def test_plugin_routes_pipeline_and_controller_scales_through_gateway(plugin_gw, tmp_path) -> None:
    for i in range(2):
        plugin_gw.deploy_stage("m", i, 2)
    deadline = time.monotonic() + 30
    while not all(plugin_gw.available(f"m-stage-{i}") == 2 for i in range(2)):
        assert time.monotonic() < deadline, "controller did not scale both stages to 2"
        time.sleep(0.1)
    for k in range(5):
        res = requests.post(f"{plugin_gw.url}/function/m", data=f"hello {k}".encode(), timeout=10)
        assert res.status_code == 200 and res.content == f"hello {k}".encode()
    snap = requests.get(f"{plugin_gw.url}/function/quart-plugin/snapshot", timeout=10)
    deadline = time.monotonic() + 5
    while snap.json().get("m", {}).get("stages", [{}])[0].get("arrival_rate", 0) <= 0:
        assert time.monotonic() < deadline
        time.sleep(0.2)
        snap = requests.get(f"{plugin_gw.url}/function/quart-plugin/snapshot", timeout=10)
    stages = snap.json()["m"]["stages"]
    assert [s["replicas"] for s in stages] == [2, 2]
    metrics = requests.get(f"{plugin_gw.url}/metrics", timeout=10).text
    assert "quart_stage_arrival_rate" in metrics
    bad = requests.get(f"{plugin_gw.url}/function/m", timeout=10)
    assert bad.status_code == 405 and "POST" in bad.json()["error"]
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) >= 5 and '"status":200' in lines[0]


def _invocations(metrics: str, function: str) -> float:
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("gateway_function_invocation_total{") and f'function_name="{function}.openfaas-fn"' in line \
                and 'code="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_pipeline_traffic_counts_as_invocations_of_every_stage(plugin_gw) -> None:
    """The router calls replicas directly; it must still count each stage call like the gateway's proxy."""
    for i in range(3):
        plugin_gw.deploy_stage("p", i, 3)
    for k in range(4):
        res = requests.post(f"{plugin_gw.url}/function/p", data=f"x{k}".encode(), timeout=30)
        assert res.status_code == 200, res.text
    listing = requests.get(f"{plugin_gw.url}/system/functions", auth=plugin_gw.auth, timeout=10).json()
    counts = {f["name"]: f["invocationCount"] for f in listing}
    assert counts == {"p-stage-0": 4, "p-stage-1": 4, "p-stage-2": 4}
    metrics = requests.get(f"{plugin_gw.url}/metrics", timeout=10).text
    for i in range(3):
        assert _invocations(metrics, f"p-stage-{i}") == 4
        assert f'gateway_function_invocation_started{{function_name="p-stage-{i}.openfaas-fn"}} 4.0' in metrics
        assert f'gateway_functions_seconds_count{{code="200",function_name="p-stage-{i}.openfaas-fn"}} 4.0' in metrics
