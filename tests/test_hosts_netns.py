"""`quartctl up --network netns`: hosts as namespaces on a bridge, KeysManagers on TCP with the cluster token,
replicas on the host addresses, the gateway reaching them across the bridge; `quartctl host down|up`.

The namespace tests need root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2 and skip with the reason
otherwise; each removes its namespaces even on failure (the system's stop, then a cleanup by prefix).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import requests
from quart_provider.config import GatewayConfig
from quart_provider.network import HostNetwork, NetHost, cleanup_by_prefix, cluster_id, links, namespaces
from quart_provider.network import unavailable_reason as netns_unavailable
from quart_provider.stack import load_stack
from quart_provider.system import STATE_FILE, EmbeddedSystem
from quart_stage.settings import ConfigError
from quart_tools.platform import host as host_command

REASON = netns_unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"host namespaces unavailable: {REASON}")
BODY = json.dumps({"input_ids": [[1, 2, 3, 4]]}).encode()


@pytest.fixture(scope="module")
def emulated_stack(tmp_path_factory):
    from quart_tools.partition import partition

    out = tmp_path_factory.mktemp("model")
    partition("bert-21b", 2, str(out), weights="none", stack={"compute": "emulated", "scale_min": 1, "scale_max": 4},
              progress=False)
    return load_stack(out / "stack.yml")


def netns_config(state_dir, **overrides) -> GatewayConfig:
    settings = dict(port=0, state_dir=state_dir, hosts=2, gpus_per_host=4, network="netns", nic_gbps=1.0,
                    reconcile_interval_s=0.1, drain_timeout_s=5, ready_wait_s=60)
    settings.update(overrides)
    return GatewayConfig(**settings)


async def invoke(url: str, name: str) -> int:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session, session.post(
            f"{url}/function/{name}", data=BODY, headers={"Content-Type": "application/json"}) as res:
        await res.read()
        return res.status


@needs_netns
def test_up_netns_runs_stages_on_host_addresses(tmp_path, emulated_stack) -> None:
    state_dir = tmp_path / "state"
    cid = cluster_id(str(state_dir))

    async def scenario() -> None:
        system = EmbeddedSystem(netns_config(state_dir), use_keysmanager=True)
        try:
            await system.start()
            net = system.network
            assert net is not None and net.cluster_id == cid
            assert sorted(n for n in namespaces() if n.startswith(cid)) == [f"{cid}-host-0", f"{cid}-host-1"]
            state = json.loads((state_dir / STATE_FILE).read_text())
            assert state["network"]["hosts"][1]["address"] == net.host("host-1").address
            # each KeysManager: TCP on its host address, the token file private, no answer without it
            token_file = state_dir / "secrets" / "keysmanager-token"
            assert token_file.stat().st_mode & 0o777 == 0o600
            for entry in state["hosts"]:
                assert entry["endpoint"] == f"http://{net.host(entry['name']).address}:7077"
                res = await asyncio.to_thread(requests.get, entry["endpoint"] + "/v1/health", timeout=5)
                assert res.status_code == 401 and "Authorization" in res.json()["error"]
            await system.deploy_stack(emulated_stack)
            names = [f.name for f in emulated_stack.functions]
            await system.wait_ready(names, timeout_s=120)
            gw = system.gateway
            for name in names:
                [replica] = gw.functions[name].ready
                assert replica.url.startswith(f"http://{net.host(replica.host).address}:"), replica.url
            assert await invoke(system.url, names[0]) == 200  # gateway → bridge → replica (stage 0 takes JSON)
            # scale a stage across both hosts
            assert await gw.scale(names[0], 6) == 4  # scale.max
            await system.wait_ready(names[:1], timeout_s=120)
            assert {e.host for e in gw.functions[names[0]].ready} == {"host-0", "host-1"}
        finally:
            await system.stop()
            cleanup_by_prefix(cid)
        assert not [n for n in namespaces() if n.startswith(cid)]
        assert not [n for n in links() if n.startswith(cid)]

    asyncio.run(scenario())


def test_netns_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="network must be one of loopback, netns"):
        GatewayConfig(network="vlan")
    with pytest.raises(ConfigError, match="nic_gbps must be > 0"):
        GatewayConfig(network="netns", nic_gbps=0)


def _write_state(state_dir, network: HostNetwork | None) -> None:
    state_dir.mkdir(parents=True)
    (state_dir / STATE_FILE).write_text(json.dumps({"pid": 0, "url": "http://127.0.0.1:1", "hosts": [],
                                                    "network": network.to_json() if network else None}))


def test_host_command_names_the_hosts(tmp_path, capsys) -> None:
    net = HostNetwork("qtest0", "10.200.9.0/24", 1.0, [NetHost("host-0", 0, "qtest0-host-0", "10.200.9.2", "qtest0v0"),
                                                       NetHost("host-1", 1, "qtest0-host-1", "10.200.9.3", "qtest0v1")])
    _write_state(tmp_path / "a", net)
    assert host_command(["down", "host-7", "--state-dir", str(tmp_path / "a")]) == 2
    assert "no host named 'host-7'; hosts: host-0, host-1" in capsys.readouterr().err
    _write_state(tmp_path / "b", None)
    assert host_command(["down", "host-0", "--state-dir", str(tmp_path / "b")]) == 2
    assert "runs on loopback" in capsys.readouterr().err
    assert host_command(["up", "host-0", "--state-dir", str(tmp_path / "c")]) == 1
    assert "nothing is running" in capsys.readouterr().err


@needs_netns
def test_host_down_and_up_take_the_link(tmp_path, capsys) -> None:
    cid = cluster_id(str(tmp_path))
    try:
        net = HostNetwork.create(["host-0", "host-1"], cid, nic_gbps=1.0)
        _write_state(tmp_path / "state", net)
        assert host_command(["down", "host-1", "--state-dir", str(tmp_path / "state")]) == 0
        assert not net.link_is_up("host-1") and net.link_is_up("host-0")
        assert host_command(["up", "host-1", "--state-dir", str(tmp_path / "state")]) == 0
        assert net.link_is_up("host-1")
        assert "host-1: link up" in capsys.readouterr().out
    finally:
        cleanup_by_prefix(cid)
