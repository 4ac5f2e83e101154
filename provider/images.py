"""How a deployed function's ``image`` becomes something runnable on this machine.

There is no container runtime here, so an image name is resolved, in this order:

1. **Built-in images**: ``quart/echo[:tag]`` runs :mod:`quart_provider.echo` as a process
   (a fast echo function for benchmarks and tests).
2. **The image index** ``<state>/images.json``, written by `quartctl up -f` / `quartctl deploy -f`
   from a stack.yml: image → ``{function, lang, handler, stack}``. A ``pipeline-stage`` entry is a
   stage of a partitioned model run by the template's stage runtime (``template/pipeline-stage``);
   other templates cannot run without containers and are refused.
3. **Stage environment**: a deployment whose ``envVars`` carry ``QUART_MODEL_DIR`` is a
   ``pipeline-stage`` function (the stage runtime reads everything else from the environment), so
   `faas-cli deploy` of our stack.yml works without the index.

A stage function's ``QUART_MODEL_DIR`` must hold ``manifest.json``; anything else is a 400 that
names the field to fix.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from quart_provider.deployment import FunctionDeployment
from quart_stage.errors import QuartError, invalid

from keysmanager.registry import MODEL_URL_ENV, RegistryError, parse_model_url

INDEX_FILE = "images.json"
STAGE_LANG = "pipeline-stage"
ECHO_IMAGE = "quart/echo"
MODEL_DIR_ENV = "QUART_MODEL_DIR"


@dataclass(frozen=True, slots=True)
class Runnable:
    """What runs a function's replicas."""

    kind: Literal["stage", "process"]
    source: str  # how the image was resolved, for status and errors
    argv: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/_/health"


def _image_name(image: str) -> str:
    """``repo/name:tag`` → ``repo/name`` (a registry host with a port keeps its colon)."""
    last = image.rsplit("/", 1)[-1]
    return image[: len(image) - len(last)] + last.split(":", 1)[0].split("@", 1)[0]


class ImageIndex:
    """``<state>/images.json``: the images a stack.yml declared, and where their handlers are."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as exc:
            raise RuntimeError(f"image index {self.path} is unreadable: {exc}") from None
        return data if isinstance(data, dict) else {}

    def register(self, entries: dict[str, dict[str, str]]) -> None:
        """Add or replace entries (atomic rewrite)."""
        data = self.load()
        data.update(entries)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, self.path)

    def lookup(self, image: str) -> dict[str, str] | None:
        data = self.load()
        return data.get(image) or data.get(_image_name(image))


def _stage_runnable(deployment: FunctionDeployment, source: str) -> Runnable:
    model_dir = deployment.env_vars.get(MODEL_DIR_ENV)
    model_url = deployment.env_vars.get(MODEL_URL_ENV)
    if model_url and not model_dir:  # from the model registry: each host's KeysManager makes it local
        try:
            parse_model_url(model_url)
        except RegistryError as exc:
            raise invalid(f"envVars.{MODEL_URL_ENV}", str(exc)) from None
        return Runnable("stage", source)
    if not model_dir:
        raise invalid(f"envVars.{MODEL_DIR_ENV}",
                      f"a {STAGE_LANG} function needs envVars.{MODEL_DIR_ENV} (the partitioned model folder) or "
                      f"envVars.{MODEL_URL_ENV} (the model in a registry, s3://bucket/prefix)")
    if not (Path(model_dir) / "manifest.json").is_file():
        raise invalid(f"envVars.{MODEL_DIR_ENV}", f"envVars.{MODEL_DIR_ENV}={model_dir!r} holds no manifest.json; "
                      "partition the model first (quartctl partition)")
    return Runnable("stage", source)


def resolve(deployment: FunctionDeployment, index: ImageIndex) -> Runnable:
    """The runnable behind ``deployment.image``; raises a 400 :class:`QuartError` naming the field."""
    image = deployment.image
    if _image_name(image) == ECHO_IMAGE:
        argv = (sys.executable, "-m", "quart_provider.echo")
        return Runnable("process", f"built-in {ECHO_IMAGE}", argv)
    try:
        entry = index.lookup(image)
    except RuntimeError as exc:
        raise QuartError(500, str(exc), "image") from None
    if entry is not None:
        lang = entry.get("lang", "")
        if lang != STAGE_LANG:
            raise invalid("image", f"image {image!r} is built from template {lang!r}; only {STAGE_LANG!r} functions "
                                   f"and {ECHO_IMAGE} run on the embedded gateway (no container runtime)")
        return _stage_runnable(deployment, f"image index ({entry.get('stack', index.path)})")
    if MODEL_DIR_ENV in deployment.env_vars or MODEL_URL_ENV in deployment.env_vars:
        return _stage_runnable(deployment, f"{STAGE_LANG} (envVars.{MODEL_DIR_ENV})")
    raise invalid(
        "image",
        f"cannot resolve image {image!r} to something runnable on this machine: deploy its stack with "
        f"`quartctl up -f stack.yml` or `quartctl deploy -f stack.yml` (records the image in {index.path}), "
        f"set envVars.{MODEL_DIR_ENV} for a {STAGE_LANG} function, or use the built-in {ECHO_IMAGE}",
    )
