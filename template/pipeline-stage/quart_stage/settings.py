"""One way to read settings from the environment, for every component (OpenFaaS convention: upper-case
variables, a documented default for each, explicit overrides last).

A settings class is a frozen dataclass whose fields have defaults. ``settings_from_env(cls, prefix)``
reads ``<PREFIX><FIELD>`` for every field (or the names given in ``names``), parses each value by the
field's declared type with the rules below, then applies ``overrides`` (``None`` keeps the value):

- ``bool``: ``1 true yes on`` / ``0 false no off`` (any case); anything else is an error;
- ``int``: a decimal integer; ``float``: a finite number (``nan`` and ``inf`` are errors);
- ``str``; ``Path``; ``tuple[float, ...]`` / ``tuple[int, ...]`` / ``tuple[str, ...]``: comma-separated;
- an empty variable is the same as an unset one.

Every error is a :class:`ConfigError` naming the variable and what it must be. :func:`setting` reads one variable
by the same rules. This module is the one place that reads the environment by name
(tests/unit/test_settings_reads.py).
"""

from __future__ import annotations

import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable."""


def parse_bool(raw: str, name: str) -> bool:
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(f"{name} must be one of 1/true/yes/on or 0/false/no/off, got {raw!r}")


def parse_int(raw: str, name: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def parse_float(raw: str, name: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {raw!r}")
    return value


def _strip_optional(kind: Any) -> Any:
    """``X | None`` → ``X``; anything else unchanged."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def parse_as(kind: Any, raw: str, name: str) -> Any:
    """``raw`` parsed as the (resolved) type ``kind``."""
    kind = _strip_optional(kind)
    if kind is bool:
        return parse_bool(raw, name)
    if kind is int:
        return parse_int(raw, name)
    if kind is float:
        return parse_float(raw, name)
    if kind is Path:
        return Path(raw)
    if kind is str:
        return raw
    if typing.get_origin(kind) is tuple:
        item = typing.get_args(kind)[0]
        return tuple(parse_as(item, part, name) for part in raw.split(",") if part.strip())
    raise ConfigError(f"{name}: a setting of type {kind!r} cannot be read from the environment")


def settings_from_env(
    cls: type[T],
    prefix: str,
    env: Mapping[str, str] | None = None,
    names: Mapping[str, str] | None = None,
    **overrides: Any,
) -> T:
    """``cls`` built from its defaults updated from ``<prefix><FIELD>`` variables (``names`` maps a field to another variable),
    then from ``overrides`` (unknown names are an error; ``None`` keeps the value)."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"{cls.__name__} has no setting(s) {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        var = (names or {}).get(f.name) or f"{prefix}{f.name.upper()}"
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        values[f.name] = parse_as(hints[f.name], raw, var)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def setting(name: str, kind: type[T], default: T, env: Mapping[str, str] | None = None) -> T:
    """One variable, ``name``, parsed as ``kind`` with the rules above; ``default`` when it is unset or empty. For a
    lone variable outside any settings class (a gunicorn config file, a variable another program defines)."""
    env = os.environ if env is None else env
    raw = env.get(name)
    return default if raw is None or raw == "" else parse_as(kind, raw, name)


def env_names(cls: type, prefix: str, names: Mapping[str, str] | None = None) -> dict[str, str]:
    """field → environment variable, as :func:`settings_from_env` reads them (for docs and ``--help``)."""
    return {f.name: (names or {}).get(f.name) or f"{prefix}{f.name.upper()}" for f in fields(cls)}
