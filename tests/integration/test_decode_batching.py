"""Continuous batching of decode steps through the session engine (gateway_plugin.generation.decodebatch) over
real ``tiny`` stage replicas on loopback HTTP (docs/batching.md#decode): concurrent sessions joining and leaving
give the tokens they give one at a time, a session whose cache a replica lost fails over alone, and a long
prompt's prefill (chunked, alternating with the decode batches) stalls the running streams for at most a bound."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.metrics import MetricsCollector
from gateway_plugin.router import StaticReplica, StaticReplicas
from quart_stage import batchwire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_tools.partition import partition

STAGES = 3


class SessionStage:
    """One stage replica over HTTP (aiohttp, compute in a thread, one call at a time: gunicorn's one thread),
    recording the size of every batched step it ran."""

    def __init__(self, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.batches: list[int] = []
        self.lock = asyncio.Lock()
        self.url = ""

    async def _invoke(self, request: web.Request) -> web.Response:
        body = await request.read()
        if batchwire.H_SESSION_BATCH in request.headers:
            self.batches.append(int(request.headers[batchwire.H_SESSION_BATCH]))
        async with self.lock:
            resp = await asyncio.to_thread(self.runtime.handle, body, dict(request.headers))
        return web.Response(status=resp.status, body=resp.body, headers=resp.headers)

    async def _delete(self, request: web.Request) -> web.Response:
        status, doc = self.runtime.generation.free(request.match_info["sid"])
        return web.Response(status=status) if doc is None else web.json_response(doc, status=status)

    async def start(self) -> SessionStage:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/", self._invoke)
        app.router.add_delete("/_/sessions/{sid}", self._delete)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        self.url = str(self.server.make_url("/"))
        return self


async def _engine(settings: list[dict], replicas: tuple[int, ...] = (1, 1, 1), **config
                  ) -> tuple[SessionEngine, list[SessionStage]]:
    source = StaticReplicas(slots=1)
    stages = []
    for i, s in enumerate(settings):
        source.replicas[f"m-{i}"] = []
        for j in range(replicas[i]):
            runtime = StageRuntime.load(StageConfig(stage_index=i, num_stages=STAGES, threads=1, **s))
            stage = await SessionStage(runtime).start()
            stages.append(stage)
            source.replicas[f"m-{i}"].append(StaticReplica(f"r{i}.{j}", stage.url))
    engine = SessionEngine(source, GenerationConfig(replica_wait_s=1.0, **config))
    engine.model = stages[0].runtime.model
    return engine, stages


async def _generate(engine: SessionEngine, prompt: list[int], n: int, delay_s: float = 0.0,
                    stamps: list[float] | None = None) -> list[int]:
    await asyncio.sleep(delay_s)
    session = await engine.open(engine.model, [f"m-{i}" for i in range(STAGES)], prompt, n, {"temperature": 0.0},
                                frozenset())
    out = []
    async for token in engine.tokens(session):
        out.append(token)
        if stamps is not None:
            stamps.append(time.perf_counter())
    return out


async def _alone(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt's tokens, one session at a time, batching off."""
    engine, stages = await _engine([{"model_dir": model_dir}] * STAGES)
    try:
        return [await _generate(engine, p, n) for p in prompts]
    finally:
        await _close(engine, stages)


async def _close(engine: SessionEngine, stages: list[SessionStage]) -> None:
    await engine.close()
    for s in stages:
        await s.server.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-batching")
    partition("tiny", STAGES, str(root / "tiny"), progress=False, seed=7)
    return str(root / "tiny")


PROMPTS = [[5, 6, 7, 8, 9], [40, 41], list(range(60, 79)), [3] * 11, [90, 12, 33], list(range(100, 131))]
LENGTHS = [12, 7, 16, 3, 10, 14]  # sessions leave the batch at different steps
DELAYS = [0.0, 0.0, 0.02, 0.04, 0.06, 0.1]  # ... and join it at different steps


def test_concurrent_sessions_joining_and_leaving_batches_give_the_unbatched_tokens(tiny):
    async def run(batch: int) -> tuple[list[list[int]], list[int]]:
        engine, stages = await _engine([{"model_dir": tiny}] * STAGES, decode_batch_max=batch)
        engine.collector = collectors[batch] = MetricsCollector(window_s=600.0)
        try:
            out = await asyncio.gather(*(_generate(engine, p, n, d) for p, n, d in zip(PROMPTS, LENGTHS, DELAYS,
                                                                                        strict=True)))
            tables[batch] = {fn: engine.stage_decode(fn) for fn in (f"m-{i}" for i in range(STAGES))}
            return out, [b for s in stages for b in s.batches]
        finally:
            await _close(engine, stages)

    tables: dict[int, dict] = {}
    collectors: dict[int, MetricsCollector] = {}
    alone, sizes_off = asyncio.run(run(1))
    batched, sizes = asyncio.run(run(8))
    assert sizes_off == []  # batching off: the one-session protocol only
    assert batched == alone
    # the engine's table of decode steps by batch size (what the policies' sessions floor reads), per stage
    for batch in (1, 8):
        for table, limit in tables[batch].values():
            assert limit == batch
            assert all(mean_s > 0 for _, _, mean_s in table)
            if batch == 1:
                assert [size for size, _, _ in table] == [1] and table[0][1] == sum(n - 1 for n in LENGTHS)
            else:
                assert sum(size * calls for size, calls, _ in table) == sum(n - 1 for n in LENGTHS)
                assert max(size for size, _, _ in table) >= 2
        # every step (a prefill, then one per further token) reached each stage as an arrival and was served, as
        # the simulator counts them: what the policies' rates see of generation
        for fn in (f"m-{i}" for i in range(STAGES)):
            stats = collectors[batch].stage(fn)
            assert stats.total_arrivals == stats.total_completions == sum(LENGTHS)
    assert max(sizes) >= 2 and len(set(sizes)) >= 2  # batches formed, and their size changed as sessions came and went
    assert sum(sizes) == STAGES * sum(n - 1 for n in LENGTHS)  # every decode step ran in a batch, once per stage


def test_a_session_whose_cache_is_lost_replays_alone_and_the_batch_goes_on(tiny):
    async def run() -> tuple[list[list[int]], int]:
        engine, stages = await _engine([{"model_dir": tiny}] * STAGES, decode_batch_max=8)
        try:
            tasks = [asyncio.ensure_future(_generate(engine, p, 12)) for p in PROMPTS[:4]]
            while sum(len(s.generated) for s in engine.active.values()) < 12:
                await asyncio.sleep(0.005)
            victim = next(s for s in engine.active.values() if s.prompt == PROMPTS[1])
            stages[1].runtime.generation.free(victim.id)  # the middle stage loses one session's cache: 409 for it
            out = await asyncio.gather(*tasks)
            return out, victim.replays
        finally:
            await _close(engine, stages)

    out, replays = asyncio.run(run())
    assert replays == 1
    assert out == asyncio.run(_alone(tiny, PROMPTS[:4], 12))


def test_a_killed_replica_fails_its_sessions_over_and_the_tokens_are_identical(tiny):
    async def run() -> tuple[list[list[int]], int]:
        engine, stages = await _engine([{"model_dir": tiny}] * STAGES, replicas=(1, 2, 1), decode_batch_max=8)
        try:
            tasks = [asyncio.ensure_future(_generate(engine, p, 14)) for p in PROMPTS[:4]]
            while sum(len(s.generated) for s in engine.active.values()) < 16:
                await asyncio.sleep(0.005)
            source, live = engine.source, list(engine.active.values())
            victim = live[0].replicas[1]
            source.replicas["m-1"].remove(victim)  # the gateway saw it go
            await next(s for s in stages if s.url == victim.url).server.close()  # killed: its batches fail
            out = await asyncio.gather(*tasks)
            on_victim = [s for s in live if s.replays]
            assert on_victim and all(s.replays == 1 for s in on_victim)  # each failed over once, by replay
            return out, sum(1 for s in stages if s.url == victim.url)
        finally:
            await _close(engine, stages)

    out, killed = asyncio.run(run())
    assert killed == 1 and out == asyncio.run(_alone(tiny, PROMPTS[:4], 14))


def test_a_long_prefill_stalls_running_streams_by_at_most_one_chunk_per_stage():
    emulated = {"compute": "emulated", "profile": "llama-7b", "emulated_cv": 0.0, "emulated_decode_ms": 4.0,
                "emulated_prefill_ms_per_token": 1.0}

    async def run(chunk: int) -> float:
        engine, stages = await _engine([emulated] * STAGES, decode_batch_max=8, prefill_chunk=chunk)
        try:
            stamps: list[list[float]] = [[], []]
            streams = [asyncio.ensure_future(_generate(engine, [1, 2, 3], 60, stamps=stamps[i])) for i in range(2)]
            await asyncio.sleep(0.15)
            await _generate(engine, list(range(1, 801)), 2)  # 800 positions: 800 ms per stage unchunked
            await asyncio.gather(*streams)
            return max(b - a for s in stamps for a, b in zip(s, s[1:], strict=False))
        finally:
            await _close(engine, stages)

    chunked, whole = asyncio.run(run(32)), asyncio.run(run(0))
    # a decode step waits at each stage for at most one 32-position chunk (32 ms) beside its own batch: about
    # 0.1 s over 3 stages (bounded here with room for a loaded machine), whatever the prompt's length
    assert chunked < 0.4, chunked
    assert whole > 0.8, whole  # without chunks the others wait for the whole prompt at a stage
