"""The gateway core without HTTP: load balancing, readiness, overload, placement, rolling updates, parsing."""

from __future__ import annotations

import asyncio
import textwrap

import pytest
from quart_provider.balancer import ServiceUnavailable
from quart_provider.deployment import FunctionDeployment
from quart_provider.hosts import ReplicaSpec, ReplicaStatus, Started
from quart_provider.stack import StackError, load_stack
from quart_stage.errors import QuartError
from quart_transport.quantities import parse_cpu, parse_memory
from support.fake_hosts import FakeHost, dep, make, settle

from keysmanager.types import StartOrder


def test_no_traffic_before_ready_then_least_loaded(tmp_path):
    async def scenario():
        host = FakeHost("h0")
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep(**{"com.openfaas.scale.min": "2"}))
        await settle(gw)
        assert len(fn.replicas) == 2 and fn.ready == []
        assert gw.balancer.acquire_nowait(fn) is None  # starting replicas get nothing
        with pytest.raises(ServiceUnavailable) as err:
            await gw.balancer.acquire(fn)
        assert err.value.status == 503
        host.make_ready()
        await settle(gw)
        assert len(fn.ready) == 2
        a = gw.balancer.acquire_nowait(fn)
        b = gw.balancer.acquire_nowait(fn)
        assert a is not b  # least loaded: the second request goes to the idle replica
        gw.balancer.release(fn, a)
        c = gw.balancer.acquire_nowait(fn)
        assert c is a and a.in_flight == 1 and b.in_flight == 1
        spec = host.started[0]
        assert spec.cpus == 2.0 and spec.memory_bytes == 1 << 30 and spec.env["K"] == "v"
        await gw.close()

    asyncio.run(scenario())


def test_concurrency_limit_waits_then_429_when_queue_full(tmp_path):
    async def scenario():
        host = FakeHost("h0")
        gw = make(tmp_path, [host], max_waiting=1)
        fn = await gw.registry.deploy(dep(**{"com.quart.concurrency": "1"}))
        await settle(gw)
        host.make_ready()
        await settle(gw)
        held = gw.balancer.acquire_nowait(fn)
        assert held is not None and gw.balancer.acquire_nowait(fn) is None  # at its limit
        waiter = asyncio.create_task(gw.balancer.acquire(fn))
        await asyncio.sleep(0.02)
        with pytest.raises(ServiceUnavailable) as err:  # one already waits: max_waiting=1
            await gw.balancer.acquire(fn)
        assert err.value.status == 429
        gw.balancer.release(fn, held)
        got = await asyncio.wait_for(waiter, 1)
        assert got is held and got.in_flight == 1
        await gw.close()

    asyncio.run(scenario())


def test_placement_spreads_over_hosts_and_scale_down_drains(tmp_path):
    async def scenario():
        hosts = [FakeHost("h0", slots=1), FakeHost("h1", slots=1)]
        gw = make(tmp_path, hosts)
        fn = await gw.registry.deploy(dep())
        await gw.registry.scale("f", 3)
        await settle(gw)
        assert sorted(e.host for e in fn.replicas.values()) == ["h0", "h1"]
        assert fn.unplaced == 1  # two slots in all
        for h in hosts:
            h.make_ready()
        await settle(gw)
        busy = fn.ready[0]
        busy.in_flight += 1
        await gw.registry.scale("f", 1)
        await settle(gw)
        await asyncio.sleep(0.05)
        assert [e.id for e in fn.ready] == [busy.id]  # the idle replica went first
        assert sum(len(h.stopped) for h in hosts) == 1
        with pytest.raises(QuartError):
            await gw.registry.scale("f", -1)
        await gw.close()

    asyncio.run(scenario())


def test_rolling_update_keeps_old_replicas_until_new_ones_are_ready(tmp_path):
    async def scenario():
        host = FakeHost("h0")
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep())
        await settle(gw)
        host.make_ready()
        await settle(gw)
        [old] = fn.ready
        await gw.registry.update_limits("f", memory_bytes=2**31)
        assert host.invalidated == ["f"] and fn.generation == 2
        await settle(gw)
        assert [e.id for e in fn.ready] == [old.id]  # new one still starting
        assert host.started[-1].memory_bytes == 2**31
        host.make_ready()
        await settle(gw)
        await asyncio.sleep(0.05)
        assert [e.generation for e in fn.ready] == [2] and old.id in host.stopped
        await gw.close()

    asyncio.run(scenario())


