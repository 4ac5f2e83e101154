"""ParaServe with generation through the gateway's session engine (issue 29): while a stage is served only by a
group's three part replicas (a real tiny llama on loopback, each part answering for the layers it holds), sessions
opened by `SessionEngine` run on the chain of parts, each part keeping the KV cache of its layers; when one part
becomes whole, every session's caches are gathered onto it (verified bytes) and the streams go on there with no
re-prefill, their tokens those of transformers' ``generate``. A corrupted move is refused and the session
replays there (counted), with the same tokens."""

from __future__ import annotations

import asyncio
import threading

import pytest
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.router import StaticReplica, StaticReplicas
from quart_stage.app import create_app
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from support.tiny_llama import STAGE, prompts, tiny_llama
from werkzeug.serving import make_server

PROMPTS = prompts(9, 5, 13)
NEW, BEFORE = 20, 5  # tokens in all; the first part becomes whole after the first session's 5th token
FN = "g-stage-0"
PARTS = [(0, 3), (3, 6), (6, 8)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("paragroup") / "llama")
    return d, tiny_llama(d, "paragroup", 5, PROMPTS, NEW)


class Part:
    """A replica of the whole stage on a loopback port that says it holds ``held`` (a ParaServe part: its own
    layers first; 503 for layers it does not hold), widened by the test."""

    def __init__(self, model_dir: str, held: tuple[int, int]) -> None:
        self.held = held
        self.rt = StageRuntime.load(StageConfig(model_dir=model_dir))
        self.rt.held = lambda: self.held
        self.server = make_server("127.0.0.1", 0, create_app(self.rt), threaded=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/"


@pytest.fixture
def group(model):
    parts = [Part(model[0], (a, a) if i == 2 else (a, b)) for i, (a, b) in enumerate(PARTS)]  # p2: no bytes yet
    yield parts
    for p in parts:
        p.server.shutdown()


def _run(parts: list[Part], corrupt: bool = False):
    source = StaticReplicas(slots=8)
    source.replicas[FN] = [StaticReplica(f"p{i}", p.url, layers=STAGE, held=p.held, part=span)
                           for i, (p, span) in enumerate(zip(parts, PARTS, strict=True))]
    seen: dict[str, object] = {}

    async def main():
        engine = SessionEngine(source, GenerationConfig(replica_wait_s=5.0, step_timeout_s=30.0))
        if corrupt:
            real = engine.group_chains.install_part

            async def flipped(session_id, fed, reserve, whole, data):  # one bit of the last tensor flips in transit
                await real(session_id, fed, reserve, whole, data[:-1] + bytes([data[-1] ^ 1]))

            engine.group_chains.install_part = flipped
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, lambda: setattr(parts[2], "held", PARTS[2]))  # the last part's bytes arrive

        async def one(i: int, prompt: list[int]):
            session = await engine.open("paragroup", [FN], prompt, NEW, {"temperature": 0.0}, frozenset())
            seen[f"chain{i}"] = [(r.id, span) for r, span in session.chains[0].hops]
            out = []
            async for token in engine.tokens(session):
                out.append(token)
                if len(out) == 2:
                    seen[f"used{i}"] = [p.rt.generation.table.held(session.id) for p in parts]
                if len(out) == BEFORE and i == 0:
                    parts[0].held = STAGE  # the first worker holds the whole stage: its next answer says so
                await asyncio.sleep(0.01)
            return out, session

        try:
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        finally:
            await engine.close()
        return results, engine

    results, engine = asyncio.run(main())
    return [out for out, _ in results], [s for _, s in results], engine, seen


def test_sessions_open_on_the_group_and_consolidate_by_kv_migration_with_generate_tokens(model, group):
    _, expected = model
    got, sessions, engine, seen = _run(group)
    assert got == expected
    assert seen["chain0"] == [("p0", (0, 3)), ("p1", (3, 6)), ("p2", (6, 8))]  # no whole replica: the group's parts
    assert all(n > 0 for n in seen["used0"])  # each part held the session's cache of its own layers
    assert (engine.group_chains.migrations, engine.group_chains.reprefills) == (len(PROMPTS), 0) and engine.group_chains.kv_moved_bytes > 0
    assert all(s.replays == 0 and s.reprefills == 0 and not s.chains for s in sessions)
    assert all(s.replicas[0].id == "p0" for s in sessions)
    assert engine.book.reserved == {}
    for part in group:  # every cache freed: the moved parts' copies and the finished sessions
        for _ in range(100):
            if part.rt.generation.table.used == 0:
                break
            threading.Event().wait(0.02)
        assert part.rt.generation.table.used == 0, part.rt.generation.table.snapshot()


def test_a_corrupted_move_is_refused_and_the_session_replays_with_the_same_tokens(model, group):
    _, expected = model
    got, sessions, engine, _ = _run(group, corrupt=True)
    assert got == expected
    assert engine.group_chains.migrations == 0 and engine.group_chains.reprefills == len(PROMPTS)
    assert all(s.reprefills == 1 and s.replays == 0 for s in sessions)
    assert engine.book.reserved == {}
