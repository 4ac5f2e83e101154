"""Deadlines that hold under overload (issue 31, item 2): admit what a pipeline can finish, shed what it cannot.

At 8× overload with ``X-Quart-Timeout-Ms: 2000``, 79 % of the admitted pipeline calls were answered 504: entry
admission counted only each stage's own queue, while every call waiting at an earlier stage will reach the
later ones first, and nothing looked at a queued call again until its deadline had passed.

- :func:`pipeline_wait_s`: a call entering now waits behind every call ahead of it at each stage ``k``:
  those queued at stages ``0 … k`` and those being served at stages ``0 … k-1``; stage ``k`` drains them at
  ``servers / service_s``. The pipeline's wait is that of its slowest stage (stages overlap), not their sum.
- :func:`admit_pipeline`: admit when ``safety`` × (that wait + every stage's service) fits the deadline; else
  429 + Retry-After (how long the excess takes to drain); a deadline below what the stages ever took: 400.
- :func:`shed_queued`: a call at the head of a stage's queue, before it takes a replica: when what is left
  of its deadline no longer covers ``safety`` × the rest of its pipeline (the stages from here, their queues),
  429 + Retry-After now, not a 504 at its deadline after it held a replica.

- :func:`replica_wait_s`: how long a proxied function call (``/function/<name>``) may wait for a free
  replica and still be served within its deadline; past it the proxy sheds it (429) instead of a 504 later.

Pure (loads and times are passed in): the pipeline router's entry and its dispatchers, and the proxy, call them.
"""

from __future__ import annotations

from collections.abc import Sequence

from quart_kernel.admission import Admission, StageLoad, admit_by_time, retry_after_s

SHED_HEADER = "X-Quart-Shed"  # on a 429 for a call admitted, then shed from its queue


def pipeline_wait_s(stages: Sequence[StageLoad], in_service: Sequence[int]) -> float:
    """Expected wait of a call entering stage 0 now (0 when nothing was measured or nobody serves)."""
    ahead = wait = 0.0
    for k, load in enumerate(stages):
        ahead += load.queued + (in_service[k - 1] if k else 0)
        if load.service_s > 0 and load.servers > 0:
            wait = max(wait, ahead * load.service_s / load.servers)
    return wait


def admit_pipeline(stages: Sequence[StageLoad], in_service: Sequence[int], deadline_s: float, what: str,
                   safety: float = 1.0, floor_s: float = 0.0) -> Admission:
    """Admission of a new call at the pipeline's entry (see the module docstring)."""
    quick = admit_by_time(stages, deadline_s, what, safety=safety, floor_s=floor_s)
    if deadline_s <= 0 or (not quick.admit and quick.status != 429):
        return quick  # no deadline, or one no load could meet (400)
    total = safety * (pipeline_wait_s(stages, in_service) + sum(s.service_s for s in stages if s.service_s > 0))
    if total <= deadline_s:
        return Admission(True, total)
    return Admission(False, total, retry_after_s(total - deadline_s),
                     f"{what} would take about {total:.2f} s, over its deadline of {deadline_s:.2f} s; retry later")


def shed_queued(rest: Sequence[StageLoad], remaining_s: float, what: str, safety: float = 1.0) -> Admission:
    """Keep (admit) a queued call whose ``remaining_s`` still covers ``rest`` (this stage, unqueued, and
    the stages after it with their queues), else a 429 decision with Retry-After."""
    need = safety * (sum(s.service_s for s in rest if s.service_s > 0)
                     + sum(s.queued * s.service_s / s.servers for s in rest[1:] if s.servers and s.service_s > 0))
    if need <= remaining_s:
        return Admission(True, need)
    return Admission(False, need, retry_after_s(need - max(0.0, remaining_s)),
                     f"{what} can no longer meet its deadline ({max(0.0, remaining_s):.2f} s left, about "
                     f"{need:.2f} s needed): shed before a replica took it; retry later")


def replica_wait_s(remaining_s: float, service_s: float, safety: float = 1.0) -> float:
    """The longest a call with ``remaining_s`` of its deadline left may wait for a replica: what remains once
    ``safety`` × its measured ``service_s`` is set aside (never below 0)."""
    return max(0.0, remaining_s - safety * max(0.0, service_s))