def test_a_cpu_change_resizes_the_replicas_in_place(tmp_path):
    async def scenario():
        host = FakeHost("h0")
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep())  # dep(): 2 CPUs
        await settle(gw)
        host.make_ready()
        await settle(gw)
        [rep] = fn.ready
        assert rep.cpus == 2.0
        await gw.registry.update_limits("f", cpus=4)  # QUART's CPU compensation: no roll, no new replica
        await settle(gw)
        assert fn.generation == 1 and host.invalidated == [] and len(host.started) == 1
        assert host.resized == [(rep.id, 4.0)] and fn.ready == [rep] and rep.cpus == 4.0
        await gw.registry.update_limits("f", cpus=2)
        await settle(gw)
        assert host.resized[-1] == (rep.id, 2.0) and len(host.resized) == 2  # once per change
        await gw.close()

    asyncio.run(scenario())


class SlowHost(FakeHost):
    """A host whose replica listing and starts take a while, so a start can finish during a poll."""

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        await asyncio.sleep(0.02)
        return await super().start(spec, order)

    async def replicas(self) -> list[ReplicaStatus]:
        listing = list(self.replicas_.values())  # what the host knew when asked
        await asyncio.sleep(0.05)
        return listing


def test_a_replica_started_during_a_poll_is_kept(tmp_path):
    """The reconcile must not drop (and so orphan, and start again) a replica whose start finished after it
    polled the hosts: the answer could not list it."""
    host = SlowHost("h")

    async def go():
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep("f"))
        await gw.reconciler.reconcile()  # places the first replica; its start runs in the background
        await gw.reconciler.reconcile()  # polls while that start finishes
        assert len(fn.replicas) == 1, "the replica started during the poll was dropped"
        for _ in range(3):
            await gw.reconciler.reconcile()
        assert len(host.started) == 1 and not host.stopped, (len(host.started), host.stopped)
        await gw.close()

    asyncio.run(go())


def test_invoke_hooks_and_pipelines(tmp_path):
    async def scenario():
        gw = make(tmp_path, [FakeHost("h0")])
        for i in (1, 0):
            await gw.registry.deploy(dep(f"m-stage-{i}", **{"com.quart.model": "m", "com.quart.stage": str(i)}))
        assert gw.registry.pipelines() == {"m": ["m-stage-0", "m-stage-1"]}
        seen = []

        async def hook(request, name, tail):
            seen.append(name)
            return "handled" if name == "m" else None

        gw.add_invoke_hook(hook)
        assert gw.invoke_hooks == [hook]
        await gw.close()

    asyncio.run(scenario())


def test_deployment_validation_names_fields():
    cases = [
        ({"image": "x"}, "service"),
        ({"service": "a", "image": ""}, "image"),
        ({"service": "a", "image": "x", "envVars": {"A": 1}}, "envVars"),
        ({"service": "a", "image": "x", "labels": {"com.openfaas.scale.min": "-1"}}, "labels.com.openfaas.scale.min"),
        ({"service": "a", "image": "x", "labels": {"com.openfaas.scale.min": "5", "com.openfaas.scale.max": "2"}},
         "labels.com.openfaas.scale.min"),
        ({"service": "a", "image": "x", "limits": {"cpu": "lots"}}, "limits.cpu"),
        ({"service": "a", "image": "x", "namespace": "other"}, "namespace"),
    ]
    for body, field in cases:
        with pytest.raises(QuartError) as err:
            FunctionDeployment.from_json(body, "openfaas-fn")
        assert err.value.status == 400 and err.value.field == field, body


def test_quantities():
    assert parse_memory("128M") == 128 * 10**6 and parse_memory("1Gi") == 2**30 and parse_memory("512") == 512
    assert parse_cpu("500m") == 0.5 and parse_cpu("2") == 2.0
    for bad in ("", "-1", "1X"):
        with pytest.raises(ValueError):
            parse_memory(bad)
    with pytest.raises(ValueError):
        parse_cpu("0")


