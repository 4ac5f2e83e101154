"""Layer ranges in the router (cooperative execution): a replica that holds part of its stage runs those
layers and the rest of the stage runs on another replica; a sub-pipeline of parts serves a stage none of
whose replicas holds it whole; answers saying more layers are held widen what a replica is given."""

from __future__ import annotations

import asyncio
import functools

from aiohttp import web
from gateway_plugin import layers
from gateway_plugin.config import PluginConfig
from gateway_plugin.router import Router, StaticReplica, StaticReplicas


def asynctest(body):
    """Run the coroutine test on a fresh event loop."""

    @functools.wraps(body)
    def test() -> None:
        asyncio.run(body())

    return test


class LayeredReplica:
    """A fake stage replica over layers ``stage``, holding ``held``: runs the asked range (X-Quart-Layers, or
    the whole stage), appends ``|tag:A-B`` to the body, answers 503 for layers it does not hold."""

    def __init__(self, tag: str, stage: tuple[int, int], held: tuple[int, int]) -> None:
        self.tag, self.stage, self.held = tag, stage, held
        self.asked: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        asked = request.headers.get(layers.LAYERS)
        self.asked.append(asked)
        want = layers.parse_range(asked) or self.stage
        held = {layers.HELD: layers.format_range(self.held)}
        if not (self.held[0] <= want[0] and want[1] <= self.held[1]):
            return web.json_response({"error": "layers not held", "field": "layers"}, status=503, headers=held)
        body = await request.read() + f"|{self.tag}:{layers.format_range(want)}".encode()
        return web.Response(body=body, headers={**held, layers.LAYERS: layers.format_range(want)})

    async def start(self) -> LayeredReplica:
        app = web.Application()
        app.router.add_post("/", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site.port}/"
        return self

    def replica(self, reported_held: tuple[int, int] | None = None) -> StaticReplica:
        return StaticReplica(self.tag, self.url, layers=self.stage, held=reported_held or self.held)


async def run_router(fakes: list[LayeredReplica], replicas: list[StaticReplica], bodies: int = 1):
    source = StaticReplicas({"m-s1": replicas}, slots=4)
    router = Router(source, lambda: {"m": ["m-s1"]}, PluginConfig(request_timeout_s=5.0))
    try:
        replies = [await router.invoke("m", b"in") for _ in range(bodies)]
    finally:
        await router.close()
        for fake in fakes:
            await fake.runner.cleanup()
    return replies, source


@asynctest
async def test_partial_replica_runs_its_layers_and_a_whole_one_the_rest() -> None:
    new = await LayeredReplica("new", (1, 5), (1, 3)).start()
    old = await LayeredReplica("old", (1, 5), (1, 5)).start()
    (reply,), _ = await run_router([new, old], [new.replica(), old.replica()])
    assert reply.status == 200
    assert reply.body == b"in|new:1-3|old:3-5"
    assert new.asked == ["1-3"] and old.asked == ["3-5"]


@asynctest
async def test_sub_pipeline_of_parts_serves_a_stage_no_replica_holds_whole() -> None:
    a = await LayeredReplica("a", (1, 7), (1, 3)).start()
    b = await LayeredReplica("b", (1, 7), (3, 6)).start()
    c = await LayeredReplica("c", (1, 7), (6, 7)).start()
    (reply,), _ = await run_router([a, b, c], [c.replica(), b.replica(), a.replica()])
    assert reply.body == b"in|a:1-3|b:3-6|c:6-7"


@asynctest
async def test_an_answer_saying_more_is_held_widens_the_next_part() -> None:
    new = await LayeredReplica("new", (1, 5), (1, 5)).start()  # has everything; its host still reports 1-2
    (first, second), source = await run_router([new], [new.replica(reported_held=(1, 2))], bodies=2)
    assert first.body == b"in|new:1-2|new:2-5"  # its answer said 1-5: the rest ran there too
    assert second.body == b"in|new:1-5"
    assert source.replicas["m-s1"][0].held == (1, 5)
    assert new.asked[-1] is None  # whole again: no header


