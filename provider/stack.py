"""faas-cli's stack.yml → the deploy requests faas-cli sends, and image-index entries.

Mirrors faas-cli: ``environment_file`` entries first, then ``environment``; ``${VAR}`` /
``${VAR:-default}`` substituted from the environment; ``labels``, ``annotations``, ``limits``,
``requests``, ``secrets``, ``constraints``, ``namespace``, ``fprocess``,
``readonly_root_filesystem``. Values in maps become strings, as the Go YAML decoder makes them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class StackError(ValueError):
    """A stack.yml that cannot be read; the message names the file and the field."""


@dataclass(frozen=True, slots=True)
class StackFunction:
    name: str
    request: dict[str, Any]  # the FunctionDeployment JSON faas-cli sends
    lang: str
    handler: str  # absolute path of the handler folder ("" when not given)


@dataclass(frozen=True, slots=True)
class Stack:
    path: Path
    gateway: str | None
    functions: list[StackFunction]

    def image_index_entries(self) -> dict[str, dict[str, str]]:
        return {f.request["image"]: {"function": f.name, "lang": f.lang, "handler": f.handler, "stack": str(self.path)}
                for f in self.functions}


def _substitute(text: str, env: dict[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(2) or ""), text)


def _str_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise StackError(f"{where} must be a map")
    return {str(k): "" if v is None else (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items()}


def _resources(value: Any, where: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StackError(f"{where} must be a map with memory and/or cpu")
    out = {k: str(value[k]) for k in ("memory", "cpu") if value.get(k) not in (None, "")}
    return out or None


def load_stack(path: str | Path, env: dict[str, str] | None = None) -> Stack:
    """Read a stack.yml; raises :class:`StackError` with the file and field on bad input."""
    path = Path(path).resolve()
    env = dict(os.environ if env is None else env)
    try:
        raw = yaml.safe_load(_substitute(path.read_text(), env))
    except OSError as exc:
        raise StackError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise StackError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("functions"), dict) or not raw["functions"]:
        raise StackError(f"{path}: 'functions' must be a non-empty map of function name → settings")
    provider = raw.get("provider") or {}
    functions = []
    for name, spec in raw["functions"].items():
        where = f"{path}: functions.{name}"
        if not isinstance(spec, dict):
            raise StackError(f"{where} must be a map")
        if not spec.get("image"):
            raise StackError(f"{where}.image is required")
        env_vars: dict[str, str] = {}
        for env_file in spec.get("environment_file") or []:
            file_path = (path.parent / str(env_file)).resolve()
            try:
                loaded = yaml.safe_load(file_path.read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise StackError(f"{where}.environment_file {env_file}: {exc}") from None
            env_vars.update(_str_map(loaded.get("environment", loaded), f"{where}.environment_file"))
        env_vars.update(_str_map(spec.get("environment"), f"{where}.environment"))
        request: dict[str, Any] = {
            "service": str(name),
            "image": str(spec["image"]),
            "envVars": env_vars,
            "labels": _str_map(spec.get("labels"), f"{where}.labels"),
            "annotations": _str_map(spec.get("annotations"), f"{where}.annotations"),
        }
        if spec.get("namespace"):
            request["namespace"] = str(spec["namespace"])
        if spec.get("fprocess"):
            request["envProcess"] = str(spec["fprocess"])
        for key, field_name in (("secrets", "secrets"), ("constraints", "constraints")):
            if spec.get(key):
                request[field_name] = [str(v) for v in spec[key]]
        for key in ("limits", "requests"):
            resources = _resources(spec.get(key), f"{where}.{key}")
            if resources:
                request[key] = resources
        if spec.get("readonly_root_filesystem"):
            request["readOnlyRootFilesystem"] = True
        handler = spec.get("handler")
        functions.append(StackFunction(str(name), request, str(spec.get("lang", "")),
                                       str((path.parent / handler).resolve()) if handler else ""))
    return Stack(path, provider.get("gateway"), functions)
