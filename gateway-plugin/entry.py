"""Who the pipeline router lets in (issue 14, item 3): the queue cap and admission by time, at entry.

:func:`stage_loads` reads the router's queues, replicas and measured service times (the p90 of each stage
function's :class:`quart_kernel.admission.ServiceTimes`, the estimator the proxy admits with too);
:func:`entry_admission` decides with the pure rules of :mod:`quart_kernel.admission`: a stage whose
queue is at ``queue_cap`` refuses (Retry-After: the time that queue needs to drain one place at its
measured rate), and so does a request whose expected wait over its pipeline (:func:`.shedding.admit_pipeline`:
the calls ahead of it at every stage) exceeds its deadline; a deadline shorter than the stages have ever taken
together (or ``min_deadline_ms``) is refused 400. :func:`queued_verdict`: whether a call at the head of a queue
can still meet its deadline (else shed, 429, before it takes a replica).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from quart_kernel.admission import Admission, StageLoad, retry_after_s
from quart_kernel.shedding import admit_pipeline, shed_queued


def stage_loads(router: Any, stages: Sequence[str]) -> list[StageLoad]:
    """Each stage's queue, serving slots (ready replicas × concurrency; unlimited: one per replica) and
    measured p90 service time."""
    loads = []
    for fn in stages:
        q = router.queues.get(fn)
        per_replica = router.source.concurrency(fn) or 1
        service = router.service_times(fn)
        loads.append(StageLoad(len(q.jobs) if q else 0, len(router.source.ready(fn)) * per_replica,
                               service.p90(), service.fastest()))
    return loads


def entry_admission(router: Any, model: str, stages: Sequence[str], deadline_s: float) -> Admission:
    """Admit a request for ``model`` now, or a 429 decision with its reason and Retry-After."""
    loads = stage_loads(router, stages)
    cap, fallback = router.config.queue_cap, router.config.retry_after_s
    for fn, load in zip(stages, loads, strict=True):
        if load.queued >= cap:
            drain_s = (load.queued - cap + 1) * load.service_s / load.servers if load.servers else float("nan")
            return Admission(False, 0.0, retry_after_s(drain_s, fallback),
                             f"stage {fn!r} already has {load.queued} requests waiting (cap {cap}); retry later")
    in_service = [q.busy if (q := router.queues.get(fn)) is not None else 0 for fn in stages]
    return admit_pipeline(loads, in_service, deadline_s, f"a request to {model!r}",
                          safety=router.config.admission_safety,
                          floor_s=router.config.min_deadline_ms / 1000.0)


def queued_verdict(router: Any, job: Any) -> Admission:
    """Keep the call at the head of its stage's queue, or shed it (429) when what is left of its deadline no
    longer covers the rest of its pipeline (:func:`quart_kernel.shedding.shed_queued`)."""
    rest = job.stages[job.stage:]
    loads = stage_loads(router, rest)
    loads[0] = replace(loads[0], queued=0)  # at the head: no wait at its own stage
    return shed_queued(loads, job.deadline - router.clock(), f"request {job.id}", router.config.admission_safety)
