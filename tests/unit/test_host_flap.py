"""A host that misses polls and answers again (a flap) leaves the slot accounting equal to what runs.

Reproducer of the frontier bench's hang: a KeysManager busy with a burst of starts missed a poll, its host was
marked down with its replicas (the starts in flight on it abandoned), and answered again 140 ms later. The
abandoned starts still finished on the host, after the poll that brought it back: replicas nobody tracked, so
nobody stopped, holding their slots for ever; the placer then refused new replicas ("slots taken") with most
slots idle. Fake hosts (``support.fake_hosts.FlakyHost``), no processes.
"""

from __future__ import annotations

import asyncio

from quart_provider.gateway import EmbeddedGateway
from support.fake_hosts import FakeHost, FlakyHost, dep, make, settle


async def take_down(gw: EmbeddedGateway, host: FlakyHost, passes: int = 20) -> None:
    """``host`` stops answering until the gateway marks it down."""
    host.silent = True
    for _ in range(passes):
        await gw.reconciler.reconcile()
        if not gw.reconciler.health.is_up(host.name):
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"{host.name} was never marked down")


async def bring_back(gw: EmbeddedGateway, host: FlakyHost) -> None:
    host.silent = False
    await gw.reconciler.reconcile()
    assert gw.reconciler.health.is_up(host.name)


async def converge(gw: EmbeddedGateway, hosts: list[FlakyHost], rounds: int = 6) -> None:
    """Every host answers and finishes its work, replicas become ready, drains end: the gateway settles."""
    for _ in range(rounds):
        for h in hosts:
            await h.settle()
            h.make_ready()
        await settle(gw, 2)
        await asyncio.sleep(0.03)  # drains (drain_timeout_s 0.2, nothing in flight) run out


async def two_hosts(tmp_path, slots: int, replicas: int) -> tuple[EmbeddedGateway, list[FlakyHost]]:
    """Hosts h0 and h1 and function ``f`` at ``replicas`` ready replicas, placed first-fit (h0 first)."""
    hosts = [FlakyHost("h0", slots=slots), FlakyHost("h1", slots=slots)]
    gw = make(tmp_path, hosts, placer="first-fit", host_down_after_s=0.001)
    await gw.registry.deploy(dep())
    await gw.registry.scale("f", replicas)
    await converge(gw, hosts)
    return gw, hosts


def tracked_on(gw: EmbeddedGateway, host: str) -> set[str]:
    return {e.id for fn in gw.functions.values() for e in fn.replicas.values() if e.host == host}


def test_starts_in_flight_through_a_flap_leave_no_slot_taken(tmp_path):
    async def scenario():
        gw, hosts = await two_hosts(tmp_path, slots=4, replicas=2)
        h0, fn = hosts[0], gw.functions["f"]
        assert {e.host for e in fn.ready} == {"h0"} and len(fn.ready) == 2
        for h in hosts:
            h.hold_starts()  # the host is busy: starts hang
        await gw.registry.scale("f", 4)
        await settle(gw, 2)
        assert len(h0._work) == 2  # two starts in flight on h0
        await take_down(gw, h0)  # its replicas dropped, its starts abandoned, replacements placed on h1
        await bring_back(gw, h0)  # its two ready replicas adopted back
        for h in hosts:
            h.release_starts()  # the abandoned starts finish on h0 after all
        await converge(gw, hosts)
        assert len(fn.ready) == 4
        for h in hosts:
            assert h.live_ids() == tracked_on(gw, h.name), f"{h.name} runs replicas the gateway does not track"
        await gw.registry.scale("f", 8)  # every slot of the two hosts
        await converge(gw, hosts)
        assert fn.unplaced == 0, gw.functions["f"].status_json()
        assert len(fn.ready) == 8
        for h in hosts:
            assert h.live_ids() == tracked_on(gw, h.name)
        await gw.close()

    asyncio.run(scenario())


def test_unplaced_is_cleared_once_nothing_is_missing(tmp_path):
    """While a host is down the others may be full (replicas unplaced); once it is back and its replicas are
    adopted, nothing is missing and the function must no longer say it waits for a slot."""
    async def scenario():
        gw, hosts = await two_hosts(tmp_path, slots=2, replicas=4)
        h0, fn = hosts[0], gw.functions["f"]
        assert len(fn.ready) == 4
        await take_down(gw, h0)
        await settle(gw, 1)
        assert fn.unplaced == 2  # h1 is full
        await bring_back(gw, h0)
        await converge(gw, hosts)
        assert len(fn.ready) == 4 and gw.reconciler.pending_starts(fn.name) == 0
        assert fn.unplaced == 0, "a function with every replica it wants still says it waits for a slot"
        assert "reason" not in fn.status_json()
        await gw.close()

    asyncio.run(scenario())


class LateAnswerHost(FlakyHost):
    """A host whose start answer arrives well after the replica shows in its listing."""

    async def _start_on_host(self, spec, count):
        made = await FakeHost.start(self, spec, count)  # listed from now on
        await self.gate.wait()  # the answer is still on its way
        return made


def test_a_replica_whose_start_answer_is_on_its_way_is_not_taken_for_an_orphan(tmp_path):
    host = LateAnswerHost("h0")

    async def scenario():
        gw = make(tmp_path, [host])
        fn = await gw.registry.deploy(dep())
        host.hold_starts()
        await settle(gw, 4)  # polls list the new replica; the gateway does not track it yet
        assert len(host.live_ids()) == 1 and not fn.replicas and gw.reconciler.pending_starts(fn.name) == 1
        assert not host.stopped, "a replica whose start had not answered yet was stopped as an orphan"
        host.release_starts()
        await converge(gw, [host])
        assert set(fn.replicas) == host.live_ids() and not host.stopped and len(host.started) == 1
        await gw.close()

    asyncio.run(scenario())
