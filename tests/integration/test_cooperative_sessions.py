"""Generation sessions during a live scale-up (docs/generation.md, "Live scale-ups"): a session opened while a new
replica holds only its stage's first layers runs those layers there and the rest on a whole replica, each
keeping the KV cache of its own layers; once the new replica is whole the session rejoins it (a background
replay, or a replay) — every stream's tokens equal transformers' greedy ``generate`` (a real tiny llama), every
cache is freed at the end, and a live part that dies is given up without losing the stream."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.router import StaticReplica, StaticReplicas
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from support.tiny_llama import STAGE, prompts, tiny_llama

PROMPTS = prompts(9, 5, 13)
NEW = 24
FN = "t-stage-0"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("coop") / "llama")
    return d, tiny_llama(d, "coop", 3, PROMPTS, NEW)


class Served:
    """A real StageRuntime on a loopback port (the session routes of a stage replica); ``held`` is the prefix of
    its stage it says it holds (a live replica still receiving its parameters), widened by :meth:`complete`."""

    def __init__(self, model_dir: str, held: tuple[int, int] | None = None, kv_max_tokens: int = 0) -> None:
        self.rt = StageRuntime.load(StageConfig(model_dir=model_dir, kv_max_tokens=kv_max_tokens))
        self._held = held or STAGE
        self.rt.held = lambda: self._held
        self.runner: web.AppRunner | None = None
        self.url = ""

    def complete(self) -> None:
        self._held = STAGE

    async def start(self) -> Served:
        async def invoke(request: web.Request) -> web.Response:
            body = await request.read()
            resp = await asyncio.to_thread(self.rt.handle, body, dict(request.headers))
            return web.Response(status=resp.status, body=resp.body, headers=resp.headers)

        async def delete(request: web.Request) -> web.Response:
            status, doc = self.rt.generation.free(request.match_info["sid"])
            return web.json_response(doc, status=status) if doc else web.Response(status=status)

        app = web.Application()
        app.router.add_post("/", invoke)
        app.router.add_delete("/_/sessions/{sid}", delete)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _cluster(model_dir: str, cut: int, live_kv: int = 0):
    whole, live = await Served(model_dir).start(), await Served(model_dir, (0, cut), live_kv).start()
    source = StaticReplicas(slots=4)
    source.replicas[FN] = [StaticReplica("whole", whole.url, layers=STAGE, held=STAGE),
                           StaticReplica("live", live.url, layers=STAGE, held=(0, cut))]
    return whole, live, source


async def _run(engine: SessionEngine, prompts, on_token=None) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        session = await engine.open("coop", [FN], prompt, NEW, {"temperature": 0.0}, frozenset())
        out = []
        async for token in engine.tokens(session):
            out.append(token)
            if on_token is not None:
                await on_token(i, len(out), session)
        return out

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def _drained(*served: Served) -> None:
    for _ in range(100):  # the engine's DELETEs run in the background
        if all(s.rt.generation.table.used == 0 for s in served):
            return
        await asyncio.sleep(0.02)
    raise AssertionError({s.url: s.rt.generation.table.snapshot() for s in served})


@pytest.mark.parametrize("rejoin", ["shadow", "replay", "keep"])
def test_split_sessions_give_generate_tokens_and_rejoin_the_replica_once_whole(model, rejoin):
    model_dir, expected = model

    async def main():
        whole, live, source = await _cluster(model_dir, cut=3)
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0, rejoin=rejoin))
        seen: dict[str, tuple] = {}

        async def on_token(i: int, n: int, session) -> None:
            if n == 1:  # prefill done: split at layer 3, each part's cache on its replica, charged its share
                [split] = session.splits.values()
                seen[f"split{i}"] = (split.part, split.rest, split.part_tokens, split.rest_tokens)
            if n == 6 and i == 0:
                live.complete()  # the live replica is whole: its next answer says so
            await asyncio.sleep(0.01)

        try:
            got = await _run(engine, PROMPTS, on_token)
            await engine.close()
            await _drained(whole, live)
        finally:
            await whole.stop()
            await live.stop()
        return got, seen, engine

    got, seen, engine = asyncio.run(main())
    assert got == expected
    need = len(PROMPTS[0]) + NEW
    share = -(-need * 3 // 8)  # the live part's charge; the rejoin's replay will need the whole beside it
    assert seen["split0"] == ((0, 3), (3, 8), share + need, -(-need * 5 // 8))
    assert all(s.replays == 0 for s in engine.active.values())
    assert engine.rejoins == (0 if rejoin == "keep" else len(PROMPTS))
    assert engine.book.reserved == {}


def test_a_split_keeps_room_for_its_rejoin_and_new_sessions_go_whole_when_the_live_replica_is_full(model):
    model_dir, expected = model
    need = len(PROMPTS[0]) + NEW
    cap = need + -(-need * 3 // 8)  # one split session's part and its rejoin's replay, nothing more

    async def main():
        whole, live, source = await _cluster(model_dir, cut=3, live_kv=cap)
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0))
        engine.book.caps.update({"live": cap, "whole": 10_000})  # as the replicas report them

        async def on_token(i: int, n: int, session) -> None:
            if n == 3 and session.splits:
                live.complete()
            await asyncio.sleep(0.01)

        try:
            got = await _run(engine, PROMPTS[:1] * 3, on_token)
            await engine.close()
            await _drained(whole, live)
        finally:
            await whole.stop()
            await live.stop()
        return got, engine

    got, engine = asyncio.run(main())
    assert got == [expected[0]] * 3
    assert engine.shadows == 1 and engine.rejoins == 1 and engine.book.reserved == {}  # no 429 at the live replica


def test_a_live_part_that_dies_is_given_up_and_the_stream_goes_on_on_the_whole_replica(model):
    model_dir, expected = model

    async def main():
        whole, live, source = await _cluster(model_dir, cut=5)
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0))

        async def on_token(i: int, n: int, session) -> None:
            if n == 4 and i == 0:
                await live.stop()  # the live replica's process is gone mid-stream
                source.replicas[FN] = [r for r in source.replicas[FN] if r.id != "live"]

        try:
            got = await _run(engine, PROMPTS, on_token)
            await engine.close()
            await _drained(whole)
        finally:
            with contextlib.suppress(Exception):
                await live.stop()
            await whole.stop()
        return got, engine

    got, engine = asyncio.run(main())
    assert got == expected
    assert engine.book.reserved == {}
