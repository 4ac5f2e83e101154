"""KeysManager part start (issue 17, ParaServe): a start that names a part of its stage fetches the header and that
part first (ranged reads, verified per layer), serves it at once (503 for the rest, outputs equal to the whole
stage's), grows its verified range both ways while the rest arrives, and ends a whole replica whose folder is
complete; a corrupt or broken range is fetched from the next source and never served.

The bytes come from a fake peer answering ``Range`` requests, each layer behind a gate the test opens (the
header is ungated), so the order in which layers verify is under the test's control; the manifest and the
fallback come from the registry (moto's S3 server), as in production.
"""

from __future__ import annotations

import json
import re
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import requests
from quart_stage import wire
from support.gated_peer import GatedServer
from support.keysmanager import preloaded_daemon
from support.live_registry import IDS, URL, reference_answer

from keysmanager.client import KeysManagerError
from keysmanager.parts import fetch_order, grow
from keysmanager.peers import SHA_HEADER, SIZE_HEADER
from keysmanager.types import StageSpec


class RangePeer(GatedServer):
    """A fake peer KeysManager answering ``Range`` reads of the stage file; a range waits for the gates of the
    layers it touches (the header alone is ungated). ``corrupt``: flip a byte of that layer; ``die_at``: close
    the connection instead of sending that layer. ``asked`` records the ranges asked for, in order."""

    def __init__(self, data: bytes, sha: str, spans: list[list[int]], header: int, corrupt: int | None = None,
                 die_at: int | None = None) -> None:
        super().__init__(data, spans, corrupt, die_at)
        self.sha, self.header = sha, header
        self.asked: list[tuple[int, int]] = []
        self.serve(_Ranges)


