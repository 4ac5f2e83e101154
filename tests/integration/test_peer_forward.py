"""Forwarding a stage file still arriving (a chain hop, ``keysmanager.peers``): sent in pieces of FORWARD_BYTES,
but a few bytes whose upstream stalls still go on within the hold time, and the receiver gets every byte."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from pathlib import Path

from quart_tools.bench.peer_cpu import serve_stage

from keysmanager.peers import FORWARD_BYTES, StageFile, stream_from_peer
from keysmanager.transfer import VerifiedWriter


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
