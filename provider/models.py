"""A model (a pipeline of stage functions) seen as one function, for an unmodified OpenFaaS gateway in front.

The OpenFaaS gateway, with its chart's default ``scale_from_zero=true``, asks the provider for a
function's status before it proxies ``/function/<name>``, scales it when no replica is available, and
waits until one is. A model is no deployed function, so without this it answers 404. With it:

- ``GET /system/function/<model>`` answers a ``FunctionStatus`` for the model (:func:`model_status`):
  ``availableReplicas`` is the fewest ready replicas of any stage (the pipeline can serve a request only
  when every stage can), ``replicas`` the fewest desired, ``invocationCount`` the first stage's (every
  request passes it once), labels ``com.quart.model`` / ``com.quart.stages``, the stage functions in the
  annotation ``com.quart.stage-functions``, and ``status`` / ``reason`` naming the stages that hold it
  back (:mod:`quart_kernel.capacity`).
- ``POST /system/scale-function/<model>`` (:func:`scale_model`): ``replicas: 0`` scales every stage to
  zero (the idler); ``n > 0`` raises every stage below ``n`` to ``n`` and leaves larger ones alone (the
  QUART policy's choice stands).
- ``/function/<model>`` then reaches the pipeline router as before (the invoke hook).

Models are not listed by ``GET /system/functions`` (faas-cli list shows what was deployed) and cannot be
removed as one (remove their stages).
"""

from __future__ import annotations

from typing import Any

from quart_kernel.capacity import NOT_READY_ANNOTATION, not_ready_reason
from quart_provider.gateway import EmbeddedGateway
from quart_stage import labels as vocab

PIPELINE_IMAGE = "quart/pipeline"
STAGE_FUNCTIONS_ANNOTATION = "com.quart.stage-functions"


def model_status(gateway: EmbeddedGateway, model: str) -> dict[str, Any] | None:
    """The model's ``FunctionStatus`` (with ``status`` / ``reason``), or None when ``model`` is not one."""
    names = gateway.registry.pipelines().get(model)
    if not names:
        return None
    stages = [gateway.functions[n] for n in names]
    available = min(len(fn.ready) for fn in stages)
    held = [(i, fn) for i, fn in enumerate(stages) if not fn.ready]
    reasons = [f"stage {i} ({fn.name}): {not_ready_reason(fn, gateway.functions.values(), gateway.hosts)}"
               for i, fn in held]
    annotations = {STAGE_FUNCTIONS_ANNOTATION: ",".join(names)}
    out: dict[str, Any] = {
        "name": model, "image": PIPELINE_IMAGE, "namespace": stages[0].deployment.namespace,
        "labels": {vocab.MODEL: model, vocab.STAGES: str(len(stages)),
                   vocab.SCALE_MIN: str(max(fn.deployment.min_replicas for fn in stages))},
        "annotations": annotations,
        "invocationCount": stages[0].invocations,
        "replicas": min(fn.desired for fn in stages),
        "availableReplicas": available,
        "createdAt": min(fn.created_at for fn in stages).isoformat().replace("+00:00", "Z"),
        "status": "Ready" if available else "Not Ready",
    }
    if reasons:
        out["reason"] = "; ".join(reasons)
        annotations[NOT_READY_ANNOTATION] = out["reason"]
    return out


async def scale_model(gateway: EmbeddedGateway, model: str, replicas: int) -> int | None:
    """Scale a model's stages (see the module); the replicas asked, or None when ``model`` is not one."""
    names = gateway.registry.pipelines().get(model)
    if not names:
        return None
    for name in names:
        fn = gateway.functions[name]
        await gateway.registry.scale(name, 0 if replicas == 0 else max(fn.desired, replicas))
    return replicas
