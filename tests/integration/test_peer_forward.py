"""Forwarding a stage file still arriving (a chain hop, ``keysmanager.peers``): sent in pieces of FORWARD_BYTES,
but a few bytes whose upstream stalls still go on within the hold time, and the receiver gets every byte; a reader
asking while the hop's writer opens waits for its file; a hop whose own transfer fails cuts its reader off at once."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from pathlib import Path

from quart_tools.bench.peer_cpu import serve_stage

from keysmanager.peers import FORWARD_BYTES, StageFile, stream_from_peer
from keysmanager.transfer import TransferError, VerifiedWriter


def test_a_stalled_upstream_still_forwards_what_arrived_and_the_rest_follows(tmp_path: Path) -> None:
    data = os.urandom(FORWARD_BYTES + (3 << 20))
    sha = hashlib.sha256(data).hexdigest()
    first = 100_000  # far less than FORWARD_BYTES: held at most the hold time, not until more arrives
    upstream = VerifiedWriter(tmp_path / "mid.bin", sha, len(data)).__enter__()
    stage = StageFile("f", upstream.dest, sha, len(data), upstream)
    receiver = VerifiedWriter(tmp_path / "out.bin", sha, len(data))
    seen: dict[str, object] = {}

    async def main() -> None:
        runner, port = await serve_stage(stage)

        def fetch() -> None:
            with receiver:
                seen["result"] = stream_from_peer(f"http://127.0.0.1:{port}", "f", None, receiver)

        thread = threading.Thread(target=fetch, daemon=True)
        try:
            upstream.write(data[:first])
            thread.start()
            deadline = time.monotonic() + 5.0
            while receiver.written < first:  # the upstream is stalled: only the hold time lets these go
                assert time.monotonic() < deadline, f"{receiver.written} of {first} bytes forwarded"
                await asyncio.sleep(0.01)
            assert receiver.written == first
            for at in range(first, len(data), 1 << 20):  # the rest, as a transfer writes it
                upstream.write(data[at:at + (1 << 20)])
                await asyncio.sleep(0)
            upstream.commit()
            await asyncio.to_thread(thread.join, 10.0)
        finally:
            await runner.cleanup()

    asyncio.run(main())
    assert seen["result"].nbytes == len(data)
    assert (tmp_path / "out.bin").read_bytes() == data


def _fetch_from(port: int, dest: Path, sha: str, size: int, seen: dict) -> None:
    started = time.monotonic()
    try:
        with VerifiedWriter(dest, sha, size) as writer:
            seen["result"] = stream_from_peer(f"http://127.0.0.1:{port}", "f", None, writer, read_timeout_s=8)
    except TransferError as exc:
        seen["error"] = str(exc)
    seen["seconds"] = time.monotonic() - started


async def _hop_feeding(stage: StageFile, dest: Path, seen: dict, feed) -> None:
    """Serve ``stage`` as a KeysManager's API does (its error middleware), fetch it into ``dest`` in a thread while
    ``feed()`` (a coroutine) drives the hop's own transfer; then stop serving."""
    from keysmanager.api import _errors_as_json

    runner, port = await serve_stage(stage, (_errors_as_json,))
    thread = threading.Thread(target=_fetch_from, args=(port, dest, stage.sha256, stage.size, seen))
    thread.start()
    await feed()
    await asyncio.to_thread(thread.join, 20.0)
    await runner.cleanup()


def test_a_reader_that_asks_while_the_writer_opens_waits_for_the_file(tmp_path: Path) -> None:
    """A transfer is registered as its writer opens, a moment before its partial file exists (a landing reserve is
    renamed into place then): the next hop asking in that moment gets every byte, not an error mid-answer."""
    data = os.urandom(6 << 20)
    sha = hashlib.sha256(data).hexdigest()
    upstream = VerifiedWriter(tmp_path / "mid.bin", sha, len(data))  # registered, not opened: no file yet
    seen: dict = {}

    async def feed() -> None:
        await asyncio.sleep(0.3)
        upstream.__enter__()
        for at in range(0, len(data), 1 << 20):
            upstream.write(data[at:at + (1 << 20)])
            await asyncio.sleep(0)
        upstream.commit()

    asyncio.run(_hop_feeding(StageFile("f", upstream.dest, sha, len(data), upstream), tmp_path / "out.bin", seen, feed))
    assert "error" not in seen and seen["result"].nbytes == len(data)
    assert (tmp_path / "out.bin").read_bytes() == data


def test_a_transfer_that_fails_upstream_cuts_the_next_hop_off_at_once(tmp_path: Path) -> None:
    """The hop's own transfer fails after its answer's headers went out: the connection is cut, so the next hop
    tries its next source at once (not after its read timeout, reading an error answer as body bytes)."""
    data = os.urandom(8 << 20)
    sha = hashlib.sha256(data).hexdigest()
    upstream = VerifiedWriter(tmp_path / "mid.bin", sha, len(data)).__enter__()
    upstream.write(data[:FORWARD_BYTES])
    seen: dict = {}

    async def feed() -> None:
        await asyncio.sleep(0.5)
        upstream.abort()

    asyncio.run(_hop_feeding(StageFile("f", upstream.dest, sha, len(data), upstream), tmp_path / "out.bin", seen, feed))
    assert "error" in seen and seen["seconds"] < 3.0, seen
    assert not (tmp_path / "out.bin").exists()
