"""Generation sessions during a live scale-up (docs/generation.md, "Live scale-ups"): a session opened while a new
replica holds only its stage's first layers runs those layers there and the rest on a whole replica, each
keeping the KV cache of its own layers; once the new replica is whole the session rejoins it (its KV cache
moved over, a background replay, or a replay) — every stream's tokens equal transformers' greedy ``generate`` (a
real tiny llama), every cache is freed at the end, and a live part that dies is given up without losing the
stream."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiohttp import web
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.router import StaticReplica, StaticReplicas
from quart_stage import kvroutes
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
        self.exports = 0  # KV-cache exports served (a migrate rejoin)
        self.refuse: set[str] = set()  # "staged": refuse a re-cut's pre-copy install; "trim": refuse its drop

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

        async def export(request: web.Request) -> web.Response:
            resp = await asyncio.to_thread(kvroutes.export_response, self.rt, request.match_info["sid"],
                                           request.query.get("layers"), request.query.get("from"))
            self.exports += 1
            return web.Response(status=resp.status, body=resp.body, headers=resp.headers)

        async def install(request: web.Request) -> web.Response:
            body = await request.read()
            if "staged" in self.refuse and request.headers.get("X-Quart-KV-Staged"):
                return web.json_response({"error": "refused by the test"}, status=503)
            resp = await asyncio.to_thread(kvroutes.import_response, self.rt, request.match_info["sid"], body,
                                           dict(request.headers))
            return web.Response(status=resp.status, body=resp.body, headers=resp.headers)

        async def trim(request: web.Request) -> web.Response:
            if "trim" in self.refuse:
                return web.json_response({"error": "refused by the test"}, status=500)
            resp = await asyncio.to_thread(kvroutes.trim_response, self.rt, request.match_info["sid"],
                                           request.query.get("layers"))
            return web.Response(status=resp.status, body=resp.body, headers=resp.headers)

        app = web.Application()
        app.router.add_post("/", invoke)
        app.router.add_delete("/_/sessions/{sid}/kv", trim)
        app.router.add_delete("/_/sessions/{sid}", delete)
        app.router.add_get("/_/sessions/{sid}/kv", export)
        app.router.add_put("/_/sessions/{sid}/kv", install)
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


async def _run_and_stop(engine: SessionEngine, whole: Served, live: Served, prompts, on_token) -> list[list[int]]:
    """The sessions' tokens; then the engine closed, every cache checked freed, both replicas stopped."""
    try:
        got = await _run(engine, prompts, on_token)
        await engine.close()
        await _drained(whole, live)
    finally:
        await whole.stop()
        await live.stop()
    return got


async def _drained(*served: Served) -> None:
    for _ in range(100):  # the engine's DELETEs run in the background
        if all(s.rt.generation.table.used == 0 for s in served):
            return
        await asyncio.sleep(0.02)
    raise AssertionError({s.url: s.rt.generation.table.snapshot() for s in served})


@pytest.mark.parametrize(("rejoin", "batch"), [("auto", 1), ("migrate", 1), ("shadow", 1), ("replay", 1), ("keep", 1),
                                               ("migrate", 4)])
