"""Actuator over the in-process embedded gateway: its scale / update_limits calls (the placer runs behind)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class GatewayActuator:
    gateway: Any  # the embedded gateway (quart_provider.gateway.EmbeddedGateway), duck-typed: no import of it

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        await self.gateway.registry.scale(function, replicas, key=key)

    async def set_cpus(self, function: str, cpus: float) -> None:
        await self.gateway.registry.update_limits(function, cpus=cpus)
