"""Unit tests run in this process alone: no socket is bound or connected and no program is started
(a multiprocessing pool of workers for the simulator is computation, and allowed).

An autouse guard makes that a rule rather than a hope: a test here that opens a connection or starts a
program fails and names the call, which says it belongs in tests/integration or tests/e2e.
"""

from __future__ import annotations

import socket
import subprocess

import pytest


class NotAUnitTest(AssertionError):
    """A unit test reached outside its process."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise NotAUnitTest(f"a unit test may not {what}: move it to tests/integration or tests/e2e")
    return refuse


@pytest.fixture(autouse=True)
def in_process_only(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _refuse("connect a socket"))
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse("connect a socket"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("bind a socket"))
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("start a process"))
    yield
