"""A benchmark's processes end with it, however it is stopped (`quartctl bench` runs every benchmark here).

A bench killed by ``timeout`` (SIGTERM) or Ctrl-C (SIGINT) used to leave `quartctl up`, KeysManagers and their
replicas running (orphans of init): SIGTERM's default action ends the process without running a ``finally``,
and `quartctl up` runs in a session of its own, so no signal reached it. :func:`run_bench` makes the first
SIGTERM or SIGINT unwind the benchmark as an exception (``SystemExit(128 + signal)``): its ``finally`` blocks
and ``asyncio.run``'s cancellation stop what it started, as at a normal end. A second signal is ignored while
that cleanup runs. Then any child process still running (started in a constructor the signal interrupted,
before a ``try`` owned it) is stopped: SIGTERM to it and its process group, SIGKILL after ``grace_s``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

import psutil

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _unwind(signum: int, _frame) -> None:
    for sig in SIGNALS:  # the cleanup that follows must not be cut short by a second signal
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def run_bench(main: Callable[[list[str]], int | None], argv: list[str], grace_s: float = 20.0) -> int:
    """``main(argv)``, unwound by SIGTERM/SIGINT; every child process it leaves running is stopped after it."""
    previous = {sig: signal.signal(sig, _unwind) for sig in SIGNALS}
    try:
        return int(main(argv) or 0)
    finally:
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        try:
            stop_children(grace_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def stop_children(grace_s: float) -> list[int]:
    """Stop every child of this process still running (and the process group of those leading one, as a
    `quartctl up` started in its own session does): SIGTERM, SIGKILL after ``grace_s``. Returns their pids."""
    children = [c for c in psutil.Process().children() if _running(c)]
    pids = [c.pid for c in children]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for child in children:
            _send(child, sig)
        _gone, children = psutil.wait_procs(children, timeout=wait_s)
        if not children:
            break
    return pids


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _send(proc: psutil.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        proc.send_signal(sig)
