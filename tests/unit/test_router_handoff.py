"""The router's hand-off: a replica freed with requests waiting for its stage goes to the queue's head in the
same event-loop turn (no wait for the stage's dispatcher to wake), under every rule the dispatcher applies —
done and expired heads dropped (504), heads that can no longer meet their deadline shed (429), a retry served
first, batching — and a call that ends at once never makes it recurse. In process: the router's client to the
replicas is a fake, no sockets."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections import deque
from dataclasses import dataclass, field

import torch
from gateway_plugin.batching import BatchLimits
from gateway_plugin.config import PluginConfig
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.router import Router, StaticReplica, StaticReplicas
from multidict import CIMultiDict
from quart_kernel.shedding import SHED_HEADER
from quart_stage import wire
from quart_transport.upstream import UpstreamResponse

STAGE = "m-stage-0"


class Turns:
    """Counts the event loop's turns: a callback that schedules itself again runs once per turn."""

    def __init__(self) -> None:
        self.n = 0
        self._handle: asyncio.Handle | None = None

    def _tick(self) -> None:
        self.n += 1
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


@dataclass(slots=True)
class Recorded(StaticReplicas):
    """Replicas whose slot changes are logged as (what, loop turn, the task that made it)."""

    turns: Turns = field(default_factory=Turns)
    log: list[tuple[str, int, str]] = field(default_factory=list)

    def _note(self, what: str) -> None:
        task = asyncio.current_task()
        self.log.append((what, self.turns.n, task.get_name() if task else ""))

    def take(self, function: str, replica: StaticReplica) -> None:
        self._note("take")
        StaticReplicas.take(self, function, replica)

    def give_back(self, function: str, replica: StaticReplica) -> None:
        self._note("give_back")
        StaticReplicas.give_back(self, function, replica)


class Upstream:
    """The router's client to its replicas, in process: a call waits ``hold_s`` (none: answers without yielding)
    and answers its body back, or the next of ``statuses``; ``during`` runs inside each call."""

    def __init__(self, hold_s: float = 0.0, during=None) -> None:
        self.hold_s, self.during = hold_s, during
        self.calls: list[str] = []
        self.statuses: deque[int] = deque()
        self.depth = 0  # the deepest Python stack a call ran on

    async def request(self, method: str, base: str, path: str, headers, body: bytes, timeout_s: float):
        self.calls.append(headers["X-Quart-Request-Id"])
        self.depth = max(self.depth, len(inspect.stack(0)))
        if self.during is not None:
            self.during()
        if self.hold_s:
            await asyncio.sleep(self.hold_s)
        status = self.statuses.popleft() if self.statuses else 200
        return UpstreamResponse(status, CIMultiDict({"Content-Type": headers["Content-Type"]}), body)

    async def close(self) -> None:
        pass


def one_slot_router(upstream: Upstream, batch: BatchLimits | None = None, **cfg) -> tuple[Router, Recorded]:
    source = Recorded({STAGE: [StaticReplica("r1", "http://replica.invalid/")]}, slots=1)
    router = Router(source, lambda: {"m": [STAGE]}, PluginConfig(**cfg), MetricsCollector(10.0),
                    dispatch_poll_s=5.0, batch_limits=(lambda fn: batch) if batch else None)
    router.upstream = upstream
    source.turns.start()
    return router, source


async def until(condition, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.002)):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not met in time")


def handed_off(source: Recorded) -> list[tuple[int, int, str]]:
    """(turn of a give-back, turn of the take after it, the task that took) for every take after the first."""
    out, freed = [], None
    for what, turn, task in source.log:
        if what == "give_back":
            freed = turn
        elif freed is not None:
            out.append((freed, turn, task))
            freed = None
    return out


def test_a_freed_replica_takes_the_waiting_request_in_the_same_loop_turn() -> None:
    async def main() -> None:
        router, source = one_slot_router(Upstream(hold_s=0.02))
        try:
            replies = await asyncio.gather(*(router.invoke("m", b"x", request_id=f"q{i}") for i in range(3)))
        finally:
            source.turns.stop()
            await router.close()
        assert [r.status for r in replies] == [200, 200, 200]
        moves = handed_off(source)
        assert len(moves) == 2
        for freed, taken, task in moves:  # the call that ended launched the next: the dispatcher was not needed
            assert taken == freed and not task.startswith("dispatch:")
        assert router.upstream is None and router.accepted == router.answered == 3

    asyncio.run(main())


