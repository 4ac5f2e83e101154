"""The session engine against stage replicas that speak the session protocol (tests/support/fake_session_stage.py):
affinity, prefill then one position per step, freeing, KV admission, failover by replay, bounded replays."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import pytest
from aiohttp import web
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.router import StaticReplica, StaticReplicas
from quart_stage.errors import QuartError
from support.fake_session_stage import EOS, FakeStage, reference

GREEDY = {"temperature": 0.0, "top_p": 1.0, "seed": None}


class Pipeline:
    """Fake stage replicas on ephemeral ports: ``layout[i]`` replicas for stage i."""

    def __init__(self, layout: tuple[int, ...], **stage_args) -> None:
        self.layout = layout
        self.stage_args = stage_args
        self.fakes: dict[str, FakeStage] = {}
        self.runners: dict[str, web.AppRunner] = {}
        self.source = StaticReplicas(slots=1)

    async def __aenter__(self) -> Pipeline:
        for i, count in enumerate(self.layout):
            fn = f"m-stage-{i}"
            for j in range(count):
                fake = FakeStage(i, i == len(self.layout) - 1, **self.stage_args)
                runner = web.AppRunner(fake.app(), access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, "127.0.0.1", 0)
                await site.start()
                port = runner.addresses[0][1]
                rid = f"{fn}#{j}"
                self.fakes[rid], self.runners[rid] = fake, runner
                self.source.replicas.setdefault(fn, []).append(StaticReplica(rid, f"http://127.0.0.1:{port}/"))
        return self

    async def kill(self, rid: str) -> None:
        await self.runners[rid].cleanup()

    async def __aexit__(self, *exc) -> None:
        for runner in self.runners.values():
            with contextlib.suppress(Exception):
                await runner.cleanup()

    @property
    def stages(self) -> list[str]:
        return [f"m-stage-{i}" for i in range(len(self.layout))]


def engine_for(pipe: Pipeline, **config) -> SessionEngine:
    # the fake replicas speak the one-session step protocol only (batched steps: tests/integration/test_decode_batching.py)
    return SessionEngine(pipe.source, GenerationConfig(**{"replica_wait_s": 0.5, "decode_batch_max": 1, **config}))


async def _generate(engine: SessionEngine, pipe: Pipeline, prompt: list[int], n: int, on_token=None):
    session = await engine.open("m", pipe.stages, prompt, n, GREEDY, frozenset({EOS}))
    out = []
    async for token in engine.tokens(session):
        out.append(token)
        if on_token is not None:
            await on_token(len(out), session)
    return out, session


def test_prefill_once_then_one_position_per_step_and_the_caches_are_freed() -> None:
    async def main():
        async with Pipeline((1, 1, 1)) as pipe:
            engine = engine_for(pipe)
            prompt = [10, 20, 30, 40]
            tokens, session = await _generate(engine, pipe, prompt, 12)
            assert tokens == reference(prompt, 12)
            assert session.finish_reason == "length" and session.replays == 0
            for fake in pipe.fakes.values():
                assert fake.calls == 12  # one prefill + 11 decode steps, each on the pinned replica
                assert fake.sessions == {} and fake.ended == [session.id]  # the last step carried Session-End
            assert engine.book.reserved == {} and engine.active == {}
            await engine.close()
    asyncio.run(main())


def test_sessions_pin_a_replica_per_stage_and_run_concurrently() -> None:
    async def main():
        async with Pipeline((2, 2)) as pipe:
            engine = engine_for(pipe)
            prompts = [[i + 1, 2 * i + 5] for i in range(4)]
            results = await asyncio.gather(*(_generate(engine, pipe, p, 8) for p in prompts))
            for p, (tokens, _) in zip(prompts, results, strict=True):
                assert tokens == reference(p, 8)
            per_replica = sorted(f.calls for f in pipe.fakes.values())
            assert per_replica == [16, 16, 16, 16]  # two sessions on each replica, 8 steps each: spread, then pinned
            await engine.close()
    asyncio.run(main())


def test_eos_ends_the_stream_and_an_early_stop_deletes_the_caches() -> None:
    async def main():
        async with Pipeline((1, 1), eos_after=3) as pipe:
            engine = engine_for(pipe)
            tokens, session = await _generate(engine, pipe, [5, 6], 10)
            assert tokens[-1] == EOS and len(tokens) == 4 and session.finish_reason == "stop"
            await asyncio.sleep(0.2)  # the DELETEs run in the background
            for fake in pipe.fakes.values():
                assert fake.sessions == {} and fake.deleted == [session.id]
            # the consumer stops early (a stop string, a client gone): closing the iterator frees the caches
            session = await engine.open("m", pipe.stages, [7, 8], 10, GREEDY, frozenset())
            async with contextlib.aclosing(engine.tokens(session)) as it:
                async for _ in it:
                    break
            await asyncio.sleep(0.2)
            assert all(f.sessions == {} for f in pipe.fakes.values()) and engine.book.reserved == {}
            await engine.close()
    asyncio.run(main())


def test_a_session_that_cannot_be_placed_is_refused_at_the_entry_with_retry_after() -> None:
    async def main():
        async with Pipeline((1, 1)) as pipe:
            engine = engine_for(pipe, kv_tokens=100, retry_after_s=3, room_wait_s=0.2)
            first = await engine.open("m", pipe.stages, [1] * 40, 40, GREEDY, frozenset())
            with pytest.raises(QuartError) as refused:
                await engine.open("m", pipe.stages, [1] * 10, 20, GREEDY, frozenset())  # 80 + 30 > 100
            assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "3"
            assert "within 0.2 s of waiting" in refused.value.message  # it waited its bound in line first
            assert engine.book.reserved == {"m-stage-0#0": 80, "m-stage-1#0": 80}  # the refusal booked nothing
            engine.finish(first)
            second = await engine.open("m", pipe.stages, [1] * 10, 20, GREEDY, frozenset())
            engine.finish(second)
            await engine.close()
    asyncio.run(main())


def test_sessions_without_room_wait_in_line_and_get_it_in_arrival_order_as_it_frees() -> None:
    async def main():
        async with Pipeline((1, 1), delay_s=0.01, cap=100) as pipe:  # a session runs ~0.6 s
            engine = engine_for(pipe, kv_tokens=100, room_wait_s=30.0)
            engine.room.poll_s = 30.0  # only a release wakes the head: no polling in this test
            order: list[int] = []

            async def one(i: int):
                prompt = [i + 1] * 40
                session = await engine.open("m", pipe.stages, prompt, 30, GREEDY, frozenset())  # 70 of 100
                order.append(i)
                out = [t async for t in engine.tokens(session)]
                assert out == reference(prompt, 30)

            tasks = []
            for i in range(4):
                tasks.append(asyncio.create_task(one(i)))
                await asyncio.sleep(0.02)  # arrival order 0, 1, 2, 3
            await asyncio.sleep(0.05)
            assert order == [0] and engine.room.waiting("m-stage-0") == 3
            # the controller's view counts the line as demand: 1 session holding 70, 3 waiting for 70 each
            assert engine.stage_generation("m-stage-0") == (4, 280, 100)
            assert engine.group_chains.demand("m-stage-0").waiting == 3  # ParaServe's keep rule counts them too
            assert engine.room.head_positions("m-stage-0") == 70 and engine.room.head_positions("other") == 0
            gone = asyncio.create_task(one(9))  # a fifth whose client goes away while it waits
            await asyncio.sleep(0.02)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            assert engine.room.waiting("m-stage-0") == 3 and engine.room.waiting_positions("m-stage-0") == 210
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert order == [0, 1, 2, 3] and engine.room.counts.waited == 3
            assert engine.book.reserved == {} and engine.active == {} and engine.room.waiting_positions("m-stage-0") == 0
            await engine.close()
    asyncio.run(main())


def test_a_replica_killed_mid_stream_is_replaced_by_replay_and_the_tokens_are_identical() -> None:
    async def main():
        async with Pipeline((1, 2, 1)) as pipe:
            engine = engine_for(pipe)
            prompt = [3, 1, 4, 1, 5, 9, 2, 6]

            async def kill_pinned(count, session):
                if count == 5:
                    await pipe.kill(session.replicas[1].id)
            tokens, session = await _generate(engine, pipe, prompt, 16, kill_pinned)
            assert tokens == reference(prompt, 16) and session.replays == 1
            survivor = session.replicas[1]
            assert pipe.fakes[survivor.id].calls == 16 - 5  # the replay (prompt + 5 tokens) gave token 6, then one a step
            assert pipe.fakes[survivor.id].prompts == {session.id: len(prompt) + 5}
            await engine.close()
    asyncio.run(main())


def test_a_replica_that_lost_the_session_answers_409_and_the_session_is_replayed_there() -> None:
    async def main():
        async with Pipeline((1, 1)) as pipe:
            engine = engine_for(pipe)
            prompt = [9, 8, 7]

            async def restart(count, session):
                if count == 4:
                    pipe.fakes["m-stage-1#0"].sessions.clear()  # a restarted replica: its caches are gone
            tokens, session = await _generate(engine, pipe, prompt, 10, restart)
            assert tokens == reference(prompt, 10) and session.replays == 1
            assert session.replicas[1].id == "m-stage-1#0"
            await engine.close()
    asyncio.run(main())


def test_replays_are_bounded_and_the_failure_is_explicit() -> None:
    async def main():
        async with Pipeline((1, 1)) as pipe:
            engine = engine_for(pipe, max_replays=2)
            pipe.fakes["m-stage-1#0"].fail_next = 100  # HTTP 500 every time; no other replica
            session = await engine.open("m", pipe.stages, [1, 2], 4, GREEDY, frozenset())
            with pytest.raises(QuartError) as failed:
                async for _ in engine.tokens(session):
                    pass
            assert failed.value.status in (502, 503)
            assert engine.book.reserved == {} and engine.active == {}
            await engine.close()
    asyncio.run(main())


def test_steps_of_different_sessions_overlap_across_the_stages() -> None:
    """Three sessions on one replica per stage (each serving one step at a time, 30 ms a step): while one
    session's step is at stage 2, another's runs at stage 0, so the three take far less than one after
    another (serial: 3 sessions x 10 steps x 3 stages x 30 ms = 2.7 s)."""
    async def main():
        async with Pipeline((1, 1, 1)) as pipe:
            for fake in pipe.fakes.values():
                fake.delay_s = 0.03
            engine = engine_for(pipe)
            started = time.monotonic()
            results = await asyncio.gather(*(_generate(engine, pipe, [i + 1, 7], 10) for i in range(3)))
            took = time.monotonic() - started
            assert [r[0] for r in results] == [reference([i + 1, 7], 10) for i in range(3)]
            assert took < 0.75 * 2.7, took  # pipelined: ~(3 x 10 + 2) steps of 30 ms = ~1 s
            await engine.close()
    asyncio.run(main())


@dataclass
class _Leavable:
    """A replica whose state the test sets (the gateway's Endpoint: ready → draining)."""

    id: str
    url: str
    in_flight: int = 0
    layers: tuple[int, int] | None = None
    held: tuple[int, int] | None = None
    state: str = "ready"


def test_sessions_on_a_draining_replica_move_by_replay_and_the_tokens_are_identical() -> None:
    async def main():
        async with Pipeline((1, 2, 1)) as pipe:
            for fn, replicas in pipe.source.replicas.items():
                pipe.source.replicas[fn] = [_Leavable(r.id, r.url) for r in replicas]
            engine = engine_for(pipe)
            prompts = [[i + 2, 3 * i + 1, 7] for i in range(4)]
            seen: dict[str, object] = {}
            leaving: list[_Leavable] = []

            async def drain_at_4(count, session):
                if count == 4 and not leaving:  # the first session to get 4 tokens: its stage-1 replica leaves
                    seen["before"] = engine.stage_generation("m-stage-1")
                    replica = session.replicas[1]
                    replica.state = "draining"  # as the reconciler's retire does: out of the ready list
                    pipe.source.replicas["m-stage-1"].remove(replica)
                    leaving.append(replica)
                    seen["held"] = engine.book.booked(replica.id)
            results = await asyncio.gather(*(_generate(engine, pipe, p, 16, drain_at_4) for p in prompts))
            for p, (tokens, session) in zip(prompts, results, strict=True):
                assert tokens == reference(p, 16) and session.replays == 0
            [gone] = leaving
            assert seen["before"] == (4, 4 * 19, 2 * 4096)  # 4 sessions of 3 + 16 positions; 2 replicas' reported caps
            assert seen["held"] > 0  # it held sessions when it began to drain
            assert engine.moves >= 1 and sum(s.moves for _, s in results) == engine.moves
            assert engine.book.booked(gone.id) == 0
            await asyncio.sleep(0.2)  # the old ids' DELETEs run in the background
            assert pipe.fakes[gone.id].sessions == {}
            assert engine.stage_generation("m-stage-1") == (0, 0, 4096)  # one ready replica left
            await engine.close()
    asyncio.run(main())
