"""Linux process helpers: parent-death signal, child subreaper, CPU budget, memory readings. No torch here."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}, {arg}) failed: {os.strerror(err)}")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def return_large_buffers(threshold: int = 1 << 20) -> bool:
    """glibc: allocations of ``threshold`` bytes or more are mmapped and go back to the kernel when freed.

    By default glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after
    which request bodies of that size come from the heap and stay in the RSS once freed; a fixed threshold
    keeps what a process holds close to what it uses. False where ``mallopt`` is missing (not glibc)."""
    mallopt = getattr(_libc, "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * threshold))


def set_parent_death_signal(sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` when our parent exits (Linux). Safe as a ``preexec_fn``: libc was
    loaded when this module was imported, so the child between fork and exec takes no loader or import lock
    (a lock another thread of the parent held at fork time would never be released there)."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` when our parent exits; exit now if it already has."""
    set_parent_death_signal(sig)
    if os.getppid() != expected_parent:
        os._exit(70)


def become_subreaper() -> None:
    """Orphaned descendants (replicas whose zygote was evicted) are re-parented to us, so we reap them."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def reap_children() -> list[tuple[int, int]]:
    """``waitpid`` every ended child (or orphan re-parented to a subreaper): [(pid, exit code or -signal)]."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        ended.append((pid, os.waitstatus_to_exitcode(status)))
    return ended


def thread_count(pid: int | None = None) -> int:
    """Kernel threads of a process (``/proc/<pid>/task``): 1 means no thread pool was started."""
    return len(os.listdir(f"/proc/{pid or os.getpid()}/task"))


def memory_of(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of a process; (0, 0) when it is gone or unreadable."""
    try:
        info = psutil.Process(pid).memory_full_info()
    except (psutil.Error, OSError):
        return 0, 0
    return int(info.rss), int(getattr(info, "pss", 0))


def is_running(pid: int, create_time: float | None = None) -> bool:
    """True when ``pid`` is a live (non-zombie) process, and the same one when ``create_time`` is given."""
    try:
        proc = psutil.Process(pid)
        if create_time is not None and abs(proc.create_time() - create_time) > 0.05:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def create_time(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def set_process_cores(pid: int, cores: list[int]) -> None:
    """Pin every thread of process ``pid`` to ``cores`` (threads it starts later inherit them)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return  # gone: its death is reported elsewhere
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cores)


def set_cpu_budget(cores: list[int] | None, threads: int) -> None:
    """Pin the calling process to ``cores`` (when given) and cap torch/OpenMP threads at ``threads``."""
    if cores:
        os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:  # a daemon-side caller without torch
        pass


def listen_socket(host: str, unix: str | None = None) -> socket.socket:
    """A listening socket: on ``host`` port 0, or on the Unix socket ``unix`` (mode 0600: only our uid connects)."""
    if unix:
        listen = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(unix)
        old = os.umask(0o177)
        try:
            listen.bind(unix)
        finally:
            os.umask(old)
    else:
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.bind((host, 0))
    listen.listen(1024)
    return listen
