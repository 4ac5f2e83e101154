"""KeysManager live start (issue 16 item 3): a replica started on a stage file that is still arriving serves
the layers verified so far (503 for the rest, equal outputs), grows as layers verify, and ends a full replica;
a corrupt layer or a peer dying mid-transfer is never served and the transfer recovers from another source.

The stage bytes come from fake peers (a thread each) that send the file layer by layer, each layer behind a
gate the test opens: the writer's progress is under the test's control, no timing guesses. The manifest comes
from the registry (moto's S3 server on an ephemeral port), as in production.
"""

from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import requests
import torch
from quart_stage import wire
from quart_stage.manifest import Manifest
from support.gated_peer import GatedServer
from support.keysmanager import preloaded_daemon
from support.live_registry import IDS, URL, reference_answer

from keysmanager.peers import SHA_HEADER, SIZE_HEADER
from keysmanager.types import StageSpec


class GatedPeer(GatedServer):
    """A fake peer KeysManager serving the stage file layer by layer, each behind a gate; ``corrupt`` flips a
    byte of that layer, ``die_at`` closes the connection before that layer."""

    def __init__(self, data: bytes, sha: str, spans: list[list[int]], corrupt: int | None = None,
                 die_at: int | None = None) -> None:
        super().__init__(data, spans, corrupt, die_at)
        self.sha = sha
        self.serve(_WholeFile)


class _WholeFile(BaseHTTPRequestHandler):
    peer: GatedPeer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        peer = self.peer
        self.send_response(200)
        self.send_header(SHA_HEADER, peer.sha)
        self.send_header(SIZE_HEADER, str(len(peer.data)))
        self.send_header("Content-Length", str(len(peer.data)))
        self.end_headers()
        peer.send_layers(self, 0, len(peer.data))


@pytest.fixture
def km():
    with preloaded_daemon("live") as d:  # a live start then forks at once (peers time out at 10 s)
        yield d


def _peer(registry, **kw) -> GatedPeer:
    _, model, manifest = registry
    entry = manifest.stage(0)
    return GatedPeer((model / entry.file).read_bytes(), entry.sha256, entry.layer_bytes, **kw)


def _ask(url: str, body: bytes, ctype: str, layers: str | None) -> requests.Response:
    headers = {"Content-Type": ctype, **({"X-Quart-Layers": layers} if layers else {})}
    return requests.post(url, data=body, headers=headers, timeout=30)


