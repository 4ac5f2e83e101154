"""In-place CPU resizing (QUART's CPU compensation, carried out): a KeysManager re-pins a running replica's
threads, the replica keeps serving (same pid), and its emulated time follows its cores (QUART_EMULATED_CPU_FRACTION)."""

from __future__ import annotations

import os
import statistics
import time

import psutil
import pytest
import requests
from support.keysmanager import IDS, Daemon, daemons_in_temp_dir, emulated

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to resize onto")


def _median_ms(url: str, n: int = 5) -> float:
    times = []
    with requests.Session() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            assert s.post(url, json=IDS, timeout=30).status_code == 200
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def test_a_resized_replica_keeps_serving_on_its_new_cores_at_their_speed():
    with daemons_in_temp_dir() as (root, daemons, _):
        d = Daemon(root, "rs")
        daemons.append(d)
        d.start()
        spec = emulated("rsz-stage-0", QUART_EMULATED_MEAN_MS="300", QUART_EMULATED_CV="0",
                        QUART_EMULATED_CPU_FRACTION="0.8")
        d.client.ensure_cached(spec)
        [rep] = d.client.start(spec, 1)
        assert len(psutil.Process(rep.pid).cpu_affinity()) == 1  # 1 CPU: one core
        one = _median_ms(rep.url)
        after = d.client.resize(rep.id, 2.0)
        assert after.id == rep.id and after.pid == rep.pid and after.state == "ready"  # nothing restarted
        proc = psutil.Process(rep.pid)
        assert all(len(os.sched_getaffinity(t.id)) == 2 for t in proc.threads())  # every thread re-pinned
        two = _median_ms(rep.url)
        assert two < 0.8 * one  # 300 ms × (1 − 0.8 + 0.8/2) = 180 ms
        d.client.resize(rep.id, 1.0)
        assert len(proc.cpu_affinity()) == 1 and _median_ms(rep.url) > 0.85 * one
        with pytest.raises(Exception, match="replica"):
            d.client.resize("no-such-replica", 2.0)
        with pytest.raises(Exception, match="cpus"):
            d.client.resize(rep.id, 0)


def test_a_process_host_resizes_its_child_in_place():
    import asyncio
    import sys

    from quart_provider.hosts import ProcessHost, ReplicaSpec

    from keysmanager.types import StartOrder

    async def scenario() -> None:
        host = ProcessHost("ph", gpu_slots=2, memory_limit=1 << 30)
        try:
            spec = ReplicaSpec(function="echo", kind="process", cpus=1.0,
                               argv=(sys.executable, "-m", "quart_provider.echo"))
            [status] = (await host.start(spec, StartOrder("cold"))).replicas
            proc = psutil.Process(host._children[status.id].process.pid)
            assert len(proc.cpu_affinity()) == 1
            await host.resize(status.id, 2.0)
            assert all(len(os.sched_getaffinity(t.id)) == 2 for t in proc.threads())
            assert [r.id for r in await host.replicas() if r.state != "dead"] == [status.id]  # same replica
            with pytest.raises(LookupError):
                await host.resize("ph-echo-99", 2.0)
        finally:
            await host.close()

    asyncio.run(scenario())
