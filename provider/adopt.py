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
    """Track the replicas ``host`` runs (starting or ready) for ``functions`` it knows nothing of yet, at
    each function's current generation; returns the adopted ids. Replicas of functions not restored are
    not adopted (the gateway stops them: they hold slots nobody routes to)."""
    adopted = []
    for status in running:
        fn = functions.get(status.function)
        if fn is None or status.state not in ("starting", "ready") or status.id in fn.replicas:
            continue
        fn.replicas[status.id] = Endpoint(status.id, status.function, host, status.url, status.state,
                                          status.source, fn.generation, now, layers=status.layers,
                                          held=status.held)
        adopted.append(status.id)
    for fn in functions.values():
        fn.refresh_ready()
    return adopted
