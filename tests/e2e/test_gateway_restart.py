"""Issue 14, `gateway-restart`: with kept hosts (`quartctl up --keep-hosts`) a restarted gateway adopts the
KeysManagers and the replicas they still run instead of starting every replica again (the restart missed its
5 s recovery target while each of 6 replicas cold-started; a 3 s scikit-learn import blocked the start too)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import pytest
from quart_provider.adopt import AdoptedProcess, adopt_replicas, live_keysmanager
from quart_provider.config import GatewayConfig
from quart_provider.deployment import FunctionDeployment
from quart_provider.hosts import ReplicaStatus
from quart_provider.stack import load_stack
from quart_provider.system import EmbeddedSystem, _alive, stop_process
from quart_provider.types import FunctionState
from support.stacks import partition_emulated


def _fn(name: str, generation: int = 3) -> FunctionState:
    from quart_provider.registry import resolve

    deployment = FunctionDeployment.from_json({"service": name, "image": "quart/echo"}, "openfaas-fn")
    fn = FunctionState(deployment, resolve(deployment, None), 2, 0.0)
    fn.generation = generation
    return fn


def test_adopt_replicas_tracks_live_replicas_of_known_functions_at_their_generation():
    functions = {"a": _fn("a"), "b": _fn("b")}
    running = [ReplicaStatus("a-1", "a", "h0", "http://127.0.0.1:1", "ready"),
               ReplicaStatus("a-2", "a", "h0", "http://127.0.0.1:2", "starting"),
               ReplicaStatus("a-3", "a", "h0", "http://127.0.0.1:3", "dead"),
               ReplicaStatus("z-1", "z", "h0", "http://127.0.0.1:4", "ready")]
    assert adopt_replicas(functions, "h0", running, now=5.0) == ["a-1", "a-2"]
    a = functions["a"]
    assert [e.id for e in a.ready] == ["a-1"] and a.replicas["a-2"].state == "starting"
    assert {e.generation for e in a.replicas.values()} == {3} and a.replicas["a-1"].started_at == 5.0
    assert adopt_replicas(functions, "h0", running, now=6.0) == []  # already tracked: not twice
    assert functions["b"].replicas == {}


def test_adopt_replicas_fills_only_what_a_function_lacks_of_ready_replicas_ready_ones_first():
    fn = _fn("a")  # desired 2
    adopt_replicas({"a": fn}, "h1", [ReplicaStatus("a-new", "a", "h1", "http://127.0.0.1:5", "ready")], now=1.0)
    running = [ReplicaStatus("a-s", "a", "h0", "http://127.0.0.1:1", "starting"),
               ReplicaStatus("a-r1", "a", "h0", "http://127.0.0.1:2", "ready"),
               ReplicaStatus("a-r2", "a", "h0", "http://127.0.0.1:3", "ready")]
    assert adopt_replicas({"a": fn}, "h0", running, now=2.0) == ["a-r1"]  # one lacking; the others are stopped
    assert sorted(e.id for e in fn.ready) == ["a-new", "a-r1"]


def test_live_keysmanager_needs_a_live_keysmanager_pid_and_its_socket(tmp_path):
    sock = tmp_path / "host-0.sock"
    assert live_keysmanager(sock) is None
    (tmp_path / "host-0.sock.d").mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "keysmanager"])
    try:
        (tmp_path / "host-0.sock.d" / "km.pid").write_text(f"{sleeper.pid} 0\n")
        assert live_keysmanager(sock) is None  # no socket
        sock.touch()
        assert live_keysmanager(sock) == sleeper.pid
        handle = AdoptedProcess(sleeper.pid)
        assert handle.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert handle.poll() is not None
    (tmp_path / "host-0.sock.d" / "km.pid").write_text(f"{sleeper.pid} 0\n")
    assert live_keysmanager(sock) is None  # gone


def test_the_gateway_process_does_not_import_scikit_learn_or_torch():
    code = ("import sys, quart_tools.platform, gateway_plugin.plugin, gateway_plugin.policies.quart, "
            "quart_provider.system; print([m for m in ('sklearn', 'torch', 'scipy', 'matplotlib', 'boto3') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def emulated_stack(tmp_path_factory):
    return partition_emulated(tmp_path_factory, scale_max=1)


async def _ready(system: EmbeddedSystem, timeout_s: float) -> float:
    start = time.monotonic()
    await system.wait_ready(list(system.gateway.functions), timeout_s)
    return time.monotonic() - start


async def _restart(stack_path, state_dir) -> dict:
    cfg = GatewayConfig(port=0, state_dir=state_dir, hosts=1, gpus_per_host=2, reconcile_interval_s=0.1,
                        drain_timeout_s=2)
    first = EmbeddedSystem(cfg, use_keysmanager=True, keep_hosts=True)
    await first.start()
    km_pid = first.agents[0].process.pid
    second = None
    try:
        stack = load_stack(stack_path)
        await first.deploy_stack(stack)
        await _ready(first, 120)
        before = {n: sorted(f.replicas) for n, f in first.gateway.functions.items()}
        await first.stop()
        assert _alive(km_pid), "a kept KeysManager stopped with the gateway"
        second = EmbeddedSystem(cfg, use_keysmanager=True, keep_hosts=True)
        started = time.monotonic()
        await second.start()
        ready_s = time.monotonic() - started + await _ready(second, 60)
        after = {n: sorted(f.replicas) for n, f in second.gateway.functions.items()}
        name = stack.functions[0].name
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, session.post(
                f"{second.url}/function/{name}", data=json.dumps({"input_ids": [[1, 2, 3]]}).encode(),
                headers={"Content-Type": "application/json"}) as res:
            status = res.status
        return {"before": before, "after": after, "ready_s": ready_s, "status": status,
                "same_km": second.agents[0].process.pid == km_pid}
    finally:
        if second is not None:
            second.keep_hosts = False  # this one takes everything down
            second.gateway.keep_replicas = False
            await second.stop()
        stop_process(km_pid)


def test_a_restarted_gateway_adopts_kept_hosts_and_their_replicas(emulated_stack, tmp_path):
    out = asyncio.run(_restart(emulated_stack, tmp_path / "state"))
    assert out["same_km"], "the KeysManager was started again instead of adopted"
    assert out["after"] == out["before"], "replicas were restarted instead of adopted"
    assert out["status"] == 200
    assert out["ready_s"] < 5.0, out


@pytest.mark.parametrize("flags", [["--keep-hosts"], []], ids=["keep-hosts", "default"])
def test_up_keep_hosts_leaves_its_keysmanagers_to_the_next_up_and_down_stops_them(tmp_path, flags):
    """Issue 31 item 4: with no flag at all too (kept hosts are the default on loopback)."""
    from quart_tools.bench.chaos import Gateway

    state = tmp_path / "state"
    state.mkdir()
    gw = Gateway(state, ["--hosts", "1", *flags, "--no-plugin"])
    km_pid = 0
    try:
        gw.start(120)
        km_pid = gw.state()["hosts"][0]["pid"]
        gw.stop()  # SIGTERM: the gateway goes, its host stays, up.json names it for `quartctl down`
        assert _alive(km_pid) and json.loads((state / "up.json").read_text())["hosts"][0]["pid"] == km_pid
        gw.start(120)
        assert gw.state()["hosts"][0]["pid"] == km_pid  # supervised again, not started again
        gw.down()
        deadline = time.monotonic() + 10
        while _alive(km_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(km_pid) and not (state / "up.json").exists()
    finally:
        gw.stop()
        if km_pid and _alive(km_pid):
            stop_process(km_pid)


def test_no_keep_hosts_takes_the_hosts_down_with_the_gateway(tmp_path):
    from quart_tools.bench.chaos import Gateway

    state = tmp_path / "state"
    state.mkdir()
    gw = Gateway(state, ["--hosts", "1", "--no-keep-hosts", "--no-plugin"])
    km_pid = 0
    try:
        gw.start(120)
        km_pid = gw.state()["hosts"][0]["pid"]
        gw.stop()
        deadline = time.monotonic() + 10
        while _alive(km_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(km_pid)
    finally:
        gw.down()
        if km_pid and _alive(km_pid):
            stop_process(km_pid)


def test_phases_name_where_a_start_went():
    from quart_provider.phases import Phases

    phases = Phases()
    phases.mark("hosts")
    assert list(phases.durations) == ["process", "hosts"] and phases.durations["process"] >= 0
    assert str(phases).startswith(f"{phases.total_s:.2f} s (process ")
