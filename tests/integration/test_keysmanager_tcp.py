"""The KeysManager on TCP (``--listen``): only with the cluster's bearer token; replicas on the host address.

Runs on loopback: the daemon listens on 127.0.0.1 and its replicas bind 127.0.0.2 (every 127/8 address
is local on Linux), so a replica bound on the host address is told apart from one bound on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from support.keysmanager import IDS, Daemon, daemons_in_temp_dir, emulated

from keysmanager.client import AsyncKeysManagerClient, KeysManagerClient, KeysManagerError

HOST_ADDRESS = "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token_file(root: Path, mode: int = 0o600, token: str = "t0k3n-" + "x" * 30) -> Path:
    path = root / "keysmanager-token"
    path.write_text(token + "\n")
    os.chmod(path, mode)
    return path


@pytest.fixture
def tcp_daemon():
    """(daemon, its TCP URL, the token): a KeysManager on TCP whose replicas bind HOST_ADDRESS."""
    with daemons_in_temp_dir() as (root, daemons, _):
        token_file = _token_file(root)
        port = _free_port()
        d = Daemon(root, "h0", "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
                   "--host-address", HOST_ADDRESS)
        daemons.append(d)
        d.start()
        yield d, f"http://127.0.0.1:{port}", token_file.read_text().strip()


def test_tcp_answers_only_with_the_token(tcp_daemon) -> None:
    _, url, token = tcp_daemon
    for headers, cause in (({}, "missing Authorization header"),
                           ({"Authorization": "Basic YWRtaW46eA=="}, "is not 'Bearer <token>'"),
                           ({"Authorization": "Bearer " + "y" * len(token)}, "wrong bearer token")):
        res = requests.get(url + "/v1/health", headers=headers, timeout=10)
        assert res.status_code == 401
        assert cause in res.json()["error"] and res.json()["field"] == "Authorization"
        assert res.headers["WWW-Authenticate"].startswith("Bearer")
    assert KeysManagerClient(url, token=token).health()["name"] == "h0"
    with pytest.raises(KeysManagerError) as err:
        KeysManagerClient(url, token="z" * 40).report()
    assert err.value.status == 401 and "wrong bearer token" in err.value.message
    with pytest.raises(ValueError, match="needs the cluster's token"):
        KeysManagerClient(url)

    async def async_health() -> dict:
        client = AsyncKeysManagerClient(url, token=token)
        try:
            return await client.health()
        finally:
            await client.close()

    assert asyncio.run(async_health())["name"] == "h0"


def test_replicas_listen_on_the_host_address(tcp_daemon) -> None:
    d, url, token = tcp_daemon
    client = KeysManagerClient(url, token=token, timeout=120)
    forked = client.start(emulated("emu-fork-0"), 1)[0]
    cold = client.start(emulated("emu-cold-0"), 1, source="cold")[0]
    for rep in (forked, cold):
        assert rep.url.startswith(f"http://{HOST_ADDRESS}:"), rep
        assert requests.post(rep.url, json=IDS, timeout=30).status_code == 200
        with pytest.raises(requests.ConnectionError):  # bound on the host address, not on 127.0.0.1
            requests.post(rep.url.replace(HOST_ADDRESS, "127.0.0.1"), json=IDS, timeout=5)
    assert {r.id for r in d.client.replicas()} == {forked.id, cold.id}  # the Unix socket needs no token


@pytest.mark.parametrize("token_file, cause", [
    (None, "listen needs token_file"),
    ("absent", "No such file"),
    ("loose", "mode 0644"),
    ("short", "at least 16 characters"),
])
def test_no_tcp_listener_without_a_usable_token(tmp_path, token_file, cause) -> None:
    root = tmp_path
    (root / "loose").mkdir()
    (root / "short").mkdir()
    files = {"absent": root / "absent", "loose": _token_file(root / "loose", 0o644),
             "short": _token_file(root / "short", token="short")}
    argv = [sys.executable, "-m", "keysmanager.daemon", "--name", "h9", "--socket", str(root / "h9.sock"),
            "--state-dir", str(root / "h9-state"), "--listen", f"127.0.0.1:{_free_port()}"]
    if token_file is not None:
        argv += ["--token-file", str(files[token_file])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and cause in out.stderr, out.stderr
