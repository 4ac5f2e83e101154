"""Actuators: how a controller's decision reaches the platform.

- ``GatewayActuator``: method calls on the in-process embedded gateway (``quartctl up``).
- ``RestActuator``: the OpenFaaS gateway REST API (``POST /system/scale-function/<name>``,
  ``PUT /system/functions`` with new ``limits.cpu``).
- ``FaasCliActuator``: ``faas-cli deploy`` with the ``com.openfaas.scale.*`` labels and ``--cpu-limit``.
"""

from __future__ import annotations

from typing import Protocol


class Actuator(Protocol):
    async def scale(self, function: str, replicas: int, key: bool = False) -> None: ...

    async def set_cpus(self, function: str, cpus: float) -> None: ...


class ActuatorError(RuntimeError):
    """The platform refused or failed a scaling action; the message says which and why."""


__all__ = ["Actuator", "ActuatorError"]