class _Ranges(BaseHTTPRequestHandler):
    peer: RangePeer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        peer = self.peer
        m = re.match(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        start, end = int(m.group(1)), int(m.group(2)) + 1
        peer.asked.append((start, end))
        self.send_response(206)
        self.send_header(SHA_HEADER, peer.sha)
        self.send_header(SIZE_HEADER, str(len(peer.data)))
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if end <= peer.header:  # the header alone: ungated
            self.wfile.write(peer.data[start:end])
            return
        peer.send_layers(self, start, end)  # layer by layer, each behind its gate


@pytest.fixture
def km(monkeypatch):
    monkeypatch.setenv("KM_PART_READ_TIMEOUT_S", "120")  # a gated range waits for the test, not for a timeout
    with preloaded_daemon("part") as d:  # a part start forks at once
        yield d


def _peer(registry, **kw) -> RangePeer:  # noqa: F811 - the fixture's value
    _, model, manifest = registry
    entry = manifest.stage(0)
    return RangePeer((model / entry.file).read_bytes(), entry.sha256, entry.layer_bytes, entry.header_bytes, **kw)


def _spec(name: str) -> StageSpec:
    return StageSpec(name, env={"QUART_MODEL_URL": URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "cpu"})


def _reference(registry, body: bytes, layers: str) -> bytes:  # noqa: F811
    """What the whole stage, loaded the ordinary way, answers for ``layers`` (the wire body)."""
    return reference_answer(registry, body, layers)


def _ask(url: str, body: bytes, layers: str | None) -> requests.Response:
    ctype = "application/json" if body.startswith(b"{") else wire.CONTENT_TYPE
    return requests.post(url, data=body, headers={"Content-Type": ctype, **({"X-Quart-Layers": layers} if layers
                                                                              else {})}, timeout=30)


def _held(url: str) -> str:
    """What the replica says it holds (every answer says it, a 503 too)."""
    return _ask(url, json.dumps({"input_ids": IDS}).encode(), "0-1").headers.get("X-Quart-Layers-Held", "")


def _wait_held(url: str, want: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (held := _held(url)) != want:
        assert time.monotonic() < deadline, f"held {held}, waiting for {want}"
        time.sleep(0.02)


def _same(a: bytes, b: bytes) -> bool:
    ta, tb = wire.decode(a).tensors, wire.decode(b).tensors
    return ta.keys() == tb.keys() and all(ta[k].equal(tb[k]) for k in ta)


def test_fetch_order_keeps_the_verified_range_contiguous() -> None:
    assert fetch_order(6, (2, 4), header_first=False) == [[2, 3], [4, 5], [0, 1]]
    assert fetch_order(6, (2, 4), header_first=True) == [[0], [2, 3], [4, 5], [1]]
    assert fetch_order(4, (0, 2), header_first=True) == [[0, 1], [2, 3]]
    assert fetch_order(4, (2, 4), header_first=False) == [[2, 3], [0, 1]]
    assert grow({0}, (2, 4)) == (0, 0)  # the header's layer alone serves nothing of the part
    assert grow({0, 2}, (2, 4)) == (2, 3)
    assert grow({0, 1, 2, 3, 4}, (2, 4)) == (0, 5)


def test_part_start_serves_its_part_first_then_grows_both_ways_to_a_whole_replica(registry, km) -> None:  # noqa: F811
    peer = _peer(registry)
    ids = json.dumps({"input_ids": IDS}).encode()
    try:
        spec = _spec("part-llama-0")
        peer.open(2)
        [info] = km.client.start(spec, live=True, layers=[2, 4], peers=[peer.url])
        assert info.live and info.layers == [0, 6] and info.layers_held == [2, 3], info
        # the header and the part (one ranged read) came first: nothing before the part was asked for
        spans = registry[2].stage(0).layer_bytes
        assert set(peer.asked[:2]) == {(0, registry[2].stage(0).header_bytes), (spans[2][0], spans[3][1])}
        into_2 = _reference(registry, ids, "0-2")
        ok = _ask(info.url, into_2, "2-3")
        assert ok.status_code == 200, ok.text
        assert ok.headers["X-Quart-Layers-Held"] == "2-3" and _same(ok.content, _reference(registry, into_2, "2-3"))
        for body, layers in ((ids, "0-1"), (ids, None), (into_2, "2-4")):
            refused = _ask(info.url, body, layers)
            assert refused.status_code == 503 and refused.json()["field"] == "layers", refused.text
        peer.open(3)
        _wait_held(info.url, "2-4")
        peer.open(4, 5)
        _wait_held(info.url, "2-6")
        [now] = [r for r in km.client.replicas(spec.function) if r.id == info.id]
        assert now.layers_held == [2, 6] and now.live
        assert _ask(info.url, ids, "0-1").status_code == 503
        peer.open(1)
        time.sleep(0.3)
        assert _held(info.url) == "2-6"  # layers [0, 2) come in one read: the range grows once both match
        peer.open(0)
        _wait_held(info.url, "0-6")
        whole = _ask(info.url, ids, None)
        assert whole.status_code == 200 and _same(whole.content, _reference(registry, ids, "0-6"))
        deadline = time.monotonic() + 30
        while km.client.stage(spec.function)["state"] != "held":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        [done] = [r for r in km.client.replicas(spec.function) if r.id == info.id]
        assert done.layers_held == [0, 6] and not done.live
        _, model, manifest = registry
        held = next(Path(km.state_dir).rglob(manifest.stage(0).file))
        assert held.read_bytes() == (model / manifest.stage(0).file).read_bytes()
        [later] = km.client.start(spec)  # the folder is complete: the normal zygote path
        assert not later.live and later.layers == later.layers_held == [0, 6]
        assert not list(Path(km.state_dir).rglob("*.partial"))
    finally:
        peer.close()


@pytest.mark.parametrize("fault", ["corrupt", "die"])
def test_a_bad_range_is_never_served_and_comes_from_the_registry(registry, km, fault) -> None:  # noqa: F811
    peer = _peer(registry, **({"corrupt": 3} if fault == "corrupt" else {"die_at": 3}))
    ids = json.dumps({"input_ids": IDS}).encode()
    try:
        spec = _spec(f"part-llama-{fault}")
        peer.open(*range(6))
        [info] = km.client.start(spec, live=True, layers=[2, 4], peers=[peer.url])
        _wait_held(info.url, "0-6")  # layer 3 from the registry (the last source), the rest from the peer
        into_2 = _reference(registry, ids, "0-2")
        ok = _ask(info.url, into_2, "2-4")
        assert ok.status_code == 200 and _same(ok.content, _reference(registry, into_2, "2-4"))
        whole = _ask(info.url, ids, None)
        assert whole.status_code == 200 and _same(whole.content, _reference(registry, ids, "0-6"))
    finally:
        peer.close()


def test_a_part_outside_the_stage_or_malformed_is_refused_naming_layers(registry, km) -> None:  # noqa: F811
    for layers in ([4, 9], [3, 3], [1], ["a", 2]):
        with pytest.raises(KeysManagerError) as err:
            km.client.start(_spec("part-llama-bad"), live=True, layers=layers)
        assert err.value.status == 400 and err.value.field == "layers", err.value
