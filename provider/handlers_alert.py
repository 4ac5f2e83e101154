"""``POST /system/alert``: AlertManager's webhook scales functions, as the OpenFaaS gateway's alert handler does.

Body: a ``PrometheusAlert`` (``{"status", "receiver", "alerts": [{"status", "labels": {"alertname",
"function_name"}}]}``). For each alert naming a deployed function (``function_name`` is ``name`` or
``name.namespace``): ``firing`` adds a step of ``ceil(max / 100 * factor)`` replicas, at most ``max``
(``com.openfaas.scale.max``, itself at most 20), where ``factor`` is ``com.openfaas.scale.factor`` (20 %
by default); ``resolved`` (anything else) goes back to ``com.openfaas.scale.min``. Alerts for names
that are not functions here are skipped, as OpenFaaS skips them, and so are QUART stage functions
(labelled ``com.quart.model``): the QUART controller scales them. 200 when done; a body that is not
that shape is a 400 naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web
from quart_provider.bodies import read_body
from quart_provider.deployment import parse_json_object
from quart_provider.gateway import EmbeddedGateway
from quart_stage import labels as vocab
from quart_stage.errors import QuartError, invalid
from quart_transport import namespaces

SCALE_FACTOR = "com.openfaas.scale.factor"
DEFAULT_SCALE_FACTOR = 20  # percent of max replicas per firing alert (OpenFaaS's default)
MAX_REPLICAS_CAP = 20  # OpenFaaS's scaling.DefaultMaxReplicas: the alert handler never goes above it


def next_replicas(status: str, current: int, max_replicas: int, min_replicas: int, factor: int) -> int:
    """The replica count an alert asks for (OpenFaaS's ``CalculateReplicas``)."""
    top = min(max_replicas, MAX_REPLICAS_CAP)
    step = math.ceil(top / 100 * factor)
    if status == "firing" and step > 0:
        return min(current + step, top)
    return min_replicas


def _alerts(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(status, function_name) of every alert; a 400 naming the field when the shape is wrong."""
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise invalid("alerts", "alerts must be a list of alerts")
    out = []
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict) or not isinstance(alert.get("status"), str):
            raise invalid(f"alerts[{i}].status", "each alert needs a status (firing or resolved)")
        labels = alert.get("labels")
        if not isinstance(labels, dict) or not isinstance(labels.get("function_name"), str):
            raise invalid(f"alerts[{i}].labels.function_name", "each alert needs labels.function_name")
        out.append((alert["status"], labels["function_name"]))
    return out


class AlertHandler:
    """The alert webhook over one gateway."""

    def __init__(self, gateway: EmbeddedGateway) -> None:
        self.gateway = gateway

    async def alert(self, request: web.Request) -> web.Response:
        body = parse_json_object(await read_body(request, self.gateway.config.max_deploy_bytes))
        scaled = {}
        for status, function_name in _alerts(body):
            try:
                name = namespaces.function_name(function_name, self.gateway.config.namespace)
            except QuartError:
                continue  # another namespace: no function of ours
            fn = self.gateway.functions.get(name)
            labels = fn.deployment.labels if fn is not None else {}
            if fn is None or vocab.MODEL in labels:  # a QUART stage: the QUART controller is its autoscaler
                continue
            factor = vocab.label_int(labels, SCALE_FACTOR, DEFAULT_SCALE_FACTOR)
            target = next_replicas(status, fn.desired, fn.deployment.max_replicas, fn.deployment.min_replicas,
                                   factor)
            if target != fn.desired:
                scaled[name] = await self.gateway.registry.scale(name, target)
        return web.json_response({"scaled": scaled})
