"""Load balancing over a function's ready replicas: one pick rule for the proxy and the pipeline router.

- :func:`quart_kernel.picking.pick`: the pure rule both use (least in flight among the ready replicas with a
  free slot, replicas already tried for this request last);
- :class:`Balancer`: the proxy's path — ``acquire_nowait / acquire / release`` keep each replica's
  in-flight count exact; ``acquire`` waits (bounded) for a replica, scaling a function up from zero,
  and raises :class:`ServiceUnavailable` (429 / 503) when none comes in time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping

from quart_kernel.picking import pick
from quart_provider.config import GatewayConfig
from quart_provider.types import Endpoint, FunctionState
from quart_stage.errors import QuartError

from keysmanager.aio import within


class ServiceUnavailable(QuartError):
    """No replica could take the request in time (503 or 429, with Retry-After)."""


class Balancer:
    """Hands out the ready replicas of the functions in ``functions`` (the registry's live mapping)."""

    def __init__(self, config: GatewayConfig, functions: Mapping[str, FunctionState], kick: Callable[[], None],
                 why: Callable[[FunctionState], str] = lambda fn: "",
                 scale: Callable[[str, int], object] | None = None,
                 pending: Callable[[str], int] = lambda function: 0) -> None:
        self.config = config
        self.functions = functions
        self.kick = kick  # ask the reconciler to act now (a replica gone)
        self.why = why  # why a function has no ready replica (quart_kernel.capacity), for the 503
        self.scale = scale  # desired replicas, through the registry (Registry.set_desired: saved, reconciled)
        self.pending = pending  # a function's starts under way (the reconciler's in-flight table)

    def acquire_nowait(self, fn: FunctionState) -> Endpoint | None:
        """The :func:`pick` of ``fn``'s ready replicas, its in-flight count taken; None if none."""
        endpoint = pick(fn.ready, fn.deployment.concurrency)
        if endpoint is not None:
            endpoint.in_flight += 1
        return endpoint

    async def acquire(self, fn: FunctionState) -> Endpoint:
        """Like :meth:`acquire_nowait`, waiting up to ``ready_wait_s`` (scales from zero if needed).

        Raises :class:`ServiceUnavailable`: 429 when too many requests wait or all replicas stay busy,
        503 when no replica became ready in time.
        """
        endpoint = self.acquire_nowait(fn)
        if endpoint is not None:
            return endpoint
        if fn.waiting >= self.config.max_waiting:
            raise ServiceUnavailable(429, f"function {fn.name!r} is overloaded: {fn.waiting} requests already "
                                          "wait for a replica", None)
        if fn.desired == 0:  # scale from zero, through the registry (the one writer of desired)
            if self.scale is not None:
                self.scale(fn.name, max(1, fn.deployment.min_replicas))
            else:
                self.kick()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.ready_wait_s
        fn.waiting += 1
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or fn.name not in self.functions:
                    break
                fut = loop.create_future()
                fn.add_waiter(fut)
                with contextlib.suppress(TimeoutError):
                    await within(min(remaining, 0.25), fut)  # also looks again at what the reconciler found
                endpoint = self.acquire_nowait(fn)
                if endpoint is not None:
                    return endpoint
                if fn.unplaced and not fn.replicas and not self.pending(fn.name):  # no slot: do not wait it out
                    raise ServiceUnavailable(503, f"no replica of {fn.name!r} can start: {self.why(fn)}", None)
        finally:
            fn.waiting -= 1
        if fn.ready:
            raise ServiceUnavailable(429, f"all replicas of {fn.name!r} stayed at their concurrency limit for "
                                          f"{self.config.ready_wait_s:g} s", None)
        reason = self.why(fn)
        raise ServiceUnavailable(503, f"no replica of {fn.name!r} became ready within "
                                      f"{self.config.ready_wait_s:g} s" + (f": {reason}" if reason else ""), None)

    def release(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """A request to ``endpoint`` is over: free its slot and wake a waiter."""
        endpoint.in_flight -= 1
        endpoint.served += 1
        if fn.wakeups:
            fn.wake()

    def mark_unreachable(self, fn: FunctionState, endpoint: Endpoint) -> None:
        """A replica refused a connection: route nothing more to it; the next reconcile confirms or removes it."""
        if endpoint.state == "ready":
            endpoint.state, endpoint.probed = "starting", False  # the host's next report says ready if a blip
            fn.refresh_ready()
            self.kick()