def test_split_sessions_give_generate_tokens_and_rejoin_the_replica_once_whole(model, rejoin, batch):
    """``batch`` > 1: decode batching on, a split's rest steps between the whole replica's batches (its lane)."""
    model_dir, expected = model

    async def main():
        whole, live, source = await _cluster(model_dir, cut=3)
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0, rejoin=rejoin, decode_batch_max=batch))
        seen: dict[str, tuple] = {}

        async def on_token(i: int, n: int, session) -> None:
            if n == 1:  # prefill done: split at layer 3, each part's cache on its replica, charged its share
                [split] = session.splits.values()
                seen[f"split{i}"] = (split.part, split.rest, split.part_tokens, split.rest_tokens)
            if n == 6 and i == 0:
                live.complete()  # the live replica is whole: its next answer says so
            await asyncio.sleep(0.01)

        got = await _run_and_stop(engine, whole, live, PROMPTS, on_token)
        return got, seen, engine, whole.exports

    got, seen, engine, exports = asyncio.run(main())
    assert got == expected
    need = len(PROMPTS[0]) + NEW
    share, rest = -(-need * 3 // 8), -(-need * 5 // 8)  # each part's charge
    # beside its part, the live replica holds a replay's room (the whole session); a move hands the rest over
    room = {"auto": 0, "migrate": 0, "shadow": need, "replay": need, "keep": 0}[rejoin]
    assert seen["split0"] == ((0, 3), (3, 8), share + room, rest)
    assert all(s.replays == 0 for s in engine.active.values())
    assert engine.live_splits.rejoins == (0 if rejoin == "keep" else len(PROMPTS))
    assert (len(engine.live_splits.moved), exports) == ((len(PROMPTS),) * 2 if rejoin == "migrate" else (0, 0))
    assert engine.live_splits.shadows == (len(PROMPTS) if rejoin in ("auto", "shadow") else 0)  # auto: room for the replay
    assert engine.book.reserved == {}
    assert sorted(engine._lanes) == ([] if batch == 1 else ["live", "whole"])  # rejoined: batched on the new one


@pytest.mark.parametrize("rejoin", ["auto", "migrate", "shadow"])
def test_a_split_books_a_replays_room_only_and_new_sessions_go_whole_when_the_live_replica_is_full(model, rejoin):
    """The live replica's cap is one session's share and a rest: a replay's rejoin (``shadow``) books the whole
    session beside its share, so one split fits and it rejoins; a move (``auto``, ``migrate``) books nothing ahead
    (it hands the rest over), so two splits fit, each rejoining only where room has freed. No 429 either way."""
    model_dir, expected = model
    need = len(PROMPTS[0]) + NEW
    share, rest = -(-need * 3 // 8), -(-need * 5 // 8)
    cap = share + (need if rejoin == "shadow" else rest)

    async def main():
        whole, live, source = await _cluster(model_dir, cut=3, live_kv=cap)
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0, rejoin=rejoin))
        engine.book.caps.update({"live": cap, "whole": 10_000})  # as the replicas report them
        split: set[int] = set()

        async def on_token(i: int, n: int, session) -> None:
            if n == 1 and session.splits:
                split.add(i)
            if n == 3 and session.splits:
                live.complete()
            await asyncio.sleep(0.01)

        got = await _run_and_stop(engine, whole, live, PROMPTS[:1] * 3, on_token)
        return got, engine, split

    got, engine, split = asyncio.run(main())
    assert got == [expected[0]] * 3 and engine.book.reserved == {}  # no 429 at the live replica
    if rejoin == "shadow":
        assert len(split) == 1 and engine.live_splits.rejoins == engine.live_splits.shadows == 1
    else:
        assert len(split) == 2  # the share only: the second split fits where the rest's room was held before
        assert engine.live_splits.rejoins <= 1 and engine.live_splits.shadows == 0  # a move needs the room freed


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


def test_emulated_split_sessions_rejoin_by_migration_with_the_emulations_own_tokens(tmp_path):
    """The bench's emulated decoder (real stage bytes, emulated steps, a token that hashes the session's seed and
    ids): split sessions rejoin the live replica by a KV move and answer exactly the emulation's tokens — the part
    that comes to run the whole stage has the session's sampling seed too."""
    import threading

    from quart_stage.app import create_app
    from quart_stage.manifest import Manifest
    from quart_stage.runtime import read_stage_file
    from quart_tools.bench.blitzscale import build_stage
    from quart_tools.bench.blitzscale_gen import expected_tokens
    from quart_tools.stagechain import cut_runtimes
    from werkzeug.serving import make_server

    root = str(build_stage(tmp_path, 40, 8, 10.0))
    manifest = Manifest.load(root)
    tensors, end = read_stage_file(root, manifest.stages[0]), manifest.stages[0].end
    vocab, held = int(manifest.config["vocab_size"]), [(0, 4)]
    servers, urls = [], []
    for i in range(2):
        (rt,) = cut_runtimes(root, manifest, tensors, [0, end], compute="emulated", emulated_mean_ms=5.0,
                             emulated_decode_ms=5.0, emulated_prefill_ms_per_token=0.1, emulated_cv=0.0)
        if i == 1:
            rt.held = lambda: held[0]  # the live replica: its first layers until it says it is whole
        server = make_server("127.0.0.1", 0, create_app(rt), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{server.server_port}/")
    source = StaticReplicas(slots=8)
    source.replicas[FN] = [StaticReplica("whole", urls[0], layers=(0, end), held=(0, end)),
                           StaticReplica("live", urls[1], layers=(0, end), held=(0, 4))]
    prompts = [list(range(3 + i, 23 + i)) for i in range(3)]

    async def main():
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0, rejoin="migrate"))

        async def one(i: int) -> list[int]:
            session = await engine.open(manifest.model, [FN], prompts[i], 12, {"temperature": 0.0, "seed": 77 + i},
                                        frozenset())
            assert session.splits
            out = []
            async for token in engine.tokens(session):
                out.append(token)
                if len(out) == 4 and i == 0:
                    held[0] = (0, end)  # whole: its next answer says so
            return out

        try:
            got = await asyncio.gather(*(one(i) for i in range(3)))
            await engine.close()
        finally:
            await asyncio.gather(*(asyncio.to_thread(server.shutdown) for server in servers))
        return got, engine

    got, engine = asyncio.run(main())
    assert got == [expected_tokens(prompts[i], 12, 77 + i, vocab) for i in range(3)]
    assert len(engine.live_splits.moved) == engine.live_splits.rejoins == 3 and all(b > 0 for b, _ in engine.live_splits.moved)
    assert engine.book.reserved == {}


