"""Controller: scripted unit steps, then the whole plugin attached to a real embedded gateway."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

import pytest
from gateway_plugin.config import PluginConfig
from gateway_plugin.controller import Controller
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.policies import make_policy
from gateway_plugin.snapshot import Decision, PipelineSnapshot, StageDecision, snapshot_from_json
from gateway_plugin.snapshot_builder import StageState


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
    target (all of it m-0's share: m-1 decodes nothing) a replica carries 4 × ⌊100 / 60⌋ = 4 sessions, so a
    policy's 2 replicas become 3; without a target only the KV room counts and 2 stay. Static-k holds its k."""
    inventory = FakeInventory({"m-0": StageState(2, 2), "m-1": StageState(2, 2)})

    class HoldTwo:
        name = "hold-two"

        def decide(self, snap: PipelineSnapshot) -> Decision:
            return Decision(snap.time, tuple(StageDecision(2, s.cpus, "two") for s in snap.stages))

    def decided(tpot_ms: float, policy=HoldTwo) -> list[tuple[int, str]]:
        ctl = Controller(inventory, FakeQueues({}), MetricsCollector(window_s=10.0), RecordingActuator(), policy,
                         PluginConfig(tpot_slo_ms=tpot_ms), clock=lambda: 5.0, generation=FakeGeneration(sessions=12))
        return [(s.replicas, s.reason) for s in ctl.decide()[0]["m"].stages]

    (raised, why), (other, _) = decided(100.0)
    assert (raised, other) == (3, 2) and why.startswith("two; sessions: 12 sessions at <= 4 a replica")
    assert [r for r, _ in decided(0.0)] == [2, 2]
    assert [r for r, _ in decided(100.0, lambda: make_policy("static", replicas=2))] == [2, 2]


def test_a_traffic_surge_wakes_the_running_controller_before_its_period() -> None:
    """The live loop: a 10 s period, yet arrivals at 4 × what the stage's replica serves run a decision at once
    (gateway_plugin.kick), and a storm of arrivals after it runs no other within kick_min_interval_s."""
    now = [0.0]
    collector = MetricsCollector(window_s=10.0)
    inventory = FakeInventory({"m-0": StageState(1, 1, profiled_service_s=0.02)})  # μ = 50 req/s
    decided: list[float] = []

    class Holds:
        def decide(self, snap: PipelineSnapshot) -> Decision:
            decided.append(snap.time)
            return Decision(snap.time, (StageDecision(1, 1.0, "hold"),))

    ctl = Controller(inventory, FakeQueues({}), collector, RecordingActuator(), Holds,
                     PluginConfig(control_period_s=10.0, kick_min_interval_s=0.25), clock=lambda: now[0])

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(ctl.run(stop))
        try:
            await asyncio.sleep(0.05)
            assert decided == [0.0]  # the first tick
            for k in range(120):  # 200 req/s from t = 0.3 s: 4 × what the replica serves, measurable from 0.8 s
                now[0] = 0.3 + k / 200
                collector.stage("m-0").on_arrival(now[0], 100)
            await asyncio.sleep(0.2)  # well before the next tick at t = 10 s
            # kicked by the arrival at 0.8 s; decided when the loop woke, after this burst was fed (0.895 s)
            assert decided == [0.0, pytest.approx(0.895)] and ctl.kicker.kicks == 1, decided
            for _ in range(300):  # the storm goes on at the same simulated instant: the bound holds
                collector.stage("m-0").on_arrival(now[0], 100)
            await asyncio.sleep(0.1)
            assert len(decided) == 2, decided
            now[0] += 0.3  # the storm is > 2 × the 200 req/s the last decision saw: bounded, not dropped
            collector.stage("m-0").on_arrival(now[0], 100)
            await asyncio.sleep(0.1)
            assert decided[2:] == [pytest.approx(1.195)], decided
        finally:
            stop.set()
            await task
        rows = list(ctl.timeline)
        assert [row["kicked"] for row in rows] == [False, True, True]
        assert ctl.kicker.kicks == 2 and ctl.on_kick is None

    asyncio.run(scenario())
