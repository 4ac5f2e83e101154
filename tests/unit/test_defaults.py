"""The system of the papers is what runs by default (issue 32, item 1); each part can be turned off."""

from __future__ import annotations

from gateway_plugin.config import QuartConfig
from gateway_plugin.policies import make_policy
from quart_provider.config import GatewayConfig


def test_the_gateway_defaults_to_the_cache_aware_placer_and_live_scaling_where_hosts_have_addresses() -> None:
    cfg = GatewayConfig.from_env({})
    assert cfg.placer == "cache-aware" and cfg.peer_fetch is True
    assert cfg.live_scaling is None  # unset: on with network=netns (hosts with addresses), off on loopback
    off = GatewayConfig.from_env({"QUART_GATEWAY_PLACER": "first-fit", "QUART_GATEWAY_LIVE_SCALING": "false",
                                  "QUART_GATEWAY_PEER_FETCH": "false"})
    assert (off.placer, off.live_scaling, off.peer_fetch) == ("first-fit", False, False)
    assert GatewayConfig.from_env({"QUART_GATEWAY_LIVE_SCALING": "true"}).live_scaling is True


def test_quart_defaults_to_every_part_of_the_paper() -> None:
    cfg = QuartConfig()
    assert cfg.smooth.enabled and cfg.cpu.enabled and cfg.mode == "provision"
    policy = make_policy("quart", smooth={"enabled": False}, cpu={"enabled": False}, mode="pid")
    assert not policy.config.smooth.enabled and not policy.config.cpu.enabled and policy.config.mode == "pid"
