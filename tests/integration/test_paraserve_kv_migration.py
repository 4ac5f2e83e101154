"""ParaServe with generation (issue 29): a session runs over a group of three part replicas of the ``tiny``
decoder (real weights, loopback HTTP), each holding the KV cache of its own layers; the group consolidates onto
one worker by KV-cache migration (verified bytes), and the tokens are transformers-identical to an undisturbed
run with no re-prefill. A corrupted migration is refused by the receiving replica and the session falls back to a
replay (counted)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
import torch
from gateway_plugin.generation.paragroup import GroupGenerator, GroupSession, Hop
from quart_stage import kvmigrate
from quart_stage.app import create_app
from quart_stage.manifest import Manifest
from quart_stage.runtime import read_stage_file
from quart_tools.partition import partition
from quart_tools.stagechain import cut_runtimes, generate
from werkzeug.serving import make_server

PROMPT = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(3)).tolist()
NEW, BEFORE = 12, 5  # tokens in all; tokens generated on the group before it consolidates


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Three replicas of the whole one-stage ``tiny`` model on loopback (each runs the layer range it is asked
    for, as a part replica does) and the undisturbed run's tokens."""
    root = str(tmp_path_factory.mktemp("paragen") / "tiny")
    partition("tiny", 1, root, progress=False)
    manifest = Manifest.load(root)
    tensors = read_stage_file(root, manifest.stages[0])
    expected = generate(cut_runtimes(root, manifest, tensors, [0, manifest.stages[0].end]), PROMPT, NEW).tokens
    servers, urls = [], []
    for _ in range(3):
        (rt,) = cut_runtimes(root, manifest, tensors, [0, manifest.stages[0].end])
        server = make_server("127.0.0.1", 0, create_app(rt), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{server.server_port}/")
    end = manifest.stages[0].end
    cuts = [0, end // 3, 2 * end // 3, end]
    yield urls, [(a, b) for a, b in zip(cuts, cuts[1:], strict=False)], expected
    for server in servers:
        server.shutdown()


def _run(urls, spans, corrupt: bool = False):
    async def main():
        async with aiohttp.ClientSession() as http:
            gen = GroupGenerator(http)
            if corrupt:
                real = gen.install

                async def flipped(session_id, fed, reserve, whole, data):  # one bit of the last tensor flips
                    await real(session_id, fed, reserve, whole, data[:-1] + bytes([data[-1] ^ 1]))

                gen.install = flipped
            s = GroupSession(list(PROMPT), NEW, seed=0, hops=[Hop(u, span) for u, span in zip(urls, spans, strict=True)])
            while len(s.generated) < BEFORE:
                s.generated.append(await gen.step(s))
            report = await gen.consolidate([s], Hop(urls[0]))
            await gen.run(s)
            return s, report
    return asyncio.run(main())


def test_consolidation_migrates_the_kv_cache_and_the_tokens_are_identical(workers):
    urls, spans, expected = workers
    s, report = _run(urls, spans)
    assert s.generated == expected
    assert (report.sessions, report.migrated, report.reprefills, s.reprefills) == (1, 1, 0, 0), report.failures
    assert report.bytes > 0 and s.hops == [Hop(urls[0])]


def test_a_corrupted_migration_is_refused_and_the_session_replays(workers):
    urls, spans, expected = workers
    s, report = _run(urls, spans, corrupt=True)
    assert (report.migrated, report.reprefills, s.reprefills) == (0, 1, 1)
    assert "sha256" in report.failures[0] or "400" in report.failures[0]
    assert s.generated == expected  # the replay on the whole worker gives the same tokens


def test_the_export_format_is_verified_before_anything_changes():
    state = kvmigrate.EmulatedKV(seed=7, width=8)
    state.append([5, 6, 7], range(1, 3))
    body = kvmigrate.encode("s1", 3, (0, 4), kvmigrate.cache_tensors(state, (0, 4), 4), seed=7)
    tensors, meta = kvmigrate.decode(body, "s1", 3)
    assert set(tensors) == {"ids", "k.1", "v.1", "k.2", "v.2"} and meta["seed"] == 7
    target = kvmigrate.EmulatedKV(seed=7, width=8)
    kvmigrate.install(target, tensors, 3)
    assert target.token(32000) == state.token(32000) and torch.equal(target.layers[2][1], state.layers[2][1])
    for bad in (body[:-1] + bytes([body[-1] ^ 1]), body[:40], b"\x00" * 16):
        with pytest.raises(Exception) as err:
            kvmigrate.decode(bad, "s1", 3)
        assert getattr(err.value, "status", 400) == 400
    with pytest.raises(Exception, match="not 's2'"):
        kvmigrate.decode(body, "s2", 3)


def test_emulated_sessions_scale_up_onto_two_whole_workers(tmp_path):
    """The bench's emulated decoder (real stage bytes, emulated steps): four sessions over three parts move to
    two whole workers (the scale-up choice), every KV byte verified, and answer the emulation's own tokens."""
    from quart_tools.bench.blitzscale import build_stage
    from quart_tools.bench.paraserve_gen import expected_tokens

    root = str(build_stage(tmp_path, 40, 8, 10.0))
    manifest = Manifest.load(root)
    tensors, end = read_stage_file(root, manifest.stages[0]), manifest.stages[0].end
    servers, urls = [], []
    for _ in range(3):
        (rt,) = cut_runtimes(root, manifest, tensors, [0, end], compute="emulated", emulated_mean_ms=10.0,
                             emulated_decode_ms=5.0, emulated_prefill_ms_per_token=0.1, emulated_cv=0.0)
        server = make_server("127.0.0.1", 0, create_app(rt), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        urls.append(f"http://127.0.0.1:{server.server_port}/")
    cuts = [0, 3, 6, end]
    vocab = int(manifest.config["vocab_size"])

    async def main():
        async with aiohttp.ClientSession() as http:
            gen = GroupGenerator(http)
            hops = [Hop(u, span) for u, span in zip(urls, zip(cuts, cuts[1:], strict=False), strict=True)]
            sessions = [GroupSession(list(range(i, i + 20)), 30, 1000 + i, list(hops)) for i in range(4)]
            tasks = [asyncio.ensure_future(gen.run(s)) for s in sessions]
            while min(len(s.generated) for s in sessions) < 3:
                await asyncio.sleep(0.01)
            report = await gen.consolidate(sessions, [Hop(urls[0]), Hop(urls[1])])
            await asyncio.gather(*tasks)
            return sessions, report

    try:
        sessions, report = asyncio.run(main())
    finally:
        for server in servers:
            server.shutdown()
    assert (report.sessions, report.migrated, report.reprefills) == (4, 4, 0), report.failures
    assert report.bytes > 4 * 20 * 5 * 2 * 4  # keys and values of ≥ 20 positions x 5 moved blocks, fp32
    assert {s.hops[0].url for s in sessions} == {urls[0], urls[1]}
    assert all(s.generated == expected_tokens(s.prompt, s.seed, 30, vocab) for s in sessions)
