"""Actuator through ``faas-cli deploy`` (OpenFaaS's own CLI), for clusters where that is the interface.

faas-cli has no "set replicas" verb for OpenFaaS CE; the supported way is to redeploy the function
with ``com.openfaas.scale.min`` = the wanted count (the provider keeps at least min replicas). The
function's image, environment, other labels and limits are read back over REST first so the redeploy
changes nothing else; CPUs go in ``--cpu-limit``. A lower minimum does not remove replicas, so a
scale-down is completed with ``POST /system/scale-function``. Credentials reach faas-cli through
``faas-cli login --password-stdin`` (never on the command line). A redeploy is a rolling update on
Kubernetes, so it is only issued when the wanted count or CPUs changed.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from typing import Any

from gateway_plugin.actuators import ActuatorError
from gateway_plugin.actuators.rest import RestActuator

from keysmanager.aio import within

LABEL_MIN = "com.openfaas.scale.min"
LABEL_MAX = "com.openfaas.scale.max"


def faas_cli_path() -> str | None:
    return shutil.which("faas-cli")


def deploy_command(
    gateway_url: str, status: dict[str, Any], replicas: int | None = None, cpus: float | None = None,
    binary: str = "faas-cli",
) -> list[str]:
    """The ``faas-cli deploy`` argv that redeploys ``status`` (a FunctionStatus) with new replicas/CPUs."""
    name = status["name"] if "name" in status else status["service"]
    argv = [binary, "deploy", "--gateway", gateway_url, "--name", name, "--image", status["image"]]
    if status.get("namespace"):
        argv += ["--namespace", status["namespace"]]
    if status.get("envProcess"):
        argv += ["--fprocess", status["envProcess"]]
    for key, value in sorted((status.get("envVars") or {}).items()):
        argv += ["--env", f"{key}={value}"]
    labels = dict(status.get("labels") or {})
    if replicas is not None:
        labels[LABEL_MIN] = str(int(replicas))
        if int(labels.get(LABEL_MAX, replicas) or replicas) < replicas:
            labels[LABEL_MAX] = str(int(replicas))
    for key, value in sorted(labels.items()):
        argv += ["--label", f"{key}={value}"]
    for key, value in sorted((status.get("annotations") or {}).items()):
        argv += ["--annotation", f"{key}={value}"]
    limits = dict(status.get("limits") or {})
    cpu_limit = f"{cpus:g}" if cpus is not None else limits.get("cpu")
    if cpu_limit:
        argv += ["--cpu-limit", str(cpu_limit)]
    if limits.get("memory"):
        argv += ["--memory-limit", str(limits["memory"])]
    for secret in status.get("secrets") or []:
        argv += ["--secret", secret]
    return argv


@dataclass(slots=True)
class FaasCliActuator:
    gateway_url: str
    user: str = "admin"
    password: str = ""
    binary: str = field(default_factory=lambda: faas_cli_path() or "faas-cli")
    timeout_s: float = 60.0
    _rest: RestActuator | None = field(default=None, repr=False)
    _logged_in: bool = False

    def __post_init__(self) -> None:
        self._rest = RestActuator(self.gateway_url, self.user, self.password)

    async def _run(self, argv: list[str], stdin: bytes | None = None) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
        except FileNotFoundError:
            raise ActuatorError(f"{argv[0]} is not on PATH; install faas-cli or use the rest actuator") from None
        try:
            out, _ = await within(self.timeout_s, proc.communicate(stdin))
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise ActuatorError(f"{' '.join(argv[:2])} did not finish in {self.timeout_s:g} s") from None
        text = out.decode(errors="replace")
        if proc.returncode != 0:
            raise ActuatorError(f"{' '.join(argv[:2])} exited with {proc.returncode}: {text.strip()[-300:]}")
        return text

    async def login(self) -> None:
        if self._logged_in or not self.password:
            return
        await self._run([self.binary, "login", "--gateway", self.gateway_url, "--username", self.user,
                         "--password-stdin"], stdin=self.password.encode())
        self._logged_in = True

    async def _deploy(self, function: str, replicas: int | None = None, cpus: float | None = None) -> dict:
        assert self._rest is not None
        status = await self._rest.describe(function)
        await self.login()
        await self._run(deploy_command(self.gateway_url, status, replicas, cpus, self.binary))
        return status

    async def scale(self, function: str, replicas: int, key: bool = False) -> None:
        status = await self._deploy(function, replicas=replicas)
        if int(status.get("replicas", 0) or 0) > replicas:
            # a raised scale.min never removes replicas: lower the count through the REST API
            assert self._rest is not None
            await self._rest.scale(function, replicas, key=key)

    async def set_cpus(self, function: str, cpus: float) -> None:
        await self._deploy(function, cpus=cpus)

    async def close(self) -> None:
        if self._rest is not None:
            await self._rest.close()
