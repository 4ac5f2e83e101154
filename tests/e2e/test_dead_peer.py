"""A request in flight to a host whose link goes down fails in ~2 s with dead-peer sockets
(quart_transport.dead_peer), instead of waiting for its timeout; a slow answer from a healthy host is kept.

Needs host namespaces (root); skips with the reason otherwise.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from quart_provider.network import HostNetwork, cleanup_by_prefix, cluster_id, unavailable_reason
from quart_transport.dead_peer import dead_peer_connector

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"host namespaces unavailable: {REASON}")

# GET /?s=SECONDS answers 200 after that long
SLOW_SERVER = r"""
import sys, time
from http.server import BaseHTTPRequestHandler
from socketserver import ThreadingTCPServer  # not ThreadingHTTPServer: its bind does a reverse DNS lookup
from urllib.parse import parse_qs, urlsplit
class Slow(BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(float(parse_qs(urlsplit(self.path).query).get("s", ["0"])[0]))
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args): pass
server = ThreadingTCPServer((sys.argv[1], 0), Slow)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


async def _get(url: str, connector: aiohttp.BaseConnector, timeout_s: float) -> tuple[str, float]:
    start = time.monotonic()
    try:
        async with aiohttp.ClientSession(connector=connector) as session, session.get(
                url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as res:
            await res.read()
            outcome = str(res.status)
    except TimeoutError:
        outcome = "timeout"
    except aiohttp.ClientError as exc:
        outcome = f"error {type(exc).__name__}"
    return outcome, time.monotonic() - start


def test_a_silent_host_fails_the_call_fast_and_a_slow_one_does_not() -> None:
    cid = cluster_id(f"{Path(__file__).resolve()}")
    try:
        with HostNetwork.create(["host-0"], cid, nic_gbps=1.0) as net:
            host = net.host("host-0")
            proc = subprocess.Popen(net.exec_argv(host, [sys.executable, "-c", SLOW_SERVER, host.address]),
                                    stdout=subprocess.PIPE, text=True)
            try:
                url = f"http://{host.address}:{int(proc.stdout.readline())}/"

                async def scenario() -> None:
                    # healthy but slow: 3.5 s of silence, probes acknowledged, the answer arrives
                    assert (await _get(url + "?s=3.5", dead_peer_connector(), 30))[0] == "200"
                    # link down while both calls wait: the dead-peer one fails in ~2 s (aiohttp then tries one
                    # new connection for a GET, which fails in 1.5 s), the plain one hangs until its timeout
                    calls = [asyncio.create_task(_get(url + "?s=60", dead_peer_connector(), 30)),
                             asyncio.create_task(_get(url + "?s=60", aiohttp.TCPConnector(), 5))]
                    await asyncio.sleep(0.3)
                    await asyncio.to_thread(net.link_down, host)
                    (fast, fast_s), (plain, plain_s) = await asyncio.gather(*calls)
                    assert fast.startswith("error") and fast_s < 4.0, (fast, fast_s)
                    assert plain == "timeout" and plain_s > 4.5, (plain, plain_s)

                asyncio.run(scenario())
            finally:
                proc.kill()
                proc.wait()
    finally:
        cleanup_by_prefix(cid)
