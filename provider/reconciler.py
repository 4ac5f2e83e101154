"""Reconciliation: make the replicas that run match the registry's desired state.

A loop (every ``reconcile_interval_s``, or at once on :meth:`Reconciler.kick`) polls every host (each
poll bounded by ``host_timeout_s``; a host that missed ``host_down_polls`` polls in a row and is silent for
``host_down_after_s`` is down: its replicas are dropped as dead and replaced elsewhere, and whatever still
runs there is adopted back or stopped when it answers again), stops what an answering host runs that no
function tracks (a start abandoned while its host was down, a failed stop: a host's slots then hold only what
the gateway tracks; docs/hosts.md, "A host that flaps"), drops dead replicas, replaces ones that never became
ready, and converges: it builds the platform's view
(:class:`quart_kernel.convergence.PlatformView`: functions, replicas, pending starts, back-off, ParaServe
groups, and the hosts' reports when something is missing; a pure read), asks the one pure convergence
(:func:`quart_kernel.convergence.converge`, the simulator's too) for the actions, and carries them out:
replicas that leave are drained and stopped here, starts go to the :class:`quart_provider.starting.Starter`
(pins, chain multicasts, host starts, readiness probes, ready-time metrics). Every task it runs is an entry of
its in-flight table (:class:`quart_provider.inflight.InFlight`: kind, host, function, replica, since), the one
record of starts under way. A drain is woken by a release of one of the replica's requests or a generation
session freed (:meth:`Reconciler.sessions_freed`), not by polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace

from quart_kernel.convergence import (
    Action,
    Convergence,
    FunctionView,
    PlatformView,
    ReplicaView,
    converge,
    leaving,
    requests,
    resizing,
)
from quart_kernel.scheduling.paraserve_gen import GroupDemand
from quart_kernel.scheduling.types import HostView, Placer
from quart_provider.adopt import adopt_replicas
from quart_provider.config import GatewayConfig
from quart_provider.host_health import HostHealth
from quart_provider.hosts import Host, ReplicaSpec, ReplicaStatus, poll_replicas, replica_cpus
from quart_provider.inflight import InFlight
from quart_provider.paraserve_start import ParaServeStarts
from quart_provider.scheduler_metrics import SchedulerMetrics
from quart_provider.starting import Starter
from quart_provider.types import Endpoint, FunctionState

from keysmanager.aio import wait_event, within

log = logging.getLogger("quart.gateway")
DRAIN_LOOK_S = 0.25  # a draining replica is looked at again after this long without an event (a session unannounced)


class Reconciler:
    """Drives ``hosts`` towards ``functions`` (the registry's live mapping): observes, decides, lets replicas go;
    the starter starts. All methods run on one loop."""

    def __init__(self, config: GatewayConfig, hosts: Mapping[str, Host], placer: Placer,
                 functions: Mapping[str, FunctionState], key_history: Mapping[str, int],
                 scheduler_metrics: SchedulerMetrics, set_desired: Callable[[str, int], int]) -> None:
        self.config = config
        self.hosts = hosts
        self.placer = placer
        self.functions = functions
        self.key_history = key_history
        self.kv_tokens: Callable[[str], int] = _no_sessions  # replica id -> KV positions its sessions hold
        self.demand: Callable[[str], GroupDemand] = _no_demand  # function -> its sessions (the sliding window)
        self.set_desired = set_desired  # the registry's: the one writer of desired (a whole group's count too)
        self.scheduler_metrics = scheduler_metrics
        self._param_bytes: dict[str, tuple[int, int]] = {}  # function → (generation, stage parameter bytes)
        self._kick = asyncio.Event()
        self._closing = False
        self._loop_task: asyncio.Task | None = None
        self.work = InFlight()  # every task it runs: starts, stops, probes, resizes
        self._drains: dict[str, asyncio.Event] = {}  # replica id → set when a session on it is freed
        self.health = HostHealth(config.host_down_after_s, config.host_down_polls)
        self.paraserve = ParaServeStarts(config)  # cold stages in parts (issue 17; off unless config.paraserve)
        self.starter = Starter(config, hosts, functions, scheduler_metrics, self.paraserve, self.work, self.kick,
                               self._stop_now)
        self.last_convergence: Convergence | None = None  # the latest pass's actions (tests compare them)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._reconcile_forever(), name="gateway-reconcile")

    async def close(self) -> None:
        """Stop the loop, every replica started here, and the hosts."""
        self._closing = True
        self.kick()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        await self.work.close()
        stops = [self._stop_now(e) for f in self.functions.values() for e in list(f.replicas.values())]
        await asyncio.gather(*stops, return_exceptions=True)
        await asyncio.gather(*(h.close() for h in self.hosts.values()), return_exceptions=True)
        await self.starter.close()

    def kick(self) -> None:
        """Reconcile now rather than at the next tick."""
        self._kick.set()

    def pending_starts(self, function: str) -> int:
        """``function``'s starts asked of a host and not answered yet (the in-flight table)."""
        return self.work.starts_of(function)

    def sessions_freed(self, replica_id: str | None = None) -> None:
        """Generation sessions were freed (on ``replica_id``, or anywhere): a drain waiting for them looks again."""
        for rid, event in self._drains.items():
            if replica_id is None or rid == replica_id:
                event.set()

    # ---------------------------------------------------------------- one pass

    async def _reconcile_forever(self) -> None:
        while not self._closing:  # close() also cancels; the flag stops the loop if a cancel is ever lost
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a host down must not stop the loop
                log.warning("reconcile failed: %s", exc)
            await wait_event(self._kick, self.config.reconcile_interval_s)
            self._kick.clear()

    async def reconcile(self) -> None:
        """One pass: poll hosts, drop dead replicas, start missing ones, stop surplus, roll updates."""
        polled_at = time.monotonic()
        results = await poll_replicas(self.hosts, self.config.host_timeout_s)
        seen: dict[str, ReplicaStatus] = {}
        polled_hosts: set[str] = set()
        now = time.monotonic()
        for name, result in results.items():
            if isinstance(result, BaseException):
                if self.health.failed(name, now):
                    self._host_down(name, result)
                elif self.health.is_up(name):
                    log.warning("host %s did not answer: %s", name, result or type(result).__name__)
                continue
            if self.health.answered(name, now):
                self._host_back(name, result)
            elif self._quiet(name, polled_at):
                self._claim(name, result, adopt=False)
            polled_hosts.add(name)
            seen.update((r.id, r) for r in result)
        for fn in self.functions.values():
            changed = False
            for endpoint in list(fn.replicas.values()):
                status = seen.get(endpoint.id)
                if status is None or status.state == "dead":
                    # a replica whose start finished while the hosts were being polled is not in their answers
                    if endpoint.host in polled_hosts and endpoint.started_at < polled_at:
                        del fn.replicas[endpoint.id]
                        changed = True
                    continue
                if (status.layers, status.held) != (endpoint.layers, endpoint.held) and status.layers is not None:
                    was_whole = endpoint.whole
                    endpoint.layers, endpoint.held = status.layers, status.held
                    changed = changed or endpoint.whole != was_whole
                    if endpoint.whole and not was_whole and endpoint.state == "ready":
                        self.starter.count_ready(fn, endpoint)
                if endpoint.state in ("starting", "ready") and status.state != endpoint.state:
                    if endpoint.probed and endpoint.state == "ready" and status.state == "starting":
                        continue  # our probe got the health answer first; the host's report lags behind
                    if status.state == "ready":
                        self.starter.ready(fn, endpoint, "its host's report")
                    else:
                        endpoint.state = status.state
                    changed = True
                if (endpoint.state == "starting" or not endpoint.whole) and now - endpoint.started_at > \
                        self.config.start_timeout_s:  # a live replica whose transfer stalls is replaced too
                    log.warning("replica %s of %s not ready after %.0f s: replacing it", endpoint.id, fn.name,
                                self.config.start_timeout_s)
                    self.retire(fn, endpoint)
                    changed = True
            if changed:
                fn.refresh_ready()
        await self._converge(now)

    def _host_down(self, name: str, why: BaseException) -> None:
        """``name`` stopped answering: its replicas are dead to routing (requests in flight on them fail over
        by the dead-peer sockets, see ``quart_transport.dead_peer``), starts and stops on it are abandoned,
        and the next pass places the missing replicas on the hosts that answer."""
        lost: set[str] = set()
        for fn in self.functions.values():
            gone = [e for e in fn.replicas.values() if e.host == name]
            for endpoint in gone:
                endpoint.state = "dead"
                del fn.replicas[endpoint.id]
                lost.add(endpoint.id)
            if gone:
                fn.refresh_ready()
        self.work.abandon(name, lost)
        log.warning("host %s has not answered for %.1f s (%s): down; %d replica(s) marked dead", name,
                    self.health.silent_for(name, time.monotonic()), why or type(why).__name__, len(lost))
        self.kick()

    def host_lost(self, name: str, why: BaseException) -> None:
        """The host's agent is known gone (its process exited): down now, without waiting ``host_down_after_s``
        of silence; it is back when it answers a poll again (the supervisor restarts it)."""
        if name in self.hosts and self.health.is_up(name):
            self.health.down.add(name)
            self._host_down(name, why)

    def _host_back(self, name: str, running: list[ReplicaStatus]) -> None:
        """``name`` answers again: what still runs there is adopted back as far as its function lacks ready
        replicas (a KeysManager's successor adopts the replicas that survived it; replacements still starting
        are surplus then); the rest was replaced while it was down, or runs for no function: stopped."""
        adopted, stopped = self._claim(name, running, adopt=True)
        log.warning("host %s answers again; %d replica(s) adopted back, %d stopped", name, adopted, stopped)
        self.kick()

    def _quiet(self, name: str, polled_at: float) -> bool:
        """No start on ``name`` was under way or ended since ``polled_at``: every replica its poll lists that
        the gateway does not track is an orphan (a start abandoned when the host was down, which the host
        finished later; a stop that failed), not a start whose answer is still on its way."""
        return not self.work.start_settled_since(name, polled_at) and not self.work.starts_on(name)

    def _claim(self, name: str, running: list[ReplicaStatus], adopt: bool) -> tuple[int, int]:
        """Make ``name``'s live replicas the gateway's or stop them, so that its slots hold only what the
        gateway tracks: ``adopt`` (the host is back) as far as each function lacks ready replicas; the rest
        (or all, without ``adopt``) are stopped unless a stop is already under way. Returns (adopted, stopped)."""
        adopted = set(adopt_replicas(self.functions, name, running, time.monotonic())) if adopt else set()
        tracked = {rid for fn in self.functions.values() for rid in fn.replicas}
        stale = [r for r in running if r.id not in tracked and r.state in ("starting", "ready")
                 and not self.work.stopping(r.id)]
        for status in stale:
            if not adopt:
                log.warning("host %s runs replica %s of %s that no function tracks (a start abandoned while the "
                            "host was down, or a stop that failed): stopping it", name, status.id, status.function)
            self.work.run(self._stop_now(Endpoint(status.id, status.function, name, status.url, status.state,
                                                  status.source, 0, 0.0)), "stop", name, status.function, status.id)
        return len(adopted), len(stale)

    def view(self, now: float, hosts: tuple[HostView, ...] = ()) -> PlatformView:
        """The platform as convergence reads it (``hosts``: the placer's view, fetched only when needed); a pure
        read of the functions, their replicas and the in-flight table."""
        protected = {name: frozenset(self.paraserve.protected(fn)) for name, fn in self.functions.items()}
        functions = tuple(FunctionView(
            fn.name, fn.desired, fn.generation,
            tuple(ReplicaView(e.id, e.state, e.generation, e.in_flight, e.started_at, self.kv_tokens(e.id), e.cpus)
                  for e in fn.replicas.values()),
            self.work.starts_of(fn.name), fn.retry_at, protected[fn.name], self._stage_param_bytes(fn),
            fn.name in self.key_history, len(fn.ready), replica_cpus(self._spec(fn))) for fn in self.functions.values())
        mechanisms = {"peer", "multicast"} if self.config.peer_fetch else set()
        live = self.config.live_scaling
        if live or (live is None and self.config.network == "netns"):  # default: on where hosts have addresses
            mechanisms.add("live")
        if self.config.paraserve:
            mechanisms.add("paraserve")
        return PlatformView(now, functions, hosts, dict(self.key_history), frozenset(mechanisms))

    def keep_groups(self, now: float) -> None:
        """The sliding-window rule for each ParaServe group that became whole: its function's desired count
        through the registry (saved, clamped to its bounds, like every other desired) when it must keep more
        workers than desired. Before the view is read."""
        for fn in list(self.functions.values()):
            if not self.paraserve.whole.get(fn.name):
                continue
            desired = self.paraserve.desired_after(fn, self.demand(fn.name), now)
            if desired is not None and desired > fn.desired:
                self.set_desired(fn.name, desired)

    async def _converge(self, now: float) -> None:
        """One convergence of the view (:func:`quart_kernel.convergence.converge`): what leaves is let go at
        once (a slow host report must not hold up a drain); the hosts are asked only when something is
        missing, and the starts go to the starter."""
        self.keep_groups(now)
        view = self.view(now)
        leave = leaving(view)
        self._let_go(leave)
        self._resize(resizing(view, leave))
        self.starter.forget_gone()
        layouts: dict = {}
        parts: dict[str, int] = {}
        wanted = requests(view)
        if wanted:
            hosts = await self._host_views()
            view = replace(view, hosts=tuple(hosts))
            if self.config.paraserve:
                layouts = await self.paraserve.cold_layouts([r.function for r in wanted], hosts, self.functions,
                                                            self._spec)
                parts = self.paraserve.parts_for(hosts, layouts)
        plan = converge(view, self.placer, lambda function, _hosts: parts.get(function, 1))
        self.last_convergence = plan  # its stops, drains and retirements are the ones let go above
        unplaced = Counter[str]()
        for req in plan.schedule.unplaced if plan.schedule is not None else ():
            unplaced[req.function] += req.count
        for fn in self.functions.values():  # this pass's answer: none once nothing is missing
            fn.unplaced = unplaced[fn.name]
        if plan.schedule is not None:
            await self.starter.start_all(plan, view.hosts, layouts)

    def _let_go(self, actions: list[Action]) -> None:
        """Carry out stop / drain / retire: drain, then stop (a replica already draining is left as it is)."""
        for action in actions:
            fn = self.functions.get(action.function)
            endpoint = fn.replicas.get(action.replica) if fn is not None else None
            if endpoint is not None:
                self.retire(fn, endpoint)

    def _resize(self, actions: list[Action]) -> None:
        """Carry out ``resize``: the replica's host changes its CPUs in place (its book entry at once, so the next
        pass does not ask again; back to what it was if the host refuses)."""
        for action in actions:
            fn = self.functions.get(action.function)
            endpoint = fn.replicas.get(action.replica) if fn is not None else None
            if endpoint is not None and endpoint.host in self.hosts:
                self.work.run(self._resize_one(endpoint, endpoint.cpus, action.cpus), "resize", endpoint.host,
                              endpoint.function, endpoint.id)
                endpoint.cpus = action.cpus

    async def _resize_one(self, endpoint: Endpoint, before: float, cpus: float) -> None:
        try:
            await within(self.config.host_timeout_s, self.hosts[endpoint.host].resize(endpoint.id, cpus))
        except Exception as exc:  # the host is down or the replica gone: the next pass sees it
            log.warning("resizing %s to %g CPUs failed: %s", endpoint.id, cpus, exc)
            if endpoint.cpus == cpus:
                endpoint.cpus = before

    async def _host_views(self) -> list[HostView]:
        """Each answering host's report, with the slots its starts under way will take."""
        names = [n for n in self.hosts if self.health.is_up(n)]
        reports = await asyncio.gather(*(within(self.config.host_timeout_s, self.hosts[n].report()) for n in names),
                                       return_exceptions=True)
        views: list[HostView] = []
        for name, report in zip(names, reports, strict=True):
            if isinstance(report, BaseException):
                log.warning("host %s gave no report: %s", name, report)
                continue
            pending = self.work.starts_on(name)
            views.append(replace(report, gpu_used=min(report.gpu_slots, report.gpu_used + pending)))
        self.scheduler_metrics.record_hosts(views)
        return views

    def _stage_param_bytes(self, fn: FunctionState) -> int:
        """The stage's parameter bytes (its checkpoint in the manifest), what a host caches; 0 for a process."""
        known = self._param_bytes.get(fn.name)
        if known is not None and known[0] == fn.generation:
            return known[1]
        size = 0
        if fn.runnable.kind == "stage":
            from keysmanager.stage import UnknownStage, resolve_stage

            try:
                size = resolve_stage(fn.name, self._spec(fn).env).param_bytes
            except (UnknownStage, ValueError, OSError) as exc:
                log.warning("%s: parameter size unknown (%s); placing it as parameter-free", fn.name, exc)
        self._param_bytes[fn.name] = (fn.generation, size)
        return size

    def _spec(self, fn: FunctionState) -> ReplicaSpec:
        return fn.replica_spec(self.config.max_body_bytes)

    # ---------------------------------------------------------------- draining

    def retire(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """Route nothing more to ``endpoint``; stop it once its in-flight requests are done and the generation
        sessions it holds have ended or moved (the gateway's engine replays them elsewhere at their next step),
        or once ``drain_timeout_s`` runs out."""
        if endpoint.state == "draining":
            return
        endpoint.state = "draining"
        fn.refresh_ready()
        self.work.run(self._drain_then_stop(fn, endpoint), "stop", endpoint.host, fn.name, endpoint.id)

    async def _drain_then_stop(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """Wait until ``endpoint`` serves nothing and holds no session, woken by events: a release of one of its
        requests (the function's wake-up, :meth:`quart_provider.balancer.Balancer.release`) or a session freed
        (:meth:`sessions_freed`); a session that ends unannounced is seen at the next look, ``DRAIN_LOOK_S``."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        freed = self._drains.setdefault(endpoint.id, asyncio.Event())
        loop = asyncio.get_running_loop()
        try:
            while (endpoint.in_flight > 0 or self.kv_tokens(endpoint.id) > 0) and time.monotonic() < deadline:
                released = loop.create_future()
                fn.add_waiter(released)
                woken = asyncio.ensure_future(freed.wait())
                try:
                    await asyncio.wait({released, woken}, timeout=min(DRAIN_LOOK_S, max(0.0, deadline - time.monotonic())),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    released.cancel()
                    woken.cancel()
                freed.clear()
        finally:
            self._drains.pop(endpoint.id, None)
        await self._stop_now(endpoint)
        fn.replicas.pop(endpoint.id, None)

    async def _stop_now(self, endpoint: Endpoint) -> None:
        host = self.hosts.get(endpoint.host)
        if host is not None:
            try:
                await host.stop(endpoint.id)
            except Exception as exc:
                log.warning("stopping replica %s failed: %s", endpoint.id, exc)
        endpoint.state = "dead"


def _no_demand(function: str) -> GroupDemand:
    """No generation engine attached: no sessions arrive (a whole group scales down to one worker)."""
    return GroupDemand()


def _no_sessions(replica_id: str) -> int:
    """No generation engine attached: no replica holds sessions."""
    return 0
