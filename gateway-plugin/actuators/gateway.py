"""Actuator over the in-process embedded gateway: its scale / CPU calls (the placer runs behind)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway_plugin.ports import PluginHost


@dataclass(slots=True)
class GatewayActuator:
    gateway: PluginHost  # the embedded gateway (quart_provider.gateway.EmbeddedGateway), by its port: no import of it

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        await self.gateway.scale_function(function, replicas, key=key)

    async def set_cpus(self, function: str, cpus: float) -> None:
        await self.gateway.set_function_cpus(function, cpus)

    async def close(self) -> None:
        return None  # the gateway is closed by its owner
