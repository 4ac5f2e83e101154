"""Actuator over the OpenFaaS gateway REST API (spec.openapi.yml of openfaas/faas), basic auth.

Scale: ``POST /system/scale-function/<name>`` with ``{"serviceName", "replicas"}`` (plus the
non-standard ``"key": true`` hint for key stages, which other gateways ignore). CPUs: read the
function (``GET /system/function/<name>``), set ``limits.cpu``, ``PUT /system/functions``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
from gateway_plugin.actuators import ActuatorError

DEPLOYMENT_FIELDS = ("service", "image", "namespace", "envProcess", "envVars", "constraints", "secrets",
                     "labels", "annotations", "limits", "requests", "readOnlyRootFilesystem")


def deployment_from_status(function: str, status: dict[str, Any]) -> dict[str, Any]:
    """The ``PUT /system/functions`` body that redeploys a function as its ``FunctionStatus`` describes it."""
    deployment = {k: status[k] for k in DEPLOYMENT_FIELDS if k in status and status[k] is not None}
    deployment["service"] = function
    return deployment


@dataclass(slots=True)
class RestActuator:
    gateway_url: str
    user: str = "admin"
    password: str = ""
    timeout_s: float = 10.0
    _session: aiohttp.ClientSession | None = field(default=None, repr=False)

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                auth=aiohttp.BasicAuth(self.user, self.password) if self.password else None,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, path: str, body: Any | None = None) -> Any:
        session = await self._client()
        url = self.gateway_url.rstrip("/") + path
        async with session.request(method, url, json=body) as resp:
            text = await resp.text()
            if resp.status >= 300:
                raise ActuatorError(f"{method} {path} answered {resp.status}: {text.strip()[:300]}")
            if text and resp.content_type == "application/json":
                return await resp.json()
            return None

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        body: dict[str, Any] = {"serviceName": function, "replicas": int(replicas)}
        if key:
            body["key"] = True
        await self._call("POST", f"/system/scale-function/{function}", body)

    async def describe(self, function: str) -> dict[str, Any]:
        return await self._call("GET", f"/system/function/{function}")

    async def set_cpus(self, function: str, cpus: float) -> None:
        deployment = deployment_from_status(function, await self.describe(function))
        limits = dict(deployment.get("limits") or {})
        limits["cpu"] = f"{cpus:g}"
        deployment["limits"] = limits
        await self._call("PUT", "/system/functions", deployment)
