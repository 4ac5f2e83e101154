"""Why a function cannot run, said where it is asked: at deploy (a 4xx), in its status, in a 503.

Pure rules over the hosts' replica slots and a function's state (issue 18 item 4: never a silent
Not Ready):

- :func:`deploy_refusal`: a deploy that can never run is refused with 400 (a stage function where no
  host runs stages; more minimum replicas than all hosts have slots). One that cannot run *now*, the
  slots being taken by other functions, is accepted (others may scale down) and says so in its status;
- :func:`not_ready_reason`: the sentence a function's status carries while it has fewer ready replicas
  than desired (``"reason"`` beside ``"status": "Not Ready"`` in ``/system/function/{name}``), and the
  tail of the 503 an invocation gets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized
from typing import Any, Protocol


class Annotated(Protocol):
    annotations: dict[str, str]


class FunctionState(Protocol):
    """What these rules read of a function (the embedded gateway's ``quart_provider.types.FunctionState``)."""

    name: str
    desired: int
    unplaced: int
    last_error: str
    last_decision: str

    @property
    def ready(self) -> Sized: ...

    @property
    def replicas(self) -> Sized: ...

    @property
    def deployment(self) -> Annotated: ...


class SlotHost(Protocol):
    name: str


def _slots(hosts: Mapping[str, SlotHost]) -> int | None:
    """Replica slots of all hosts; None when a host does not say (its ``gpu_slots``)."""
    counts = [getattr(h, "gpu_slots", None) for h in hosts.values()]
    return None if None in counts else sum(counts)  # type: ignore[arg-type]


ALL_KINDS = frozenset({"process", "stage"})
NOT_READY_ANNOTATION = "com.quart.not-ready"
LAST_DECISION_ANNOTATION = "com.quart.last-decision"  # the autoscaler's last scaling of the function, and why


def host_kinds(host: object) -> frozenset[str]:
    """What a host runs (its ``kinds``; a KeysManager host runs stages and processes)."""
    return getattr(host, "kinds", ALL_KINDS)


def deploy_refusal(kind: str, min_replicas: int, hosts: Mapping[str, SlotHost]) -> tuple[str, str] | None:
    """(field, sentence) when a function of ``kind`` wanting ``min_replicas`` can never run here; None if it can."""
    runnable_kinds: set[str] = set()
    for host in hosts.values():
        runnable_kinds |= host_kinds(host)
    if kind not in runnable_kinds:
        return ("image", f"no host here runs {kind!r} functions (the hosts run without KeysManagers: "
                         "`quartctl up` without --process-hosts starts them)")
    slots = _slots(hosts)
    if slots is not None and min_replicas > slots:
        return ("labels.com.openfaas.scale.min", f"com.openfaas.scale.min={min_replicas} replicas can never run: all "
                f"{len(hosts)} host(s) have {slots} replica slot(s) in all (start with more --hosts or "
                "--gpus-per-host)")
    return None


def not_ready_reason(fn: FunctionState, functions: Iterable[FunctionState], hosts: Mapping[str, SlotHost]
                     ) -> str:
    """Why ``fn`` has fewer ready replicas than desired, in one sentence ("" when it has them all)."""
    ready, desired = len(fn.ready), fn.desired
    if desired == 0 and not ready:
        return "scaled to zero: the first invocation starts a replica"
    if ready >= desired:
        return ""
    if fn.last_error:
        return fn.last_error
    if fn.unplaced:
        slots = _slots(hosts)
        users = sorted(f"{f.name} ({len(f.replicas)})" for f in functions if f is not fn and f.replicas)
        return (f"{fn.unplaced} replica(s) wait for a free replica slot: the {slots if slots is not None else 'replica'} "
                f"slot(s) of {len(hosts)} host(s) "
                f"are taken{' by ' + ', '.join(users) if users else ''}; remove or scale down a function, or start "
                "with more --hosts / --gpus-per-host")
    return f"starting: {ready} of {desired} replica(s) ready"


def status_fields(fn: FunctionState, functions: Iterable[FunctionState], hosts: Mapping[str, SlotHost]
                  ) -> dict[str, Any]:
    """``status`` (Ready / Not Ready, as faas-cli describe words it) and, when not ready, ``reason``, also as
    the annotation ``com.quart.not-ready`` (faas-cli describe prints annotations, not unknown fields); the
    autoscaler's last change, ``lastDecision``, also as the annotation ``com.quart.last-decision``."""
    reason = not_ready_reason(fn, functions, hosts)
    out: dict[str, Any] = {"status": "Ready" if fn.ready else "Not Ready"}
    annotations = dict(fn.deployment.annotations)
    if reason:
        out["reason"] = annotations[NOT_READY_ANNOTATION] = reason
    if fn.last_decision:
        out["lastDecision"] = annotations[LAST_DECISION_ANNOTATION] = fn.last_decision
    if annotations != fn.deployment.annotations:
        out["annotations"] = annotations
    return out
