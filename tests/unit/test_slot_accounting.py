"""Property: whatever happens to hosts and starts, once things settle the gateway tracks exactly what runs.

Random sequences of scale changes, host flaps (a missed poll, a longer silence) while starts are under way
(a start hangs until its host gets to it, and then finishes even if the gateway gave up on it), starts that fail, replicas that crash, a KeysManager restart (silent, then back with the replicas that survived it)
and a host gone for good; then every host that still exists answers and finishes its work. After that, on
every host the replicas that run are the ones the gateway tracks (no slot held by a replica nobody knows, none
tracked that does not run), every function has its desired replicas unless every slot is taken, and
the pending starts and ``unplaced`` say what is really under way and missing. Fake hosts, no processes.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from quart_provider.hosts import ReplicaStatus
from support.fake_hosts import FlakyHost, dep, make, settle

HOSTS = 3
SLOTS = 3
FUNCTIONS = ("f", "g")

event = st.one_of(
    st.tuples(st.just("scale"), st.sampled_from(FUNCTIONS), st.integers(0, 5)),
    st.tuples(st.just("silent"), st.integers(0, HOSTS - 1), st.integers(1, 4)),  # passes without an answer
    st.tuples(st.just("work"), st.integers(0, HOSTS - 1), st.just(0)),  # the host finishes the starts asked of it
    st.tuples(st.just("failing"), st.integers(0, HOSTS - 1), st.booleans()),  # starts fail
    st.tuples(st.just("crash"), st.integers(0, HOSTS - 1), st.integers(0, 9)),  # a replica dies
    st.tuples(st.just("restart"), st.integers(0, HOSTS - 1), st.integers(0, 9)),  # its KeysManager restarts
    st.tuples(st.just("gone"), st.integers(0, HOSTS - 1), st.just(0)),  # the host is gone for good
    st.tuples(st.just("pass"), st.integers(1, 3), st.just(0)),
)


def _kill(host: FlakyHost, pick: int) -> None:
    live = sorted(host.live_ids())
    if live:
        rid = live[pick % len(live)]
        r = host.replicas_[rid]
        host.replicas_[rid] = ReplicaStatus(r.id, r.function, r.host, r.url, "dead")


async def _play(tmp: Path, events: list[tuple]) -> None:
    hosts = [FlakyHost(f"h{i}", slots=SLOTS) for i in range(HOSTS)]
    gw = make(tmp, hosts, host_down_after_s=0.001)
    for name in FUNCTIONS:
        await gw.registry.deploy(dep(name))
    gone: set[str] = set()
    for h in hosts:
        h.hold_starts()  # a start hangs until its host gets to it ("work"): flaps find starts under way
    try:
        for kind, a, b in events:
            host = hosts[a] if kind not in ("scale", "pass") else None
            if kind == "scale":
                await gw.registry.scale(a, b)
            elif kind == "silent":
                host.silent = True
                await settle(gw, b)
                host.silent = host.name in gone
            elif kind == "work":
                host.release_starts()
                await host.settle()
                host.hold_starts()
            elif kind == "failing":
                host.failing = b
            elif kind == "crash":
                _kill(host, b)
            elif kind == "restart":  # silent while its successor comes up; some replicas did not survive
                host.silent = True
                _kill(host, b)
                await settle(gw, 2)
                host.silent = host.name in gone
            elif kind == "gone":
                gone.add(host.name)
                host.silent = True
                for _ in list(host.live_ids()):
                    _kill(host, 0)
            else:
                await settle(gw, a)
            await settle(gw, 1)
            for h in hosts:
                h.make_ready()
        # heal: every host still there answers and finishes its work; back-offs after failed starts run out
        for h in hosts:
            h.silent, h.failing = h.name in gone, False
            h.release_starts()
        for _ in range(6):
            for h in hosts:
                await h.settle()
                h.make_ready()
            for fn in gw.functions.values():
                fn.retry_at = 0.0
            await settle(gw, 2)
            await asyncio.sleep(0.02)  # drains (nothing in flight) end: drain_timeout_s 0.2 at most
        _check(gw, hosts, gone)
    finally:
        await gw.close()


def _check(gw, hosts: list[FlakyHost], gone: set[str]) -> None:
    alive = [h for h in hosts if h.name not in gone]
    for h in alive:
        tracked = {e.id for fn in gw.functions.values() for e in fn.replicas.values() if e.host == h.name}
        assert h.live_ids() == tracked, f"{h.name}: runs {sorted(h.live_ids())}, tracked {sorted(tracked)}"
    for fn in gw.functions.values():
        assert all(e.host not in gone for e in fn.replicas.values()), "a replica on a host gone for good"
        assert gw.reconciler.pending_starts(fn.name) == 0, fn.name
        assert len(fn.replicas) <= fn.desired, (fn.name, len(fn.replicas), fn.desired)
        missing = fn.desired - len(fn.replicas)
        free = sum(h.slots - len(h.live_ids()) for h in alive)
        assert missing == 0 or free == 0, f"{fn.name}: {missing} missing with {free} slot(s) free"
        assert fn.unplaced == missing, (fn.name, fn.unplaced, missing)
        assert len(fn.ready) == len(fn.replicas)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(event, min_size=1, max_size=14))
def test_the_gateway_tracks_exactly_what_runs_after_any_sequence(events):
    with tempfile.TemporaryDirectory(prefix="quart-slots-") as tmp:
        asyncio.run(_play(Path(tmp), events))
