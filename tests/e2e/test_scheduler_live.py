"""Issue 6, point 2 (slow, live): `quartctl up --hosts 3 --gpus-per-host 4 --placer cache-aware` sends each
scale-up replica to the host the placer picks, and that host's KeysManager forks it (cached) or
cold-starts it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from quart_kernel.scheduling.types import ScheduleResult

pytestmark = pytest.mark.slow


class RecordingPlacer:
    """Wraps the gateway's placer and keeps every decision."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name
        self.decisions: list[ScheduleResult] = []

    def place(self, hosts, requests, key_history=None):
        result = self.inner.place(hosts, requests, key_history)
        self.decisions.append(result)
        return result


def test_gateway_scale_ups_follow_the_cache_aware_placer(tmp_path):
    from quart_provider.config import GatewayConfig
    from quart_provider.stack import load_stack
    from quart_provider.system import EmbeddedSystem

    model = tmp_path / "model"
    subprocess.run(
        [sys.executable, "-m", "quart_tools.cli", "partition", "--model", "sized", "--target-stage-mb", "16",
         "--stages", "3", "--weights", "random", "--compute", "emulated", "--emulated-mean-ms", "5",
         "--out", str(model)],
        check=True, stdout=subprocess.DEVNULL, timeout=300,
    )
    stack = load_stack(model / "stack.yml")
    names = [f.name for f in stack.functions]
    key = names[1]

    async def scenario() -> None:
        cfg = GatewayConfig(port=0, state_dir=tmp_path / "state", hosts=3, gpus_per_host=4,
                            placer="cache-aware", host_memory_bytes=256 * 1024**2)
        system = EmbeddedSystem(cfg)
        await system.start()
        try:
            gateway = system.gateway
            recorder = RecordingPlacer(gateway.reconciler.placer)
            gateway.reconciler.placer = recorder
            assert recorder.name == "cache-aware"
            await system.deploy_stack(stack)
            await system.wait_ready(names, timeout_s=240)
            # the cold start leaves a zygote behind (in the background): wait until a host reports it
            deadline = time.monotonic() + 120
            while not any(key in v.cached for v in [await h.report() for h in gateway.hosts.values()]):
                assert time.monotonic() < deadline, f"no host cached {key}"
                await asyncio.sleep(0.2)
            before = set(gateway.functions[key].replicas)
            seen = len(recorder.decisions)
            await gateway.registry.scale(key, 3, key=True)
            await system.wait_ready([key], timeout_s=240)
            new = [e for i, e in gateway.functions[key].replicas.items() if i not in before]
            placed = [p for r in recorder.decisions[seen:] for p in r.placements if p.function == key]
            assert len(new) == 2 and len(placed) == 2
            assert sorted(e.host for e in new) == sorted(p.host for p in placed)
            assert all(p.key for p in placed)
            planned = [p.source for p in placed]
            assert "fork" in planned  # the cached host had a free slot: forked there
            # A KeysManagerHost loads the zygote first and forks every replica from it (§6.1); a start that had
            # to load it reports its replica cold. So each replica's source is what the placer planned for its host.
            assert sorted((e.host, e.source) for e in new) == sorted((p.host, p.source) for p in placed)
            snap = gateway.scheduler_metrics.snapshot()
            assert snap.key_scale_ups == 2 and snap.key_hits == planned.count("fork")
            assert set(planned) <= set(snap.ready) and all(0 < r.mean_ms < 240_000 for r in snap.ready.values())
            assert any(key in pinned for pinned, _sole in gateway.reconciler.starter.pins.values())  # keep_cached pinned on a KeysManager
        finally:
            await system.stop()

    asyncio.run(scenario())
