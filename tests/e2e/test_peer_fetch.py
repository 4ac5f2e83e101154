"""Peer fetch and chain multicast (issue 16, BlitzScale): stage files between KeysManagers in network
namespaces (token, Range, fallback to the registry when a peer dies or lies, a chain of three with equal bytes
at every hop), the chain planner and the placer's "peer" source (pure).

The namespace tests need root (CAP_NET_ADMIN); they skip with the reason otherwise. Every KeysManager, the
registry and the namespaces are removed at the end (``quart_tools.bench.blitz.peer_cluster``).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import requests
from quart_kernel.scheduling import HostView, ReplicaRequest, make_placer
from quart_kernel.scheduling.multicast import chain_busy_hops, plan_chain
from quart_provider.network import unavailable_reason

from keysmanager.auth import bearer_header
from keysmanager.peers import parse_range

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"host namespaces unavailable: {REASON}")
RATE_GBPS = 0.1  # 8 MiB take ~0.7 s: long enough to kill a peer in the middle
STAGE_BYTES = 8 << 20
HOSTS = ["h0", "h1", "h2", "h3"]


@pytest.fixture(scope="module")
def cluster():
    if REASON is not None:
        pytest.skip(f"host namespaces unavailable: {REASON}")
    from quart_tools.bench.blitz import peer_cluster

    with peer_cluster(HOSTS, RATE_GBPS, f"{Path(__file__).resolve()}:peer-fetch") as c:
        c.upload_stage(STAGE_BYTES)
        yield c


@pytest.fixture
def fresh(cluster):
    """Fresh KeysManagers (empty state dirs) on every host; h0 holds the stage (fetched from the registry)."""
    for h in HOSTS:
        cluster.kill(h, signal.SIGTERM)
        cluster.start_km(h)
    cluster.client("h0").prefetch(cluster.spec)
    cluster.wait_held(["h0"], timeout_s=60)
    assert cluster.client("h0").stage(cluster.spec.function)["source"] == "registry"
    yield cluster
    for h in HOSTS:
        assert not list(cluster.state_dir(h).rglob("*.partial")), f"{h} left a partial file"


def _same_bytes(cluster, host: str) -> bool:
    return cluster.held_file(host).read_bytes() == cluster.stage.read_bytes()


@needs_netns
def test_peer_fetch_with_the_token_equal_bytes_and_ranges(fresh) -> None:
    c, fn = fresh, fresh.spec.function
    c.client("h1").prefetch(c.spec, [c.url("h0")])
    c.wait_held(["h1"], timeout_s=60)
    status = c.client("h1").stage(fn)
    assert status["source"] == c.url("h0") and status["bytes"] == STAGE_BYTES
    assert _same_bytes(c, "h1")
    url = f"{c.url('h0')}/v1/stages/{fn}/file"
    from quart_tools.bench.blitz import TOKEN

    assert requests.get(url, timeout=5).status_code == 401
    refused = requests.get(url, headers=bearer_header("not-the-token-" + "y" * 20), timeout=5)
    assert refused.status_code == 401 and refused.json()["error"] == "wrong bearer token"
    part = requests.get(url, headers={**bearer_header(TOKEN), "Range": "bytes=100-199"}, timeout=30)
    assert part.status_code == 206 and part.content == c.stage.read_bytes()[100:200]
    assert part.headers["Content-Range"] == f"bytes 100-199/{STAGE_BYTES}"
    missing = requests.get(f"{c.url('h0')}/v1/stages/nothing-here/file", headers=bearer_header(TOKEN), timeout=5)
    assert missing.status_code == 404


@needs_netns
def test_a_peer_that_refuses_the_token_leaves_the_registry(fresh) -> None:
    c = fresh
    c.kill("h2", signal.SIGTERM)
    c.start_km("h2", token="another-cluster-token-" + "z" * 16)  # its token is wrong for h0
    from quart_tools.bench.blitz import FUNCTION

    client = c.client("h2", token="another-cluster-token-" + "z" * 16)
    client.prefetch(c.spec, [c.url("h0")])
    deadline = time.monotonic() + 60
    while client.stage(FUNCTION)["state"] != "held":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.stage(FUNCTION)["source"] == "registry"
    assert _same_bytes(c, "h2")


@needs_netns
def test_fallback_to_the_registry_when_the_peer_dies_mid_transfer(fresh) -> None:
    c, fn = fresh, fresh.spec.function
    c.client("h1").prefetch(c.spec, [c.url("h0")])
    deadline = time.monotonic() + 30
    while (s := c.client("h1").stage(fn))["state"] != "fetching" or s["bytes"] == 0:
        assert s["state"] != "held", "the transfer ended before the peer could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    c.kill("h0")  # SIGKILL mid-transfer
    c.wait_held(["h1"], timeout_s=60)
    assert c.client("h1").stage(fn)["source"] == "registry"
    assert _same_bytes(c, "h1")


@needs_netns
def test_corrupt_bytes_from_a_peer_are_detected(fresh) -> None:
    c, fn = fresh, fresh.spec.function
    held = c.held_file("h0")
    data = bytearray(held.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    held.write_bytes(bytes(data))
    c.client("h1").prefetch(c.spec, [c.url("h0")])
    c.wait_held(["h1"], timeout_s=60)
    assert c.client("h1").stage(fn)["source"] == "registry"
    assert _same_bytes(c, "h1")


@needs_netns
def test_chain_of_three_forwards_while_writing_equal_bytes_at_every_hop(fresh) -> None:
    c, fn = fresh, fresh.spec.function
    chain = plan_chain(["h0"], ["h1", "h2", "h3"])
    assert chain == ["h0", "h1", "h2", "h3"]
    for prev, host in zip(chain, chain[1:], strict=False):  # in order: each registered before the next asks
        c.client(host).prefetch(c.spec, [c.url(prev), c.url("h0")])
    ready = c.wait_held(chain[1:], timeout_s=60)
    for prev, host in zip(chain, chain[1:], strict=False):
        assert c.client(host).stage(fn)["source"] == c.url(prev)
        assert _same_bytes(c, host)
    line_rate_s = 8 * STAGE_BYTES / (RATE_GBPS * 1e9)
    # serial forwarding: the receivers finish together, not one transfer after another
    assert max(ready.values()) - min(ready.values()) < 0.6 * line_rate_s, ready


def test_parse_range() -> None:
    assert parse_range(None, 100) is None
    assert parse_range("bytes=10-19", 100) == (10, 20)
    assert parse_range("bytes=90-", 100) == (90, 100)
    assert parse_range("bytes=-5", 100) == (95, 100)
    assert parse_range("bytes=90-500", 100) == (90, 100)
    for bad in ("bytes=-", "items=1-2", "bytes=100-", "bytes=1-2,4-5"):
        with pytest.raises(ValueError):
            parse_range(bad, 100)


def test_plan_chain_sends_once_through_every_receiver() -> None:
    assert plan_chain(["a"], ["d", "b", "c"]) == ["a", "b", "c", "d"]
    assert plan_chain(["a"], ["a", "b"]) == ["a", "b"]  # a holder needs nothing
    assert plan_chain([], ["b", "c"]) == [None, "b", "c"]  # no holder: the first receiver asks the registry
    assert plan_chain(["a"], []) == ["a"]


def test_plan_chain_avoids_links_that_carry_serving_traffic() -> None:
    busy = {("a", "b"), ("b", "c")}  # e.g. a pipeline's activations a → b → c
    chain = plan_chain(["a"], ["b", "c", "d"], busy)
    assert chain_busy_hops(chain, busy) == 0 and chain[0] == "a" and sorted(chain[1:]) == ["b", "c", "d"]
    # two holders: the one whose sends are quiet is the source
    busy = {("a", "c"), ("a", "d")}
    chain = plan_chain(["a", "b"], ["c", "d"], busy)
    assert chain[0] == "b" and chain_busy_hops(chain, busy) == 0
    # links are directional (full-duplex NICs): b → a busy does not block a → b
    assert plan_chain(["a"], ["b"], {("b", "a")}) == ["a", "b"]
    # nothing quiet: the plan still reaches everyone, with as few busy hops as it can
    everything = {(x, y) for x in "abc" for y in "abc" if x != y}
    chain = plan_chain(["a"], ["b", "c"], everything)
    assert sorted(chain[1:]) == ["b", "c"] and chain_busy_hops(chain, everything) == 2


def _host(name: str, cached: set[str], free: int = 2) -> HostView:
    return HostView(name, gpu_slots=free, gpu_used=0, memory_limit=10 << 30, memory_used=0,
                    cached=frozenset(cached))


def test_placer_prefers_fork_then_peer_then_cold() -> None:
    for name in ("cache-aware", "first-fit"):
        placer = make_placer(name) if name == "first-fit" else make_placer(name, contention_threshold=99)
        full_holder = HostView("a", gpu_slots=1, gpu_used=1, memory_limit=10 << 30, memory_used=0,
                               cached=frozenset({"f"}))
        result = placer.place([full_holder, _host("b", set())], [ReplicaRequest("f", 1, 1 << 20)])
        assert [(p.host, p.source) for p in result.placements] == [("b", "peer")], name
        result = placer.place([_host("a", {"f"}), _host("b", set())], [ReplicaRequest("f", 1, 1 << 20)])
        assert [(p.host, p.source) for p in result.placements] == [("a", "fork")], name
        result = placer.place([_host("a", set()), _host("b", set())], [ReplicaRequest("g", 1, 1 << 20)])
        assert [p.source for p in result.placements] == ["cold"], name


def test_multicast_tells_each_receiver_its_predecessor_in_chain_order() -> None:
    import asyncio

    from quart_provider.hosts import ReplicaSpec
    from quart_provider.keysmanager_host import KeysManagerHost, multicast

    told: list[tuple[str, list[str]]] = []

    class Client:  # records what the receivers are told
        def __init__(self, address: str) -> None:
            self.address = address

        async def prefetch(self, stage, peers) -> dict:
            told.append((self.address, list(peers)))
            return {}

    hosts = [KeysManagerHost(f"h{i}", Client(f"http://10.0.0.{i}:7077"), 1, 0) for i in range(4)]
    spec = ReplicaSpec("m-stage-0", "stage", env={"QUART_MODEL_URL": "s3://m/x", "QUART_STAGE_INDEX": "0"})
    asyncio.run(multicast(spec, hosts))
    src = "http://10.0.0.0:7077"
    assert told == [("http://10.0.0.1:7077", [src]), ("http://10.0.0.2:7077", ["http://10.0.0.1:7077", src]),
                    ("http://10.0.0.3:7077", ["http://10.0.0.2:7077", src])]
    told.clear()
    asyncio.run(multicast(spec, [None, *hosts[1:3]]))  # no holder: the first fetches from the registry
    assert told == [("http://10.0.0.1:7077", []), ("http://10.0.0.2:7077", ["http://10.0.0.1:7077"])]
    assert hosts[0].peer_address == src
