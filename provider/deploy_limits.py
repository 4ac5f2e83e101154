"""What a deploy may not take (issue 31, item 5): a name someone owns, and more than the caps.

- **Reserved names**: ``/function/<name>`` of a deployed model's pipeline (the stages' ``com.quart.model``)
  and of the plugin's own routes (:meth:`.gateway.EmbeddedGateway.reserve_name`) would be taken over by a
  function of that name: 409 naming the owner.
- **Caps** (``GatewayConfig``): functions per namespace (``max_functions``: 409 naming the limit; 10,000
  functions made every pipeline call 10 × slower), labels per function (``max_labels``) and bytes of one
  label's key and value (``max_label_bytes``): 400 naming the label.

Pure: the registry passes what it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from quart_stage.errors import QuartError, invalid


@dataclass(frozen=True, slots=True)
class DeployCaps:
    max_functions: int  # per namespace
    max_labels: int  # per function
    max_label_bytes: int  # one label's key + value, UTF-8


def check_labels(labels: Mapping[str, str], caps: DeployCaps, what: str = "labels") -> None:
    """400 naming the first label over ``max_label_bytes``, or ``what`` when there are over ``max_labels``."""
    if len(labels) > caps.max_labels:
        raise invalid(what, f"{len(labels)} {what} is over the limit of {caps.max_labels} per function "
                            "(QUART_GATEWAY_MAX_LABELS)")
    for key, value in labels.items():
        size = len(key.encode()) + len(value.encode())
        if size > caps.max_label_bytes:
            raise invalid(f"{what}.{key[:64]}", f"label of {size} bytes (key and value) is over the limit of "
                                                f"{caps.max_label_bytes} (QUART_GATEWAY_MAX_LABEL_BYTES)")


def check_name(name: str, pipelines: Mapping[str, list[str]], reserved: Mapping[str, str]) -> None:
    """409 naming the owner when ``name`` is a deployed model's pipeline or a reserved route."""
    owner = reserved.get(name)
    if owner is not None:
        raise QuartError(409, f"function name {name!r} is reserved: /function/{name} belongs to {owner}", "service")
    stages = pipelines.get(name)
    if stages and name not in stages:
        raise QuartError(409, f"function name {name!r} is taken: /function/{name} is the pipeline of model "
                              f"{name!r} (stages {', '.join(stages)})", "service")


def check_model(model: str | None, functions: Iterable[str], reserved: Mapping[str, str]) -> None:
    """409 when a stage's ``com.quart.model`` names a function or a reserved route: its pipeline could never
    answer ``/function/<model>``."""
    if not model:
        return
    owner = reserved.get(model) or (f"function {model!r}" if model in set(functions) else None)
    if owner is not None:
        raise QuartError(409, f"model name {model!r} is taken: /function/{model} belongs to {owner}",
                         "labels.com.quart.model")


def check_count(namespace: str, namespaces: Iterable[str], caps: DeployCaps) -> None:
    """409 when ``namespace`` already holds ``max_functions`` functions."""
    held = sum(1 for ns in namespaces if ns == namespace)
    if held >= caps.max_functions:
        raise QuartError(409, f"namespace {namespace!r} already has {held} functions, the limit "
                              "(QUART_GATEWAY_MAX_FUNCTIONS); remove one first", "service")
