"""In-place CPU resizing (QUART §5.3's CPU compensation, carried out): a replica whose CPUs differ from its
function's is resized where it runs, not replaced.

A function's CPUs per replica (``FunctionView.cpus``, the CPU compensator's grant) change often — while a
stage's new replicas start, its ready ones carry it with more CPUs (`gateway_plugin.policies.cpu_bridge`) —
so a CPU-only change is no rolling update: each ready replica of the current generation whose ``cpus``
differ gets a ``resize`` to the function's (its host sets the replica's CPU affinity; the replica sizes its
torch threads to the cores it may use). A starting replica starts with the CPUs asked at its start and is
resized once ready. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class _Replica(Protocol):
    id: str
    state: str
    generation: int
    cpus: float


class _Function(Protocol):
    name: str
    generation: int
    cpus: float
    replicas: tuple


def resizes(functions: Iterable[_Function]) -> list[tuple[str, str, float]]:
    """(function, replica, cpus) for each ready replica of the current generation whose CPUs differ from its
    function's (functions with ``cpus`` 0 are not managed; replicas with ``cpus`` 0 report none)."""
    out = []
    for fn in functions:
        if fn.cpus <= 0:
            continue
        for rep in fn.replicas:
            if rep.state == "ready" and rep.generation == fn.generation and rep.cpus > 0 and rep.cpus != fn.cpus:
                out.append((fn.name, rep.id, fn.cpus))
    return out