@asynctest
async def test_request_waits_when_no_replica_holds_the_next_layer() -> None:
    a = await LayeredReplica("a", (1, 5), (1, 3)).start()
    source = StaticReplicas({"m-s1": [a.replica()]}, slots=4)
    router = Router(source, lambda: {"m": ["m-s1"]}, PluginConfig(request_timeout_s=0.5))
    try:
        reply = await router.invoke("m", b"in")
        assert reply.status == 504  # ran 1-3, then nothing held layer 3 before the deadline
        assert a.asked == ["1-3"]
    finally:
        await router.close()
        await a.runner.cleanup()


def test_ranges_parse_and_eligibility() -> None:
    assert layers.parse_range("2-7") == (2, 7)
    for bad in (None, "", "7-2", "3-3", "a-b", "-3", "3", "1-2-3", "1-1234567"):
        assert layers.parse_range(bad) is None, bad
    whole = StaticReplica("w", "u")
    assert layers.eligible(whole, None) and not layers.eligible(whole, 3)
    assert layers.part_for(whole, None) is None
    part = StaticReplica("p", "u", layers=(2, 9), held=(2, 5))
    assert layers.eligible(part, None) and layers.eligible(part, 4) and not layers.eligible(part, 5)
    assert layers.part_for(part, None) == (2, 5) and layers.part_for(part, 3) == (3, 5)
    middle = StaticReplica("m", "u", layers=(2, 9), held=(5, 9))
    assert not layers.eligible(middle, None) and layers.eligible(middle, 5)
    assert layers.next_position((2, 5), (2, 9)) == 5 and layers.next_position((5, 9), (2, 9)) is None


class GrowingReplica(LayeredReplica):
    """A part worker consolidating while it serves: its held range grows both ways by one layer every
    ``step_s`` (the progress file's contract), answers after a random delay, now and then 503 (a range it no
    longer reports in time) or a dropped connection (its host lost mid-answer)."""

    def __init__(self, tag: str, stage: tuple[int, int], held: tuple[int, int], step_s: float, seed: int) -> None:
        super().__init__(tag, stage, held)
        import random

        self.step_s, self.rng = step_s, random.Random(seed)

    async def grow(self) -> None:
        while self.held != self.stage:
            await asyncio.sleep(self.step_s)
            lo, hi = self.held
            self.held = (max(self.stage[0], lo - 1), min(self.stage[1], hi + 1))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(self.rng.uniform(0, 0.004))
        if self.rng.random() < 0.05:
            request.transport.close()  # the connection drops: the router retries elsewhere
            return web.Response(status=500)
        return await super().handle(request)


@asynctest
async def test_growing_parts_under_concurrent_requests_never_skip_or_repeat_a_layer() -> None:
    """Four part workers over layers [1, 13) growing while 120 requests run through them (held ranges moving
    while requests are routed, answers widening the router's view, retries after dropped connections): every
    answer ran each layer of the stage exactly once, in order (``Job.layer_at`` bookkeeping)."""
    stage = (1, 13)
    parts = [(1, 4), (4, 7), (7, 10), (10, 13)]
    fakes = [await GrowingReplica(f"w{i}", stage, (a, a + 1), 0.02 * (i + 1), i).start()
             for i, (a, _) in enumerate(parts)]
    source = StaticReplicas({"m-s1": [f.replica() for f in fakes]}, slots=2)
    router = Router(source, lambda: {"m": ["m-s1"]}, PluginConfig(request_timeout_s=20.0, max_attempts=50),
                    dispatch_poll_s=0.002)

    async def refresh() -> None:  # the hosts' reports: each replica's held range, a little late
        while True:
            await asyncio.sleep(0.01)
            for r, f in zip(source.replicas["m-s1"], fakes, strict=True):
                r.held = f.held

    growers = [asyncio.ensure_future(f.grow()) for f in fakes]
    reporter = asyncio.ensure_future(refresh())
    try:
        async def one(i: int):
            await asyncio.sleep(0.002 * i)
            return await router.invoke("m", b"in", timeout_s=20.0)

        replies = await asyncio.gather(*(one(i) for i in range(120)))
    finally:
        reporter.cancel()
        for g in growers:
            g.cancel()
        await router.close()
        for fake in fakes:
            await fake.runner.cleanup()
    for reply in replies:
        assert reply.status == 200, reply.body
        ran = [layers.parse_range(step.split(b":")[1].decode()) for step in reply.body.split(b"|")[1:]]
        covered = [layer for a, b in ran for layer in range(a, b)]
        assert covered == list(range(*stage)), reply.body
