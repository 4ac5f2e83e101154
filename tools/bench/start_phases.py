"""Where a scale-up's time goes, per host: the gateway's side (the chain ordered, the start asked and answered,
the replica ready) and the KeysManager's (``ReplicaInfo.phases_ms``: the transfer open, the live zygote's first
layer, its module built, the fork, the first health answer, the file whole), on one time axis from the scale-up.

Used by ``quartctl bench blitzscale``: :class:`StartPhases` wraps the embedded gateway's host clients and two
reconciler hooks (a benchmark's instrument, not the product's), then :meth:`StartPhases.rows` reads the
KeysManagers' phases of the new replicas. Every time is ms after ``t0``; the KeysManager's phases are counted
from when its start request arrived, which is placed at the gateway's ``asked`` (the same clock: hosts are
network namespaces of one kernel, and the HTTP hop is a fraction of a millisecond)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from typing import Any


class StartPhases:
    """Gateway-side stamps of one scale-up (``t0``: when it was asked for)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.hosts: dict[str, dict[str, float]] = {}
        self.chain: dict[str, float] = {}
        self.ready: dict[str, float] = {}  # replica id → when the gateway counted it ready (whole)

    def _ms(self) -> float:
        return round(1000 * (time.monotonic() - self.t0), 1)

    def start(self) -> None:
        """The scale-up is asked for now: every stamp counts from here (earlier stamps are dropped)."""
        self.t0 = time.monotonic()
        self.hosts.clear()
        self.chain.clear()
        self.ready.clear()

    def wrap(self, reconciler: Any, hosts: Iterable[Any]) -> None:
        """Stamp each host's start (asked, answered), the chain multicast (begun, told) and ready replicas."""
        for host in hosts:
            host.start = self._timed_start(host.name, host.start)
        starter = reconciler.starter
        multicast, replica_ready = starter._multicast, starter.count_ready

        @functools.wraps(multicast)
        async def timed_multicast(fn, names):
            self.chain.setdefault("begun", self._ms())
            try:
                return await multicast(fn, names)
            finally:
                self.chain.setdefault("told", self._ms())

        @functools.wraps(replica_ready)
        def timed_ready(fn, endpoint) -> None:
            if endpoint.whole:
                self.ready.setdefault(endpoint.id, self._ms())
            replica_ready(fn, endpoint)

        starter._multicast, starter.count_ready = timed_multicast, timed_ready

    def _timed_start(self, name: str, start):
        @functools.wraps(start)
        async def timed(spec, order):
            stamps = self.hosts.setdefault(name, {})
            stamps.setdefault("asked", self._ms())
            try:
                return await start(spec, order)
            finally:
                stamps.setdefault("answered", self._ms())
        return timed

    async def rows(self, hosts: Iterable[Any], function: str, exclude: set[str]) -> list[dict[str, Any]]:
        """One row per new replica: host, the gateway's stamps, the KeysManager's phases, all ms after t0."""
        out = []
        for host in hosts:
            stamps = self.hosts.get(host.name)
            if stamps is None:
                continue
            fetched = await host.client.stage(function)  # how its file came: source, seconds
            for info in await host.client.replicas(memory=False):
                if info.function != function or info.id in exclude:
                    continue
                row: dict[str, Any] = {"host": host.name, **stamps}
                for phase, ms in sorted((info.phases_ms or {}).items(), key=lambda kv: kv[1]):
                    row[f"km_{phase}"] = round(stamps["asked"] + ms, 1)
                row["ready"] = self.ready.get(info.id)
                row["file_from"], row["file_s"] = fetched.get("source"), fetched.get("seconds")
                out.append(row)
        return out

    def summary(self) -> dict[str, Any]:
        return {"chain": dict(self.chain)}
