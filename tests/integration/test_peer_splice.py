"""The splice receive path of ``stream_from_peer`` (``receive="splice"``: socket → pipe → file, hashed in place
from the page cache, ``VerifiedWriter.splice_from``): equal bytes, corrupt bytes and a short body detected
(nothing left in place), a growing file forwarded on by a hop that receives by splice, a live resume that
never rewrites verified layers."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from quart_stage.progress import read_progress, write_progress
from quart_tools.bench.peer_cpu import serve_stage

from keysmanager.peers import FORWARD_BYTES, StageFile, serve_file, stream_from_peer
from keysmanager.transfer import LayerCheck, TransferError, VerifiedWriter


def _serving(handler: Callable[[web.Request], object], body: Callable[[int], None]) -> None:
    """Serve ``handler`` on an ephemeral loopback port and run ``body(port)`` in a thread (bounded)."""
    async def main() -> None:
        app = web.Application()
        app.router.add_get("/v1/stages/{function}/file", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            await asyncio.wait_for(asyncio.to_thread(body, site.port), 30)
        finally:
            await runner.cleanup()
    asyncio.run(main())


def _fetch(port: int, dest: Path, sha: str, size: int, layers: LayerCheck | None = None):
    with VerifiedWriter(dest, sha, size, layers=layers) as writer:
        return stream_from_peer(f"http://127.0.0.1:{port}", "f", None, writer, receive="splice", read_timeout_s=5)


def test_splice_receives_equal_bytes_and_hashes_them(tmp_path: Path) -> None:
    data = os.urandom((3 << 20) + 12345)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    seen = {}
    _serving(lambda r: serve_file(r, StageFile("f", src, sha, len(data))),
             lambda port: seen.update(result=_fetch(port, tmp_path / "out.bin", sha, len(data))))
    assert seen["result"].nbytes == len(data)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert not (tmp_path / "out.bin.partial").exists()


def test_splice_detects_corrupt_bytes_and_leaves_nothing(tmp_path: Path) -> None:
    data = bytearray(os.urandom(2 << 20))
    sha = hashlib.sha256(data).hexdigest()
    data[1_500_000] ^= 0xFF  # the peer serves one flipped byte under the right checksum
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    errors = []

    def body(port: int) -> None:
        with pytest.raises(TransferError, match="checksum mismatch") as info:
            _fetch(port, tmp_path / "out.bin", sha, len(data))
        errors.append(info.value)

    _serving(lambda r: serve_file(r, StageFile("f", src, sha, len(data))), body)
    assert errors and not (tmp_path / "out.bin").exists() and not (tmp_path / "out.bin.partial").exists()


def test_splice_detects_a_short_transfer(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    sha = hashlib.sha256(data).hexdigest()

    async def short(request: web.Request) -> web.StreamResponse:  # promises every byte, sends 1 MB, closes
        response = web.StreamResponse(headers={"X-Quart-Sha256": sha})
        response.content_length = len(data)
        await response.prepare(request)
        await response.write(data[:1 << 20])
        request.transport.close()
        return response

    def body(port: int) -> None:
        with pytest.raises(TransferError, match=f"got {1 << 20} bytes"):
            _fetch(port, tmp_path / "out.bin", sha, len(data))

    _serving(short, body)
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.bin.partial").exists()


def test_a_hop_receiving_by_splice_forwards_its_growing_file(tmp_path: Path) -> None:
    """source → mid (splice, serving its partial file as it grows) → tail (splice): equal bytes at both."""
    data = os.urandom(2 * FORWARD_BYTES + 777)
    sha = hashlib.sha256(data).hexdigest()
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    mid = VerifiedWriter(tmp_path / "mid.bin", sha, len(data)).__enter__()
    seen = {}

    async def main() -> None:
        src_runner, src_port = await serve_stage(StageFile("f", src, sha, len(data)))
        mid_runner, mid_port = await serve_stage(StageFile("f", mid.dest, sha, len(data), mid))

        def upstream() -> None:
            with mid:
                seen["mid"] = stream_from_peer(f"http://127.0.0.1:{src_port}", "f", None, mid, receive="splice")

        hop = threading.Thread(target=upstream, daemon=True)
        hop.start()
        try:
            seen["tail"] = await asyncio.wait_for(
                asyncio.to_thread(_fetch, mid_port, tmp_path / "tail.bin", sha, len(data)), 30)
            await asyncio.to_thread(hop.join, 10)
        finally:
            await mid_runner.cleanup()
            await src_runner.cleanup()

    asyncio.run(main())
    assert seen["mid"].nbytes == seen["tail"].nbytes == len(data)
    assert (tmp_path / "mid.bin").read_bytes() == data == (tmp_path / "tail.bin").read_bytes()


def test_a_live_resume_by_splice_never_rewrites_verified_layers_and_verifies_the_rest(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    spans = ((0, 1 << 20), (1 << 20, 2 << 20), (2 << 20, 3 << 20))
    layers = LayerCheck(spans, tuple(hashlib.sha256(data[a:b]).hexdigest() for a, b in spans),
                        tmp_path / "progress")
    sha = hashlib.sha256(data).hexdigest()
    dest = tmp_path / "out.bin"
    marker = b"LIVE" * (1 << 18)  # what a replica maps in layer 0: an earlier attempt verified it
    dest.with_name("out.bin.partial").write_bytes(marker + bytes(2 << 20))
    write_progress(str(layers.progress), 1)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    seen = {}

    def body(port: int) -> None:
        with VerifiedWriter(dest, sha, len(data), layers=layers) as writer:
            assert not writer.can_splice  # layer 0 is verified: hashed as it arrives, through a buffer
            seen["result"] = stream_from_peer(f"http://127.0.0.1:{port}", "f", None, writer, receive="splice")

    _serving(lambda r: serve_file(r, StageFile("f", src, sha, len(data))), body)
    assert seen["result"].nbytes == len(data)
    held = dest.read_bytes()
    assert held[:1 << 20] == marker  # never rewritten (a replica maps it); layers 1 and 2 arrived by splice
    assert held[1 << 20:] == data[1 << 20:]
    assert read_progress(str(layers.progress)) == 3


def test_a_corrupt_layer_received_by_splice_ends_the_attempt_before_it_counts(tmp_path: Path) -> None:
    data = bytearray(os.urandom(3 << 20))
    spans = ((0, 1 << 20), (1 << 20, 2 << 20), (2 << 20, 3 << 20))
    layers = LayerCheck(spans, tuple(hashlib.sha256(data[a:b]).hexdigest() for a, b in spans),
                        tmp_path / "progress")
    sha = hashlib.sha256(data).hexdigest()
    data[(1 << 20) + 5] ^= 0x01  # layer 1 flipped on the wire
    src = tmp_path / "src.bin"
    src.write_bytes(data)

    def body(port: int) -> None:
        with pytest.raises(TransferError, match="layer 1 of the stage fails its sha256 check"):
            _fetch(port, tmp_path / "out.bin", sha, len(data), layers=layers)

    _serving(lambda r: serve_file(r, StageFile("f", src, sha, len(data))), body)
    assert read_progress(str(layers.progress)) == 1  # layer 0 verified and announced; layer 1 never
    assert not (tmp_path / "out.bin").exists()
