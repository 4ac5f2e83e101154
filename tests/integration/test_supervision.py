"""Issue 14 item 1: a KeysManager killed with SIGKILL is restarted with back-off, its host's replicas are
dead to routing at once and replaced, and everything serves again (reproducer: kill -9 of one
KeysManager was a permanent outage, 1321 × 502 and still down 12 minutes later)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
from quart_provider.config import GatewayConfig
from quart_provider.stack import load_stack
from quart_provider.supervisor import Backoff
from quart_provider.system import EmbeddedSystem


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_run():
    b = Backoff(initial_s=0.5, max_s=4.0, reset_after_s=60.0)
    b.started(0.0)
    assert [b.exited(t) for t in (1.0, 2.0, 3.0, 4.0, 5.0)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.due(9.0) and not b.due(8.9)
    b.started(10.0)
    assert b.restart_at is None
    assert b.exited(75.0) == 0.5  # ran 65 s: starts over


async def _all_ready(gw, deadline_s: float) -> float:
    start = time.monotonic()
    while not all(len(fn.ready) >= fn.desired for fn in gw.functions.values()):
        assert time.monotonic() - start < deadline_s, {n: (len(f.ready), f.last_error) for n, f in gw.functions.items()}
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def _kill_a_keysmanager(stack_path, state_dir) -> dict:
    cfg = GatewayConfig(port=0, state_dir=state_dir, hosts=2, gpus_per_host=2, reconcile_interval_s=0.1,
                        drain_timeout_s=2)
    system = EmbeddedSystem(cfg, use_keysmanager=True)
    await system.start()
    try:
        gw = system.gateway
        stack = load_stack(stack_path)
        await system.deploy_stack(stack)
        await _all_ready(gw, 120)
        victim = next(a for a in system.agents if any(e.host == a.name for f in gw.functions.values()
                                                       for e in f.ready))
        old_pid = victim.process.pid
        on_victim = [e for f in gw.functions.values() for e in f.ready if e.host == victim.name]
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        while any(e.state == "ready" for e in on_victim):
            assert time.monotonic() - killed < 3 * cfg.host_down_after_s + 1, "the dead host's replicas stay routed"
            await asyncio.sleep(0.01)
        dead_s = time.monotonic() - killed
        await asyncio.sleep(0.05)
        recovered_s = dead_s + await _all_ready(gw, 60)
        name = stack.functions[0].name
        body = json.dumps({"input_ids": [[1, 2, 3, 4]]}).encode()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, session.post(
                f"{system.url}/function/{name}", data=body, headers={"Content-Type": "application/json"}) as res:
            status = res.status
        while victim.process.pid == old_pid or victim.restarts < 1:
            assert time.monotonic() - killed < 30, "the KeysManager was not restarted"
            await asyncio.sleep(0.05)
        host = gw.hosts[victim.name]
        deadline = time.monotonic() + 30
        while True:  # the successor answers on the same socket
            try:
                await host.client.health()
                break
            except Exception:
                assert time.monotonic() < deadline, "the restarted KeysManager never answered"
                await asyncio.sleep(0.1)
        victims = {e.id for e in on_victim}
        while True:  # they survived their KeysManager: its successor and the gateway adopt them back
            back = {e.id for f in gw.functions.values() for e in f.ready if e.host == victim.name}
            if victims <= back or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        up = json.loads(system.state_file.read_text())
        return {"adopted_back": victims <= back, "dead_s": dead_s, "recovered_s": recovered_s, "status": status, "old_pid": old_pid,
                "new_pid": victim.process.pid, "state_pid": next(h["pid"] for h in up["hosts"] if h["name"] == victim.name)}
    finally:
        await system.stop()


def test_a_killed_keysmanager_is_restarted_and_its_replicas_replaced(emulated_stack, tmp_path):
    out = asyncio.run(_kill_a_keysmanager(emulated_stack, tmp_path / "state"))
    assert out["dead_s"] < 0.6  # the supervisor saw the exit: not routed from then on (no 0.8 s of silence)
    assert out["status"] == 200
    assert out["new_pid"] != out["old_pid"] and out["state_pid"] == out["new_pid"]  # `quartctl down` finds it
    assert out["recovered_s"] < 30
    assert out["adopted_back"], "the replicas that survived their KeysManager were not adopted back"


def test_leftovers_of_a_killed_keysmanager_are_cleaned_without_a_successor(tmp_path):
    """`quartctl down` after a kill -9: its zygote/replica processes, segments, socket and pidfile go."""
    import subprocess

    from keysmanager import sysutil
    from keysmanager.config import KeysManagerConfig
    from keysmanager.recovery import clean_leftovers

    shm = tmp_path / "shm"
    shm.mkdir()
    config = KeysManagerConfig(name="host-0", socket=str(tmp_path / "host-0.sock"), shm_dir=str(shm))
    config.state_path.mkdir()
    child = subprocess.Popen(["sleep", "60"])
    try:
        (config.state_path / "state.json").write_text(json.dumps({"replicas": [
            {"id": "r1", "function": "f", "pid": child.pid, "port": 1, "source": "fork", "survive": True,
             "create_time": sysutil.create_time(child.pid)}]}))
        (config.state_path / "km.pid").write_text("999999 0\n")
        config.socket_path.write_text("")
        segment = shm / (config.shm_prefix + "f-0")
        segment.write_bytes(b"x")
        other = shm / "quart-km-host-1-deadbeef-f-0"  # another host's: untouched
        other.write_bytes(b"x")
        found = clean_leftovers(config)
        assert child.wait(5) == -signal.SIGKILL and found.killed == [child.pid]
        assert not segment.exists() and other.exists()
        assert not config.socket_path.exists() and not (config.state_path / "km.pid").exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
