"""Starting and probing replicas (a part of :class:`quart_provider.reconciler.Reconciler`): ask a host for one
replica as its start plan says (peers, live, a ParaServe part), track it, probe it until it answers, and count
its ready time in the scheduler metrics once it serves its whole stage."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from quart_provider.paraserve_start import Group
from quart_provider.scheduling.starts import StartPlan
from quart_provider.scheduling.types import Placement
from quart_provider.types import Endpoint, FunctionState
from quart_stage.spans import H_LAYERS_HELD, parse_span

from keysmanager.registry import MODEL_URL_ENV

if TYPE_CHECKING:
    from quart_provider.config import GatewayConfig
    from quart_provider.hosts import Host
    from quart_provider.scheduling.metrics import SchedulerMetrics

log = logging.getLogger("quart.gateway")


class Starting:
    """Mixin of the reconciler: one replica's start, its readiness probe and its ready-time metric."""

    config: GatewayConfig
    hosts: Mapping[str, Host]
    functions: Mapping[str, FunctionState]
    scheduler_metrics: SchedulerMetrics
    _placed: dict[str, tuple[float, str, bool]]
    _probe_session: aiohttp.ClientSession | None

    async def _start_part(self, fn: FunctionState, host: str, generation: int, group: Group) -> None:
        """Start a ParaServe group's helper (no placement of its own: it leaves once the group is whole)."""
        before = set(fn.replicas)
        await self._start_replica(fn, host, generation, None, True, True, group.part_on(host))
        group.started([r for r, e in fn.replicas.items() if r not in before and e.host == host])

    async def _start_placed(self, fn: FunctionState, placement: Placement, generation: int, asked_at: float,
                            plan: StartPlan, peers: list[str], group: Group | None = None) -> None:
        """Start one placed replica as ``plan`` says and remember when it was asked for (its ready time is
        measured from then). ``group``: a ParaServe sub-pipeline; this replica starts with its part."""
        before = set(fn.replicas)
        # Any start that fetches the stage asks for a live start: the replica's process starts while the bytes
        # arrive (the KeysManager takes the ordinary path where it cannot). Only a "live" plan routes to it
        # before it holds the whole stage; a ParaServe part (``group``) starts with its layers and is routed at once.
        fetching = (plan.mode in ("peer", "multicast", "live", "cold") and fn.runnable.kind == "stage"
                    and MODEL_URL_ENV in fn.deployment.env_vars)  # a registry stage: bytes to fetch
        await self._start_replica(fn, placement.host, generation, peers, fetching, plan.mode == "live" or bool(group),
                                  group.part_on(placement.host) if group is not None else None)
        if group is not None:
            group.started([r for r, e in fn.replicas.items() if r not in before and e.host == placement.host])
        for rid, endpoint in list(fn.replicas.items()):
            if rid not in before and endpoint.host == placement.host and rid not in self._placed:
                self._placed[rid] = (asked_at, placement.source, placement.key)
                if endpoint.state == "ready" and endpoint.whole:
                    self._replica_ready(fn, endpoint)

    def _replica_ready(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """The replica-ready hook: count the scale-up (source, ready ms) in the scheduler metrics, once, when the
        replica serves its whole stage.

        A stage replica counts as a cache hit only if its host held the stage when it was placed *and* it was
        forked from a zygote that was already there (a KeysManagerHost reports a start that had to load the
        zygote as cold)."""
        if not endpoint.whole:
            return  # a live replica is ready when it holds every layer (the poll or the router's answers say)
        placed = self._placed.pop(endpoint.id, None)
        if placed is None:
            return
        asked_at, planned, key = placed
        source = "cold" if "cold" in (planned, endpoint.source) else endpoint.source
        endpoint.ready_ms = 1000 * (time.monotonic() - asked_at)
        self.scheduler_metrics.record_replica(fn.name, endpoint.host, source, endpoint.ready_ms, key=key)
        fn.start_time.note(time.monotonic() - asked_at)

    async def _start_replica(self, fn: FunctionState, host: str, generation: int, peers: list[str] | None = None,
                             live: bool = False, partial_ok: bool = True, layers: tuple[int, int] | None = None
                             ) -> None:
        try:
            extra: dict[str, Any] = {"peers": peers} if peers else {}
            if live:
                extra["live"] = True
            if layers is not None:  # a ParaServe part start (keysmanager.parts)
                extra["layers"] = layers
            statuses = await self.hosts[host].start(self._spec(fn), 1, **extra)
        except Exception as exc:
            fn.start_failures += 1
            backoff = min(30.0, 0.5 * 2 ** (fn.start_failures - 1))
            fn.retry_at = time.monotonic() + backoff
            fn.last_error = f"starting a replica on {host} failed: {exc}"
            log.warning("%s: %s (retry in %.1f s)", fn.name, fn.last_error, backoff)
            return
        finally:
            fn.pending_starts -= 1
        fn.start_failures, fn.last_error = 0, ""
        now = time.monotonic()
        for status in statuses:
            endpoint = Endpoint(status.id, fn.name, host, status.url, status.state if status.state != "dead"
                                else "starting", status.source, generation, now, layers=status.layers,
                                held=status.held, partial_ok=partial_ok)
            if self.functions.get(fn.name) is not fn:  # removed meanwhile
                self._spawn(self._stop_now(endpoint), f"stop:{endpoint.id}")
                continue
            fn.replicas[endpoint.id] = endpoint
            if endpoint.state == "starting":
                self._spawn(self._probe_until_ready(fn, endpoint), f"probe:{endpoint.id}")
        fn.refresh_ready()
        self.kick()

    # ---------------------------------------------------------------- probing

    def _prober(self) -> aiohttp.ClientSession:
        if self._probe_session is None or self._probe_session.closed:
            self._probe_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        return self._probe_session

    async def _probe_until_ready(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """GET the starting replica's health path (as its host does) and route to it as soon as it answers 200.

        Without this, a replica becomes routable only at the next reconcile poll of its host
        (``reconcile_interval_s``), which was most of a fork's ask→ready time. The interval starts at
        ``ready_probe_s`` and grows ×1.5 up to 0.1 s; a connection waits in the listen backlog until the
        replica serves, so one probe often spans the whole start. A replica started while its stage arrives
        answers with the layers it holds (``X-Quart-Layers-Held``); one that is not routed before it holds them
        all is probed on until it does.
        """
        url = endpoint.url + fn.runnable.health_path
        delay = self.config.ready_probe_s
        deadline = endpoint.started_at + self.config.start_timeout_s
        while fn.replicas.get(endpoint.id) is endpoint and (
                endpoint.state == "starting" or (endpoint.state == "ready" and not endpoint.whole)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return  # the reconcile loop replaces it
            try:
                async with self._prober().get(url, timeout=aiohttp.ClientTimeout(total=min(2.0, remaining))) as res:
                    if res.status == 200:
                        held = parse_span(res.headers.get(H_LAYERS_HELD))
                        if held is not None and endpoint.layers is not None:
                            endpoint.held = held
                        if fn.replicas.get(endpoint.id) is endpoint and endpoint.state in ("starting", "ready"):
                            endpoint.state, endpoint.probed = "ready", True
                            self._replica_ready(fn, endpoint)  # once, when it holds its whole stage
                            log.debug("%s ready %.1f ms after start (layers held %s)", endpoint.id,
                                      1000 * (time.monotonic() - endpoint.started_at), endpoint.held)
                            fn.refresh_ready()
                            self.kick()  # a rolling update may now retire old replicas
                        if endpoint.whole or endpoint.partial_ok:
                            return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(delay)
            delay = min(0.1, delay * 1.5)