def test_a_handed_off_head_past_its_deadline_gets_504_and_one_that_cannot_meet_it_429() -> None:
    """Behind a running call: b's deadline passes, c's can no longer be met (the stage now takes ~3 s), d's can.
    The call's end answers b and c and starts d, all in its own turn."""

    async def main() -> None:
        slow = []
        upstream = Upstream(hold_s=0.05, during=lambda: slow.append(1))
        router, source = one_slot_router(upstream, request_timeout_s=30.0)
        try:
            a = asyncio.create_task(router.invoke("m", b"a", request_id="a"))
            await until(lambda: upstream.calls == ["a"])
            b = asyncio.create_task(router.invoke("m", b"b", timeout_s=0.01, request_id="b"))
            c = asyncio.create_task(router.invoke("m", b"c", timeout_s=1.0, request_id="c"))
            d = asyncio.create_task(router.invoke("m", b"d", timeout_s=30.0, request_id="d"))
            await until(lambda: len(router.queues[STAGE].jobs) == 3)
            for _ in range(20):  # measured while a runs: the stage takes 3 s now (c's 1 s cannot cover it)
                router.service_times(STAGE).record(3.0)
            replies = await asyncio.gather(a, b, c, d)
        finally:
            source.turns.stop()
            await router.close()
        assert [r.status for r in replies] == [200, 504, 429, 200]
        assert "deadline" in json.loads(replies[1].body)["error"]
        assert replies[2].headers[SHED_HEADER] == "deadline" and "Retry-After" in replies[2].headers
        assert upstream.calls == ["a", "d"]
        [(freed, taken, task)] = handed_off(source)
        assert taken == freed and not task.startswith("dispatch:")

    asyncio.run(main())


def test_a_retry_goes_back_in_front_and_takes_the_freed_replica_first() -> None:
    async def main() -> None:
        upstream = Upstream(hold_s=0.01)
        upstream.statuses.append(503)  # a's first attempt: a draining replica, retried
        router, source = one_slot_router(upstream)
        try:
            replies = await asyncio.gather(*(router.invoke("m", b"x", request_id=r) for r in ("a", "b", "c")))
        finally:
            source.turns.stop()
            await router.close()
        assert [r.status for r in replies] == [200, 200, 200]
        assert upstream.calls == ["a", "a", "b", "c"]  # the retry before the requests that waited behind it
        assert all(taken == freed for freed, taken, _ in handed_off(source))

    asyncio.run(main())


def test_a_freed_replica_takes_a_batch_of_the_waiting_requests() -> None:
    async def main() -> None:
        upstream = Upstream(hold_s=0.02)
        router, source = one_slot_router(upstream, batch=BatchLimits(max=3))
        body = wire.encode_bytes({"hidden_states": torch.ones((1, 3, 4))})
        try:
            first = asyncio.create_task(router.invoke("m", body, request_id="a"))
            await until(lambda: upstream.calls == ["a"])
            rest = [asyncio.create_task(router.invoke("m", body, request_id=r)) for r in ("b", "c", "d")]
            await until(lambda: len(router.queues[STAGE].jobs) == 3)
            replies = await asyncio.gather(first, *rest)
        finally:
            source.turns.stop()
            await router.close()
        assert [r.status for r in replies] == [200] * 4
        assert upstream.calls == ["a", "b+2"]  # one call carried the three that waited
        [(freed, taken, _)] = handed_off(source)
        assert taken == freed

    asyncio.run(main())


def test_calls_that_end_at_once_never_make_the_hand_off_recurse() -> None:
    async def main() -> None:
        upstream = Upstream()  # answers without yielding: each call ends in the turn it starts
        router, source = one_slot_router(upstream, queue_cap=1000)
        try:
            replies = await asyncio.gather(*(router.invoke("m", b"x") for _ in range(300)))
        finally:
            source.turns.stop()
            await router.close()
        assert all(r.status == 200 for r in replies) and len(upstream.calls) == 300
        assert upstream.depth < 60  # each call on a fresh task's stack, not nested in the one before

    asyncio.run(main())


def test_a_call_cancelled_before_its_task_ran_gives_its_replica_back() -> None:
    """A request is abandoned (its client gone, its deadline) in the very turn its call was launched: the task
    never runs (so never reaches the exchange that gives slots back), and the one replica must still serve the
    next request."""

    async def main() -> None:
        upstream = Upstream(hold_s=0.01)
        router, source = one_slot_router(upstream)
        try:
            gone = asyncio.create_task(router.invoke("m", b"a", request_id="a"))
            for _ in range(50):  # turn by turn until its call is launched (the task scheduled), not run yet
                await asyncio.sleep(0)
                if router.queues[STAGE].busy:
                    break
            [job] = router._running
            assert router.queues[STAGE].busy == 1 and upstream.calls == []
            router._abandon(job, status=499)  # as the client's going away or its deadline timer would, in this turn
            assert (await gone).status == 499
            reply = await asyncio.wait_for(router.invoke("m", b"b", request_id="b"), 2.0)
        finally:
            source.turns.stop()
            await router.close()
        assert reply.status == 200 and upstream.calls == ["b"]
        assert router.queues[STAGE].busy == 0

    asyncio.run(main())
