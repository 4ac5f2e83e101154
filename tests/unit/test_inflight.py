"""The reconciler's work under way as a typed table (``provider/inflight.py``), and drains woken by events (issue 42):
a release of the replica's last request, or a generation session freed, ends a drain at once, not at the next look
(``DRAIN_LOOK_S`` is set far beyond the test's bound here, so only the event can end it). Fake hosts, no processes."""

from __future__ import annotations

import asyncio
import time

import pytest
from gateway_plugin.generation.kvbook import KVBook
from quart_provider import reconciler as reconciler_module
from quart_provider.config import GatewayConfig
from quart_provider.gateway import EmbeddedGateway
from quart_provider.inflight import InFlight
from support.fake_hosts import FakeHost, dep, settle


def test_the_table_records_each_task_by_kind_host_and_function_until_it_ends() -> None:
    async def scenario() -> None:
        settled = []
        table = InFlight(settled.append)
        gate = asyncio.Event()
        table.run(gate.wait(), "start", "h0", "f")
        table.run(gate.wait(), "start", "h1", "f")
        table.run(gate.wait(), "stop", "h0", "f", "r1")
        work = table.run(asyncio.sleep(3600), "probe", "h1", "g", "r2")
        assert work.kind == "probe" and work.host == "h1" and work.since <= time.monotonic()
        assert table.starts() == {("h0", "f"): 1, ("h1", "f"): 1}
        assert (table.starts_of("f"), table.starts_of("g"), table.starts_on("h0")) == (2, 0, 1)
        assert table.stopping("r1") and not table.stopping("r2")
        since = time.monotonic()
        table.abandon("h1", {"r2"})  # h1 went down: its start and its replica's probe end
        await asyncio.sleep(0.01)
        assert table.starts() == {("h0", "f"): 1} and table.start_settled_since("h1", since)
        assert not table.start_settled_since("h0", since)
        gate.set()
        await asyncio.sleep(0.01)
        assert table.under_way() == [] and len(settled) == 4
        await table.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("event", ["release", "session freed"])
def test_a_drain_ends_on_the_event_not_on_a_poll(tmp_path, monkeypatch, event: str) -> None:
    monkeypatch.setattr(reconciler_module, "DRAIN_LOOK_S", 60.0)

    async def scenario() -> None:
        host = FakeHost("h0")
        gw = EmbeddedGateway(GatewayConfig(state_dir=tmp_path, reconcile_interval_s=0.01, drain_timeout_s=60.0), [host])
        book = KVBook(4096)  # the session engine's book, wired to the platform as the plugin wires it
        gw.watch_sessions(book.booked)
        book.on_freed = gw.sessions_freed
        try:
            fn = await gw.registry.deploy(dep())
            await settle(gw)
            host.make_ready()
            await settle(gw)
            [replica] = fn.ready
            if event == "release":
                replica.in_flight += 1  # a request under way
            else:
                book.reserve(replica.id, 128)  # a generation session holds KV positions there
            gw.reconciler.retire(fn, replica)
            await asyncio.sleep(0.1)
            assert not host.stopped and gw.reconciler.work.stopping(replica.id)  # draining: it waits
            t0 = time.monotonic()
            if event == "release":
                gw.balancer.release(fn, replica)
            else:
                book.release(replica.id, 128)  # the session ended: the book tells the platform
            while not host.stopped:
                assert time.monotonic() - t0 < 10, "the drain did not end on the event"
                await asyncio.sleep(0.01)
            assert host.stopped == [replica.id]
        finally:
            await gw.close()

    asyncio.run(scenario())
