"""ParaServe with generation, the KV-cache moves (issue 29): the export format is verified before anything changes,
and the bench's emulated decoder (real stage bytes, emulated steps) scales a group of three parts up onto two whole
workers through the gateway's session engine, every KV byte verified, each session answering the emulation's own
tokens. The tiny llama's tokens through a consolidation: `test_paraserve_group_sessions.py`."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.router import StaticReplica, StaticReplicas
from quart_stage import kvmigrate
from quart_stage.app import create_app
from quart_stage.manifest import Manifest
from quart_stage.runtime import read_stage_file
from quart_tools.stagechain import cut_runtimes
from werkzeug.serving import make_server


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
    """Four sessions over three parts; two parts become whole (the scale-up choice keeps two workers): the sessions
    move onto both, the least booked first, every KV byte verified, no re-prefill."""
    from quart_tools.bench.blitzscale import build_stage
    from quart_tools.bench.paraserve_gen import expected_tokens

    root = str(build_stage(tmp_path, 40, 8, 10.0))
    manifest = Manifest.load(root)
    tensors, end = read_stage_file(root, manifest.stages[0]), manifest.stages[0].end
    cuts = [0, 3, 6, end]
    spans = list(zip(cuts, cuts[1:], strict=False))
    servers, source, held = [], StaticReplicas(slots=8), list(spans)  # what each part says it holds
    for i, span in enumerate(spans):
        (rt,) = cut_runtimes(root, manifest, tensors, [0, end], compute="emulated", emulated_mean_ms=10.0,
                             emulated_decode_ms=5.0, emulated_prefill_ms_per_token=0.1, emulated_cv=0.0)
        rt.held = lambda i=i: held[i]
        server = make_server("127.0.0.1", 0, create_app(rt), threaded=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        source.replicas.setdefault("s", []).append(StaticReplica(f"p{i}", f"http://127.0.0.1:{server.server_port}/",
                                                                 layers=(0, end), held=span, part=span))
    vocab = int(manifest.config["vocab_size"])

    async def one(engine, i: int, seen: list):
        session = await engine.open(manifest.model, ["s"], list(range(i, i + 20)), 30, {"seed": 1000 + i}, frozenset())
        out = []
        async for token in engine.tokens(session):
            out.append(token)
            if len(out) == 3:
                seen.append(i)
                while len(seen) < 4:  # every session holds 3 tokens on the group before two parts are whole
                    await asyncio.sleep(0.01)
                held[0] = held[1] = (0, end)  # their next answers say so
        return out, session

    async def main():
        engine, seen = SessionEngine(source, GenerationConfig(replica_wait_s=5.0)), []
        try:
            return await asyncio.gather(*(one(engine, i, seen) for i in range(4))), engine
        finally:
            await engine.close()

    try:
        results, engine = asyncio.run(main())
    finally:
        for server in servers:
            server.shutdown()
    assert (engine.group_chains.migrations, engine.group_chains.reprefills) == (4, 0)
    assert engine.group_chains.kv_moved_bytes > 4 * 20 * 5 * 2 * 4  # keys and values of ≥ 20 positions x 5 moved blocks, fp32
    assert sorted(s.replicas[0].id for _, s in results) == ["p0", "p0", "p1", "p1"]
    assert all(out == expected_tokens(list(range(i, i + 20)), 1000 + i, 30, vocab)
               for i, (out, _) in enumerate(results))