def _wait_held(url: str, want: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (held := requests.get(url + "/_/health", timeout=5).headers.get("X-Quart-Layers-Held")) != want:
        probe = _ask(url, json.dumps({"input_ids": IDS}).encode(), "application/json", "0-1")
        held = probe.headers["X-Quart-Layers-Held"]
        if held == want:
            return
        assert time.monotonic() < deadline, f"held {held}, waiting for {want}"
        time.sleep(0.02)



def _out(body: bytes) -> torch.Tensor:
    t = wire.decode(body).tensors
    return t.get("logits", t.get("hidden_states"))


def _reference(registry, body: bytes, layers: str) -> torch.Tensor:
    """What the whole stage file, loaded the ordinary way, answers for ``layers``."""
    return _out(reference_answer(registry, body, layers))


def test_live_replica_serves_held_layers_503_for_the_rest_and_ends_full(registry, km) -> None:
    peer = _peer(registry)
    try:
        spec = StageSpec("live-llama-0", env={"QUART_MODEL_URL": URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "cpu"})
        peer.open(0)
        t0 = time.monotonic()
        [info] = km.client.start(spec, live=True, peers=[peer.url])
        assert time.monotonic() - t0 < 30
        assert info.live and info.layers == [0, 6] and info.layers_held == [0, 1], info
        ids = json.dumps({"input_ids": IDS}).encode()
        first = _ask(info.url, ids, "application/json", "0-1")
        assert first.status_code == 200, first.text
        assert first.headers["X-Quart-Layers"] == "0-1" and first.headers["X-Quart-Layers-Held"] == "0-1"
        assert torch.equal(_out(first.content), _reference(registry, ids, "0-1"))
        for layers in ("0-2", "0-6", None):
            refused = _ask(info.url, ids, "application/json", layers)
            assert refused.status_code == 503 and refused.json()["field"] == "layers"
            assert refused.headers["X-Quart-Layers-Held"] == "0-1"
        peer.open(1, 2)
        _wait_held(info.url, "0-3")
        more = _ask(info.url, first.content, wire.CONTENT_TYPE, "1-3")
        assert more.status_code == 200, more.text
        assert torch.equal(_out(more.content), _reference(registry, first.content, "1-3"))
        [now] = [r for r in km.client.replicas(spec.function) if r.id == info.id]
        assert now.layers_held == [0, 3] and now.live
        peer.open(3, 4, 5)
        _wait_held(info.url, "0-6")
        whole = _ask(info.url, ids, "application/json", None)
        assert whole.status_code == 200 and whole.headers["X-Quart-Layers"] == "0-6"
        assert torch.equal(_out(whole.content), _reference(registry, ids, "0-6"))
        deadline = time.monotonic() + 30
        while km.client.stage(spec.function)["state"] != "held":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        [done] = [r for r in km.client.replicas(spec.function) if r.id == info.id]
        assert done.layers_held == [0, 6] and not done.live and done.state == "ready"
        # the next start takes the ordinary path: the folder is complete, a zygote caches it
        [later] = km.client.start(spec)
        assert not later.live and later.layers == later.layers_held == [0, 6]
        assert not list(Path(km.state_dir).rglob("*.partial"))
    finally:
        peer.close()


@pytest.mark.parametrize("fault", ["corrupt", "die"])
def test_a_bad_layer_is_never_served_and_the_transfer_recovers_elsewhere(registry, km, fault) -> None:
    bad = _peer(registry, **({"corrupt": 2} if fault == "corrupt" else {"die_at": 2}))
    good = _peer(registry)
    try:
        spec = StageSpec(f"live-llama-{fault}", env={"QUART_MODEL_URL": URL, "QUART_STAGE_INDEX": "0",
                                                     "QUART_COMPUTE": "cpu"})
        bad.open(*range(6))  # everything; layer 2 is wrong (or never comes)
        [info] = km.client.start(spec, live=True, peers=[bad.url, good.url])
        ids = json.dumps({"input_ids": IDS}).encode()
        _wait_held(info.url, "0-2")
        time.sleep(0.3)  # the bad peer has sent all it will; the good one waits at its first gate
        for layers in ("0-3", "2-3", None):
            refused = _ask(info.url, ids, "application/json", layers)
            assert refused.status_code == 503 and refused.headers["X-Quart-Layers-Held"] == "0-2", refused.text
        ok = _ask(info.url, ids, "application/json", "0-2")
        assert ok.status_code == 200 and torch.equal(_out(ok.content), _reference(registry, ids, "0-2"))
        good.open(*range(6))
        _wait_held(info.url, "0-6")
        whole = _ask(info.url, ids, "application/json", None)
        assert torch.equal(_out(whole.content), _reference(registry, ids, "0-6"))
        deadline = time.monotonic() + 30
        while (status := km.client.stage(spec.function))["state"] != "held":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert status["source"] == good.url
        _, model, manifest = registry
        held = next(Path(km.state_dir).rglob(manifest.stage(0).file))
        assert held.read_bytes() == (model / manifest.stage(0).file).read_bytes()
        assert Manifest.load(str(held.parent)).stage(0).sha256 == manifest.stage(0).sha256
    finally:
        bad.close()
        good.close()


def test_the_preloader_says_when_it_has_imported_every_familys_model_code(km) -> None:
    """``GET /v1/health``: ``preloader`` goes ``ready`` (it forks zygotes) → ``warm`` (model code imported while idle:
    a live zygote then builds its module without importing it)."""
    deadline = time.monotonic() + 240
    while (state := km.client.health()["preloader"]) != "warm":
        assert state in ("starting", "ready") and time.monotonic() < deadline, state
        time.sleep(0.2)
