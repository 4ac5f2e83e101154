"""A chain hop landing in landing reserves (``keysmanager.landing``) on the real peer path over loopback TCP: the
middle hop receives into its reserve while serving the file on as it grows, the tail into its own; every byte
arrives and verifies, by copy and by splice, and the pre-sized file never leaks its zeros to the next hop."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
from quart_tools.bench.peer_cpu import serve_stage

from keysmanager.landing import LandingReserve
from keysmanager.peers import StageFile, stream_from_peer
from keysmanager.transfer import VerifiedWriter


def _reserve(folder: Path, nbytes: int) -> LandingReserve:
    reserve = LandingReserve(folder, nbytes)
    reserve.start()
    deadline = time.monotonic() + 20
    while reserve.state != "ready":
        assert time.monotonic() < deadline, reserve.summary()
        time.sleep(0.01)
    return reserve


@pytest.mark.parametrize("receive", ["copy", "splice"])
def test_a_chain_hop_lands_in_reserves_and_forwards_only_arrived_bytes(tmp_path: Path, receive: str) -> None:
    data = os.urandom((9 << 20) + 4321)
    sha = hashlib.sha256(data).hexdigest()
    source = StageFile("f", tmp_path / "src.bin", sha, len(data))
    source.path.write_bytes(data)
    mid_reserve, tail_reserve = _reserve(tmp_path / "mid-landing", 16 << 20), _reserve(tmp_path / "tail-landing", 4 << 20)
    mid = VerifiedWriter(tmp_path / "mid.bin", sha, len(data), landing=mid_reserve).__enter__()
    assert mid.pretouched == len(data) and mid.partial.stat().st_size == len(data)  # pre-sized: zeros ahead
    seen: dict[str, object] = {}

    def hop(port: int) -> None:
        seen["mid"] = stream_from_peer(f"http://127.0.0.1:{port}", "f", None, mid, receive=receive)

    def tail(port: int) -> None:
        with VerifiedWriter(tmp_path / "tail.bin", sha, len(data), landing=tail_reserve) as writer:
            seen["tail_pretouched"] = writer.pretouched
            seen["tail"] = stream_from_peer(f"http://127.0.0.1:{port}", "f", None, writer, receive=receive)

    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:  # the servers stop after the hops (in reverse order)
            ports = []
            for stage in (source, StageFile("f", mid.dest, sha, len(data), mid)):
                runner, port = await serve_stage(stage)
                stack.push_async_callback(runner.cleanup)
                ports.append(port)
            threads = [threading.Thread(target=tail, args=(ports[1],), daemon=True),
                       threading.Thread(target=hop, args=(ports[0],), daemon=True)]
            for t in threads:  # the tail asks first: it follows the middle hop's file as it grows from nothing
                t.start()
            for t in threads:
                await asyncio.to_thread(t.join, 30.0)

    asyncio.run(main())
    assert seen["mid"].nbytes == seen["tail"].nbytes == len(data)
    assert seen["tail_pretouched"] == 4 << 20  # a reserve smaller than the stage: the rest lands in new pages
    assert (tmp_path / "mid.bin").read_bytes() == data and (tmp_path / "tail.bin").read_bytes() == data
    assert mid_reserve.summary()["taken"] == tail_reserve.summary()["taken"] == 1
