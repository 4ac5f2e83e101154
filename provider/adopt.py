"""A gateway restart that keeps its hosts (`quartctl up --keep-hosts`, issue 14): adopt, do not restart.

Functions outlive a restart of the gateway as pods outlive a restart of OpenFaaS's gateway: with
``keep_hosts`` the KeysManagers are started without a parent-death signal and are left running (with
their replicas) when the gateway stops; the next `quartctl up` on the same state folder finds each
one by its pidfile (``<socket>.d/km.pid``), talks to it again instead of starting a successor, and
adopts the replicas it reports for the functions restored from the store (:func:`adopt_replicas`).
A restart then costs the gateway's own start (about 1.5 s), not a cold start of every replica.
`quartctl down` stops the kept KeysManagers (it reads their pids from ``up.json``, left in place).

What is adopted is what the host runs for a function of that name; a gateway stopped in the middle of
a rolling update may leave replicas of the old spec, which then count as current (the store holds the
new spec only): stop with `quartctl down` before changing a function's image if that matters.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil
from quart_provider.hosts import ReplicaStatus
from quart_provider.types import Endpoint, FunctionState


class AdoptedProcess:
    """A ``Popen``-like handle on a KeysManager that is not our child (the supervisor polls it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                proc = psutil.Process(self.pid)
                gone = proc.status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                gone = True
            if gone:
                self.returncode = -1  # not ours: its exit code is not ours to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return self.returncode


def live_keysmanager(socket: Path) -> int | None:
    """The pid of the KeysManager still serving ``socket`` (its pidfile names a live keysmanager process
    and the socket exists), else None."""
    try:
        pid = int((socket.with_name(socket.name + ".d") / "km.pid").read_text().split()[0])
        cmdline = " ".join(psutil.Process(pid).cmdline())
    except (OSError, ValueError, IndexError, psutil.Error):
        return None
    return pid if socket.exists() and "keysmanager" in cmdline else None


def adopt_replicas(functions: Mapping[str, FunctionState], host: str, running: Iterable[ReplicaStatus],
                   now: float) -> list[str]:
    """Track replicas ``host`` runs (ready ones first, then starting) that the gateway does not, at their
    function's current generation, up to what each function lacks of ready replicas; returns the adopted
    ids. The rest (of no function, or beyond what is lacking: replaced meanwhile) the caller stops."""
    adopted = []
    lacking = {name: fn.desired - sum(1 for e in fn.replicas.values() if e.state == "ready"
                                      and e.generation == fn.generation) for name, fn in functions.items()}
    for status in sorted(running, key=lambda r: r.state != "ready"):
        fn = functions.get(status.function)
        if fn is None or status.state not in ("starting", "ready") or status.id in fn.replicas \
                or lacking[fn.name] <= 0:
            continue
        fn.replicas[status.id] = Endpoint(status.id, status.function, host, status.url, status.state,
                                          status.source, fn.generation, now, layers=status.layers,
                                          held=status.held)
        lacking[fn.name] -= 1
        adopted.append(status.id)
    for fn in functions.values():
        fn.refresh_ready()
    return adopted
