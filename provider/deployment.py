"""The OpenFaaS ``FunctionDeployment`` request: parsing, validation, and the settings derived from it.

Field names follow faas-provider's ``types.FunctionDeployment`` (what faas-cli sends) and the
gateway's ``api-docs/spec.openapi.yml``. Every rejection names the offending field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from quart_stage import envpolicy, jsonparse
from quart_stage import labels as vocab
from quart_stage.errors import invalid
from quart_transport.quantities import parse_cpu, parse_memory

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # DNS-1123 label, as faas-netes requires


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from a request body, or a 400 naming the body (NaN, deep nesting included:
    :func:`quart_stage.jsonparse.loads_object`)."""
    return jsonparse.loads_object(raw)


def _str_map(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise invalid(name, f"{name} must be an object of string values")
    return dict(value)


def _str_list(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid(name, f"{name} must be an array of strings")
    return list(value)




@dataclass(frozen=True, slots=True)
class Resources:
    """``limits`` / ``requests`` as sent, plus their parsed values."""

    memory: str | None = None
    cpu: str | None = None
    memory_bytes: int | None = None
    cpus: float | None = None

    @classmethod
    def parse(cls, value: Any, name: str) -> Resources | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise invalid(name, f"{name} must be an object with memory and/or cpu")
        memory, cpu = value.get("memory") or None, value.get("cpu") or None
        try:
            memory_bytes = parse_memory(memory) if memory is not None else None
        except ValueError as exc:
            raise invalid(f"{name}.memory", f"{name}.memory: {exc}") from None
        try:
            cpus = parse_cpu(cpu) if cpu is not None else None
        except ValueError as exc:
            raise invalid(f"{name}.cpu", f"{name}.cpu: {exc}") from None
        return cls(memory, cpu, memory_bytes, cpus)

    def to_json(self) -> dict[str, str]:
        return {k: v for k, v in (("memory", self.memory), ("cpu", self.cpu)) if v is not None}


@dataclass(frozen=True, slots=True)
class FunctionDeployment:
    """A validated deploy/update request (``types.FunctionDeployment``)."""

    service: str
    image: str
    namespace: str
    env_process: str = ""
    env_vars: dict[str, str] = field(default_factory=dict)
    constraints: list[str] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    limits: Resources | None = None
    requests: Resources | None = None
    read_only_root_filesystem: bool = False

    @classmethod
    def from_json(cls, body: dict[str, Any], default_namespace: str) -> FunctionDeployment:
        """Validate a decoded request body; raises :class:`~quart_stage.errors.QuartError` (400) naming the field."""
        service = body.get("service")
        if not isinstance(service, str) or not service:
            raise invalid("service", "service (the function name) is required")
        if len(service) > 63 or not NAME_RE.match(service):
            raise invalid(
                "service",
                f"service {service!r} is not a valid function name: lower-case letters, digits and '-', "
                "starting and ending with a letter or digit, at most 63 characters",
            )
        image = body.get("image")
        if not isinstance(image, str) or not image.strip():
            raise invalid("image", "image is required")
        namespace = body.get("namespace") or default_namespace
        if not isinstance(namespace, str) or namespace != default_namespace:
            raise invalid("namespace",
                          f"namespace {namespace!r} does not exist; this gateway has {default_namespace!r}")
        env_process = body.get("envProcess") or ""
        if not isinstance(env_process, str):
            raise invalid("envProcess", "envProcess must be a string")
        read_only = body.get("readOnlyRootFilesystem", False)
        if not isinstance(read_only, bool):
            raise invalid("readOnlyRootFilesystem", "readOnlyRootFilesystem must be a boolean")
        deployment = cls(
            service=service,
            image=image.strip(),
            namespace=namespace,
            env_process=env_process,
            env_vars=envpolicy.check_deploy_env(_str_map(body.get("envVars"), "envVars")),  # no code via env
            constraints=_str_list(body.get("constraints"), "constraints"),
            secrets=_str_list(body.get("secrets"), "secrets"),
            labels=_str_map(body.get("labels"), "labels"),
            annotations=_str_map(body.get("annotations"), "annotations"),
            limits=Resources.parse(body.get("limits"), "limits"),
            requests=Resources.parse(body.get("requests"), "requests"),
            read_only_root_filesystem=read_only,
        )
        vocab.StageLabels.parse(deployment.labels)  # every com.quart.* / scale label: 400 naming it
        if deployment.min_replicas > deployment.max_replicas:
            raise invalid(
                f"labels.{vocab.SCALE_MIN}",
                f"{vocab.SCALE_MIN}={deployment.min_replicas} is above {vocab.SCALE_MAX}={deployment.max_replicas}",
            )
        if deployment.labels.get(vocab.KEYSMANAGER, "on") not in ("on", "off"):
            raise invalid(f"labels.{vocab.KEYSMANAGER}",
                          f"label {vocab.KEYSMANAGER} must be on or off, got {deployment.labels[vocab.KEYSMANAGER]!r}")
        if deployment.concurrency < 0:  # pragma: no cover - label_int rejects negatives
            raise invalid(f"labels.{vocab.CONCURRENCY}", "concurrency must not be negative")
        return deployment

    # Settings the labels and limits carry -------------------------------------------------------

    @property
    def min_replicas(self) -> int:
        return vocab.label_int(self.labels, vocab.SCALE_MIN, vocab.DEFAULT_MIN_REPLICAS)

    @property
    def max_replicas(self) -> int:
        return vocab.label_int(self.labels, vocab.SCALE_MAX, vocab.DEFAULT_MAX_REPLICAS)

    @property
    def concurrency(self) -> int:
        """Requests one replica serves at once; 0 = unlimited."""
        return vocab.label_int(self.labels, vocab.CONCURRENCY, 0)

    @property
    def param_cache(self) -> bool:
        """Whether replicas start from the KeysManager's cached parameters (``com.quart.keysmanager``)."""
        return self.labels.get(vocab.KEYSMANAGER, "on") == "on"

    @property
    def cpus(self) -> float | None:
        return self.limits.cpus if self.limits and self.limits.cpus else None

    @property
    def memory_bytes(self) -> int | None:
        return self.limits.memory_bytes if self.limits and self.limits.memory_bytes else None

    def to_request(self) -> dict[str, Any]:
        """The deploy request that gives this deployment again (``from_json(to_request())`` is equal)."""
        out = self.to_json()
        out["service"] = out.pop("name")
        return out

    def to_json(self) -> dict[str, Any]:
        """The deployment fields of a ``FunctionStatus`` (without runtime counters)."""
        out: dict[str, Any] = {"name": self.service, "image": self.image, "namespace": self.namespace}
        if self.env_process:
            out["envProcess"] = self.env_process
        out["envVars"] = dict(self.env_vars)
        out["labels"] = dict(self.labels)
        out["annotations"] = dict(self.annotations)
        if self.constraints:
            out["constraints"] = list(self.constraints)
        if self.secrets:
            out["secrets"] = list(self.secrets)
        if self.limits:
            out["limits"] = self.limits.to_json()
        if self.requests:
            out["requests"] = self.requests.to_json()
        if self.read_only_root_filesystem:
            out["readOnlyRootFilesystem"] = True
        return out
