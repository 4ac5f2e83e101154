"""Scale to zero and from zero for a pipeline, as OpenFaaS does for a function.

A stage whose desired count is 0 (its ``com.openfaas.scale.min`` is 0 and the policy took it there, or an
operator or the idler scaled it there) stays at 0 while no request is in its pipeline: only a call brings it
back (the router's ``scale_from_zero``, like the OpenFaaS gateway's). While a request is anywhere in the
pipeline, no stage is taken to 0 (the request would wait for a replica that nothing starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway_plugin.snapshot import Decision, PipelineSnapshot


def held_at_zero(snap: PipelineSnapshot, decision: Decision, desired_now: Sequence[int]) -> Decision:
    """``decision`` with stages at zero kept there while the pipeline is idle, and none sent to zero while busy."""
    busy = any(stage.in_flight for stage in snap.stages)
    stages = []
    for stage, want, now in zip(snap.stages, decision.stages, desired_now, strict=True):
        if busy and want.replicas == 0 and stage.max_replicas > 0:
            want = replace(want, replicas=max(1, stage.min_replicas), reason="requests in the pipeline")
        elif not busy and now == 0 and want.replicas > 0:
            want = replace(want, replicas=0, reason="at zero until a call")
        stages.append(want)
    return replace(decision, stages=tuple(stages))
