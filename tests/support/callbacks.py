"""Async invocation harness: a callback server that records X-Callback-Url posts, deploy and wait helpers."""

from __future__ import annotations

import http.server
import queue
import threading
import time

import pytest
import requests

from support.embedded_system import ThreadedSystem


class CallbackServer:
    """Collects the callbacks (headers, body) on a loopback port; ``hold`` makes it answer only when released."""

    def __init__(self) -> None:
        self.received: queue.Queue[tuple[dict[str, str], bytes]] = queue.Queue()
        self.release = threading.Event()
        self.release.set()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.received.put(({k: v for k, v in self.headers.items()}, body))
                outer.release.wait(30)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/done"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def next(self, timeout: float = 20.0) -> tuple[dict[str, str], bytes]:
        return self.received.get(timeout=timeout)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()



@pytest.fixture
def callbacks():
    server = CallbackServer()
    yield server
    server.close()



def deploy_function(system: ThreadedSystem, name: str, **labels: str) -> None:
    body = {"service": name, "image": "quart/echo:latest", "labels": labels}
    res = requests.post(f"{system.url}/system/functions", json=body, auth=system.auth, timeout=30)
    assert res.status_code == 202, res.text



def wait_available(system: ThreadedSystem, name: str, count: int = 1) -> None:
    deadline = time.monotonic() + 30
    while requests.get(f"{system.url}/system/function/{name}", auth=system.auth,
                       timeout=10).json()["availableReplicas"] < count:
        assert time.monotonic() < deadline, f"{name} never became ready"
        time.sleep(0.05)