def test_stack_yml_becomes_faas_cli_requests(tmp_path):
    (tmp_path / "env.yml").write_text("environment:\n  FROM_FILE: yes-file\n  SHARED: file\n")
    (tmp_path / "stack.yml").write_text(textwrap.dedent("""
        version: 1.0
        provider: {name: openfaas, gateway: http://127.0.0.1:8080}
        functions:
          m-stage-0:
            lang: pipeline-stage
            handler: ./functions/decoder
            image: ${REGISTRY:-quart}/m-stage-0:latest
            environment_file: [env.yml]
            environment: {QUART_STAGE_INDEX: 0, SHARED: inline}
            labels: {com.openfaas.scale.min: 1, com.quart.model: m}
            limits: {cpu: 1, memory: 512Mi}
    """))
    stack = load_stack(tmp_path / "stack.yml", env={})
    [fn] = stack.functions
    assert fn.request == {
        "service": "m-stage-0", "image": "quart/m-stage-0:latest",
        "envVars": {"FROM_FILE": "yes-file", "SHARED": "inline", "QUART_STAGE_INDEX": "0"},
        "labels": {"com.openfaas.scale.min": "1", "com.quart.model": "m"}, "annotations": {},
        "limits": {"cpu": "1", "memory": "512Mi"},
    }
    assert stack.gateway == "http://127.0.0.1:8080"
    assert stack.image_index_entries()["quart/m-stage-0:latest"]["lang"] == "pipeline-stage"
    (tmp_path / "bad.yml").write_text("functions: {a: {lang: x}}")
    with pytest.raises(StackError, match="image"):
        load_stack(tmp_path / "bad.yml")


def test_failed_starts_back_off_and_are_reported(tmp_path):
    class BrokenHost(FakeHost):
        async def start(self, spec, order):
            self.started.append(spec)
            raise RuntimeError("no such stage")

    async def scenario():
        host = BrokenHost("h0")
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep())
        for _ in range(10):
            await gw.reconciler.reconcile()
            await asyncio.sleep(0.01)
        assert len(host.started) == 1  # one try, then a 0.5 s backoff instead of a retry every tick
        assert "no such stage" in fn.last_error and fn.ready == []
        await gw.close()

    asyncio.run(scenario())


def test_label_only_update_keeps_replicas_and_raises_the_floor(tmp_path):
    async def scenario():
        host = FakeHost("h0")
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep())
        await settle(gw)
        host.make_ready()
        await settle(gw)
        [old] = fn.ready
        await gw.registry.update(dep(**{"com.openfaas.scale.min": "2", "com.openfaas.scale.max": "5"}))
        assert fn.generation == 1 and host.invalidated == [] and fn.desired == 2  # no roll, new floor
        await settle(gw)
        host.make_ready()
        await settle(gw)
        assert old in fn.ready and len(fn.ready) == 2 and old.id not in host.stopped
        await gw.close()

    asyncio.run(scenario())


class StalledLiveHost(FakeHost):
    """Starts replicas that serve, but whose stage never finishes arriving (held 0-1 of 0-4)."""

    async def start(self, spec: ReplicaSpec, order: StartOrder) -> Started:
        out = []
        for status in (await super().start(spec, order)).replicas:
            status = ReplicaStatus(status.id, status.function, status.host, status.url, "ready", "fork", 0,
                                   (0, 4), (0, 1))
            self.replicas_[status.id] = status
            out.append(status)
        return Started(out, "live")


def test_a_live_replica_whose_transfer_stalls_is_replaced_after_the_start_timeout(tmp_path):
    async def scenario():
        host = StalledLiveHost("h0")
        gw = make(tmp_path, [host], start_timeout_s=0.3)
        fn = await gw.registry.deploy(dep(**{"com.openfaas.scale.min": "1"}))
        await settle(gw)
        [first] = fn.replicas.values()
        assert not first.whole and fn.ready == []  # serving part of its stage: not in the proxy's ready list
        await asyncio.sleep(0.4)
        await settle(gw, rounds=6)
        assert first.id in host.stopped  # replaced, not kept forever holding a slot
        await gw.close()

    asyncio.run(scenario())


def test_a_change_beyond_the_cpus_drops_the_cached_parameters(tmp_path):
    async def scenario():
        host = FakeHost("h0")
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep())
        await gw.registry.update_limits("f", cpus=4)  # dep(): 2 CPUs, 1 GiB
        assert host.invalidated == [] and fn.generation == 1  # CPUs alone: resized in place
        await gw.registry.update_limits("f", memory_bytes=2**31)
        assert host.invalidated == ["f"] and fn.generation == 2

    asyncio.run(scenario())
