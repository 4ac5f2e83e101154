"""The scheduler benchmark's script and driver loop, on in-memory hosts (the live run is `slow`)."""

from __future__ import annotations

import json
import os
from collections import OrderedDict

import pytest
from gateway_plugin.scheduling import HostView, make_placer
from gateway_plugin.scheduling.bench import Started, run_script
from gateway_plugin.scheduling.scenario import scripted_sequence

MB = 1 << 20


class FakeKeysManager:
    """A host with GPU slots and an LRU parameter cache limited in bytes (no processes)."""

    def __init__(self, name: str, gpus: int, memory_limit: int, sizes: dict[str, int]) -> None:
        self.name, self.gpus, self.memory_limit, self.sizes = name, gpus, memory_limit, sizes
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.replicas: dict[str, str] = {}
        self.started = 0

    def view(self) -> HostView:
        running: dict[str, int] = {}
        for f in self.replicas.values():
            running[f] = running.get(f, 0) + 1
        return HostView(self.name, self.gpus, len(self.replicas), self.memory_limit,
                        sum(self.cache.values()), frozenset(self.cache), running)

    def start(self, function: str) -> Started:
        assert len(self.replicas) < self.gpus, f"{self.name}: start with no free slot"
        source = "fork" if function in self.cache else "cold"
        if source == "cold":
            self.cache[function] = self.sizes[function]
            while sum(self.cache.values()) > self.memory_limit and len(self.cache) > 1:
                self.cache.popitem(last=False)
        self.cache.move_to_end(function)
        self.started += 1
        rid = f"{self.name}-{self.started}"
        self.replicas[rid] = function
        return Started(rid, function, self.name, source, 50.0 if source == "fork" else 2000.0)

    def stop(self, replica_id: str) -> None:
        del self.replicas[replica_id]

    def pin(self, functions: list[str]) -> None:
        """This simple cache ignores pins (see EmulatedKeysManager for one that honours them)."""


def _run(placer_name: str, steps, stages, sizes):
    hosts = [FakeKeysManager(f"h{i}", 4, int(2.5 * 100 * MB), sizes) for i in range(3)]
    # the fake host keeps one copy of a cold-started stage (its zygote), so the placer counts one copy
    placer = make_placer(placer_name, cold_copies=1.0) if placer_name == "cache-aware" else make_placer(placer_name)
    out = run_script(placer, hosts, stages, steps, sizes)
    return out, hosts


def test_script_is_balanced_and_bounded():
    steps = scripted_sequence(["a", "b", "c"], bursts=12, max_extra=5, seed=3)
    assert sum(s.delta > 0 for s in steps) == 12
    live: dict[str, int] = {}
    for s in steps:
        live[s.function] = live.get(s.function, 0) + s.delta
        assert live[s.function] >= 0 and sum(live.values()) <= 5
    assert all(v == 0 for v in live.values())
    assert steps == scripted_sequence(["a", "b", "c"], bursts=12, max_extra=5, seed=3)


def test_run_script_cache_aware_beats_first_fit_on_fake_hosts():
    stages = [f"m-stage-{i}" for i in range(6)]
    sizes = dict.fromkeys(stages, 100 * MB)
    steps = scripted_sequence(stages[1:5], bursts=16, max_extra=5, seed=1)
    ca, ca_hosts = _run("cache-aware", steps, stages, sizes)
    ff, _ = _run("first-fit", steps, stages, sizes)
    for out in (ca, ff):
        assert len(out.deploy) == 6 and out.unplaced == 0
        assert len(out.records) == sum(s.delta for s in steps if s.delta > 0)
    assert all(len(h.replicas) == 1 or len(h.replicas) <= 4 for h in ca_hosts)
    assert sum(len(h.replicas) for h in ca_hosts) == 6  # every scale-up was scaled down again
    ca_s, ff_s = ca.summary(), ff.summary()
    assert ca_s["hit_rate"] >= 0.8, ca_s
    assert ca_s["hit_rate"] > ff_s["hit_rate"], (ca_s, ff_s)
    assert ca_s["mean_ready_ms"] < ff_s["mean_ready_ms"]
    assert ca_s["metrics"]["key_scale_ups"] == len(ca.records)
    json.dumps(ca_s)


@pytest.mark.slow
def test_live_bench_scheduler(tmp_path):
    """The real thing: 3 KeysManagers x 4 slots, both placers (minutes)."""
    from gateway_plugin.scheduling.bench import main

    out = tmp_path / "sched.json"
    assert main(["--out", str(out), "--bursts", os.environ.get("QUART_BENCH_BURSTS", "8")]) == 0
    doc = json.loads(out.read_text())
    for name in ("cache_aware", "first_fit"):
        assert set(doc[name]) >= {"hit_rate", "mean_ready_ms"}
        assert doc[name]["scale_ups"] > 0
    assert doc["cache_aware"]["hit_rate"] > doc["first_fit"]["hit_rate"]
