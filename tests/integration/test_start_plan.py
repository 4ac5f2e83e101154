"""One planned start is one KeysManager call (issue 42): the gateway's host hands its KeysManager the plan whole
(``StartOrder``: mode, peers, layers) and gets back what it did (``StartReport``: the path and, when that is not
the plan's mode, why). Counted here on real KeysManagers on loopback TCP, a tiny llama in a moto S3 registry:
cold (from the registry, serving while it loads), fork (first with no zygote left: a fallback, then from the
zygote), peer and live (from the host that holds the stage). Every replica then answers its health path."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
import requests
from quart_provider.hosts import ReplicaSpec, Started
from quart_provider.keysmanager_host import KeysManagerHost
from support.keysmanager import Daemon, daemons_in_temp_dir
from support.live_registry import URL

from keysmanager.client import AsyncKeysManagerClient
from keysmanager.types import StartOrder

FUNCTION = "plan-llama-0"
SPEC = ReplicaSpec(FUNCTION, "stage", env={"QUART_MODEL_URL": URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "cpu"})


class CountingClient(AsyncKeysManagerClient):
    """The gateway's KeysManager client, counting the calls it makes."""

    calls: list[str]

    async def _call(self, method: str, path: str, body: dict | None = None):
        self.calls.append(f"{method} {path}")
        return await super()._call(method, path, body)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(registry):
    """Three KeysManagers on TCP sharing the cluster's token: (their daemons, their TCP addresses, the token)."""
    with daemons_in_temp_dir() as (root, daemons, _):
        token_file = root / "keysmanager-token"
        token_file.write_text("t0k3n-" + "x" * 30 + "\n")
        os.chmod(token_file, 0o600)
        addresses = []
        for name in ("h0", "h1", "h2"):
            port = _free_port()
            daemons.append(Daemon(root, name, "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file)).start())
            addresses.append(f"http://127.0.0.1:{port}")
        yield daemons, addresses, token_file.read_text().strip()


def _wait(predicate, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


def _healthy(url: str) -> bool:
    try:
        return requests.get(url + "/_/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def test_each_planned_start_is_one_keysmanager_call_that_reports_its_path(cluster: tuple[list[Daemon], list[str], str]
                                                                         ) -> None:
    daemons, addresses, token = cluster

    async def scenario() -> list[tuple[str, str, Started, list[str]]]:
        hosts = []
        for d, address in zip(daemons, addresses, strict=True):
            client = CountingClient(address, token=token, timeout=120)
            client.calls = []
            hosts.append(KeysManagerHost(d.name, client, gpu_slots=4, memory_limit=1 << 30))
        out = []

        async def start(host: KeysManagerHost, order: StartOrder) -> Started:
            host.client.calls.clear()
            started = await host.start(SPEC, order)
            out.append((host.name, order.mode, started, list(host.client.calls)))
            return started

        try:
            await start(hosts[0], StartOrder("cold"))  # nothing anywhere: from the registry, serving as it loads
            await asyncio.to_thread(_wait, lambda: FUNCTION in daemons[0].client.report().held, "h0 holds the stage")
            await start(hosts[0], StartOrder("fork"))  # the placer's fork, but no zygote here: one is loaded
            await start(hosts[0], StartOrder("fork"))  # now from the zygote
            await start(hosts[1], StartOrder("peer", (addresses[0],)))
            await start(hosts[2], StartOrder("live", (addresses[0],)))
        finally:
            for host in hosts:
                await host.close()
        return out

    starts = asyncio.run(scenario())
    for name, mode, started, calls in starts:
        assert calls == ["POST /v1/starts"], (name, mode, calls)  # one KeysManager call per start, nothing else
        assert len(started.replicas) == 1, (name, mode, started)
    paths = [(name, mode, started.path) for name, mode, started, _ in starts]
    assert paths == [("h0", "cold", "cold"), ("h0", "fork", "cold"), ("h0", "fork", "fork"),
                     ("h1", "peer", "peer"), ("h2", "live", "live")]
    fallbacks = [started.fallback for _, _, started, _ in starts]
    assert fallbacks[0] == fallbacks[2] == fallbacks[3] == fallbacks[4] == ""
    assert "no zygote" in fallbacks[1], fallbacks[1]  # the fallback says why
    for _, _, started, _ in starts:
        [replica] = started.replicas
        _wait(lambda url=replica.url: _healthy(url), f"{replica.id} answers its health path")
    held = {d.name: set(d.client.report().held) for d in daemons}
    assert all(FUNCTION in h for h in held.values()), held  # the peer and live starts brought the stage over


def test_a_plan_names_its_fields_and_refuses_what_it_does_not_know(cluster: tuple[list[Daemon], list[str], str]
                                                                   ) -> None:
    _, addresses, token = cluster
    headers = {"Authorization": f"Bearer {token}"}
    spec = {"function": FUNCTION, "env": SPEC.env}
    for plan, field in (({"mode": "teleport"}, "plan.mode"), ({"mode": "peer", "peers": ["nowhere"]}, "plan.peers"),
                        ({"mode": "paraserve", "layers": [3, 1]}, "plan.layers"),
                        ({"mode": "cold", "priority": 1}, "plan.priority"), ({"mode": "cold", "count": -1}, "plan.count")):
        res = requests.post(addresses[0] + "/v1/starts", json={"spec": spec, "plan": plan}, headers=headers, timeout=10)
        assert res.status_code == 400 and res.json()["field"] == field, (plan, res.text)
    res = requests.post(addresses[0] + "/v1/starts", json={"spec": spec}, headers=headers, timeout=10)
    assert res.status_code == 400 and res.json()["field"] == "plan"
