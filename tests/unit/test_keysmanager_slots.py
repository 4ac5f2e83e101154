"""A KeysManager's GPU slots are those of its live replicas plus starts under way, whatever happens to a start.

Before, ``slots_used`` was a set added to at a start and removed from at a death or an answered fork error: a
fork whose zygote connection broke, or a cold start whose process could not be started, kept its slot for
ever (a host reporting slots taken that nothing used). Now the set is derived (``Replicas.slots_used``).
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from keysmanager import replicas as replicas_module
from keysmanager.config import KeysManagerConfig
from keysmanager.errors import NoFreeSlot
from keysmanager.records import Segment
from keysmanager.replicas import Replicas
from keysmanager.types import StageSpec

SPEC = StageSpec(function="f")


class FakeZygotes:
    """Answers a fork as the zygote does, or breaks (its connection lost) when told to."""

    def __init__(self) -> None:
        self.broken = False

    async def fork(self, z, request: dict) -> dict:
        await asyncio.sleep(0)
        if self.broken:
            raise ConnectionResetError("the zygote's connection broke")
        return {"op": "forked", "pid": os.getpid(), "port": 1}


def _replicas(tmp_path: Path, gpus: int = 3) -> Replicas:
    config = KeysManagerConfig(name="host-0", gpus=gpus, state_dir=str(tmp_path / "km"))
    return Replicas(config, launcher=None, segments=SimpleNamespace(release=lambda seg, rid: None),
                    changed=lambda: None)


def _zygote() -> SimpleNamespace:
    return SimpleNamespace(segment=Segment(Path("/dev/null"), 0))


def _live_slots(reps: Replicas) -> set[int]:
    return {r.gpu_slot for r in reps.by_id.values() if r.state != "dead"}


def test_a_fork_that_breaks_half_way_frees_its_slot(tmp_path):
    reps, zygotes = _replicas(tmp_path), FakeZygotes()

    async def go():
        a = await reps.fork(zygotes, _zygote(), SPEC, "cow", True, 0.0)
        zygotes.broken = True
        with pytest.raises(ConnectionResetError):
            await reps.fork(zygotes, _zygote(), SPEC, "cow", True, 0.0)
        assert reps.slots_used == {a.gpu_slot}, "the broken fork kept its slot"

    asyncio.run(go())


def test_a_cold_start_that_cannot_start_frees_its_slot(tmp_path, monkeypatch):
    reps = _replicas(tmp_path)

    def no_socket(*_args):
        raise OSError("address in use")

    monkeypatch.setattr(replicas_module, "listen_socket", no_socket)
    with pytest.raises(OSError):
        reps.spawn_cold(SPEC, SimpleNamespace(param_bytes=0), "cow", True, 0.0)
    assert reps.slots_used == set()


def test_slots_equal_live_replicas_over_random_starts_failures_and_deaths(tmp_path):
    """Property over random sequences: after every step the slots taken are exactly the live replicas'
    (never more than the host has), a full host refuses, and a death frees its slot."""
    rng = random.Random(7)

    async def go():
        for _ in range(40):
            reps, zygotes = _replicas(tmp_path, gpus=rng.randint(1, 4)), FakeZygotes()
            for _ in range(30):
                step = rng.choice(["fork", "broken fork", "die", "die again"])
                live = [r for r in reps.by_id.values() if r.state != "dead"]
                if step in ("fork", "broken fork"):
                    zygotes.broken = step == "broken fork"
                    full = len(live) >= reps.config.gpus
                    try:
                        await reps.fork(zygotes, _zygote(), SPEC, "cow", True, 0.0)
                        assert not full and not zygotes.broken
                    except NoFreeSlot:
                        assert full
                    except ConnectionResetError:
                        assert zygotes.broken
                elif live:
                    victim = rng.choice(live)
                    reps.mark_dead(victim, 0)
                    if step == "die again":  # the zygote's report and the reaper both saw it
                        reps.exited(victim.pid, 0)
                assert reps.slots_used == _live_slots(reps)
                assert len(reps.slots_used) <= reps.config.gpus

    asyncio.run(go())