@pytest.mark.parametrize(("recut", "refuse"), [(True, ""), (False, ""), (True, "staged"), (True, "trim")])
def test_a_split_is_re_cut_while_a_session_waits_and_the_freed_room_admits_it_with_generate_tokens(model, recut,
                                                                                                    refuse):
    """Two sessions split at layer 2 fill the whole replica's cache; a third waits in line. The live replica comes
    to hold layers 0-6: a split's cache of layers 2-6 is pre-copied onto it, the positions since copied before a
    step, the whole replica drops those layers (its share of them freed), and the waiting session gets in. Real
    caches (a tiny llama): every stream still equals ``generate``, and every cache is freed at the end.
    ``QUART_GEN_RECUT`` off: no re-cut, the same tokens (the waiting session gets in once a session ends). A refused
    pre-copy leaves the cut where it was; a refused drop on the whole replica makes that session replay there: the
    same tokens, nothing left booked."""
    model_dir, expected = model
    need = len(PROMPTS[0]) + NEW
    rest2 = -(-need * 6 // 8)  # a split at layer 2: the whole replica's share
    cap = 2 * rest2 + 1

    async def main():
        whole = await Served(model_dir, kv_max_tokens=cap).start()
        live = await Served(model_dir, (0, 2)).start()
        whole.refuse.add(refuse)
        live.refuse.add(refuse)
        source = StaticReplicas(slots=4)
        source.replicas[FN] = [StaticReplica("whole", whole.url, layers=STAGE, held=STAGE),
                               StaticReplica("live", live.url, layers=STAGE, held=(0, 2))]
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0, rejoin="migrate", recut=recut))
        engine.book.caps.update({"live": 10_000, "whole": cap})  # as the replicas report them
        cuts: dict[int, set] = {}
        replays: dict[int, int] = {}

        async def on_token(i: int, n: int, session) -> None:
            for split in session.splits.values():
                cuts.setdefault(i, set()).add(split.part)
            replays[i] = session.replays
            if n == 2 and i == 0:
                live._held = (0, 6)  # more layers arrived (its next answer says so)
            if n == 10 and i == 2:
                live.complete()
            await asyncio.sleep(0.01)

        got = await _run_and_stop(engine, whole, live, PROMPTS[:1] * 3, on_token)
        return got, engine, cuts, replays

    got, engine, cuts, replays = asyncio.run(main())
    assert got == [expected[0]] * 3
    assert bool(engine.live_splits.recuts) is (recut and not refuse)
    assert (max(replays.values()) > 0) is (refuse == "trim")  # its step at the whole replica failed: a replay
    # with the re-cut a session ran cut at 2, then at 6 (a refused drop: that step failed, the session replayed)
    assert any({(0, 2), (0, 6)} <= parts for parts in cuts.values()) is (recut and not refuse)
    assert engine.room.counts.waited >= 1 and engine.room.counts.late == 0
    assert engine.book.reserved == {}
