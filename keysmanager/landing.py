"""A landing reserve: memory pages a KeysManager touches ahead of time for the next stage file to land in.

A stage file lands in the state dir (tmpfs: host memory, as a cache is). Writing into pages that were never
touched costs more than the copy: the kernel allocates and zeroes each page, and in a virtual machine that
returns its free memory to the hypervisor (free page reporting, a balloon) each first touch also takes a fault
in the hypervisor. On the 2-core benchmark VM that made a receiver of a chain multicast several times slower
in a fresh cluster than once its pages had been used (docs/benchmarks.md, BlitzScale one-shot).

The reserve is one file in ``<state_dir>/landing`` whose pages a background thread faults in (zeroed), off the
critical path: when the agent starts, and again, at the lowest priority (nice 19), once no transfer has run for
:data:`REFILL_AFTER_S`. A transfer that opens a new stage file takes it (:meth:`LandingReserve.take`): the file
is renamed to the transfer's partial file and cut to the stage's size, so its bytes overwrite pages already
there (a plain copy). Without a reserve (``landing_mb`` 0, or taken and not refilled yet) a transfer opens a
new file as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from pathlib import Path

FILL_CHUNK = 4 << 20  # bytes touched per step; stopping for a take waits at most one step
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14: fault pages in writable, no copy
REFILL_AFTER_S = 10.0  # a taken reserve is refilled once no transfer has run for this long (not during a burst)


class LandingReserve:
    """``nbytes`` of pre-touched pages in ``folder`` (same file system as the stage files: taken by rename)."""

    def __init__(self, folder: Path, nbytes: int) -> None:
        self.folder = Path(folder)
        self.path = self.folder / "reserve"
        self.nbytes = max(0, nbytes)
        self.filled = 0  # bytes of ``path`` written (touched) so far
        self.taken = 0  # reserves handed to transfers
        self._lock = threading.Lock()  # the file and ``filled``: the filler writes a step under it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy_until = 0.0  # monotonic: a refill waits until then (REFILL_AFTER_S after the last transfer)

    @property
    def state(self) -> str:
        """``off`` (no reserve), ``filling`` or ``ready`` (``nbytes`` touched)."""
        if not self.nbytes:
            return "off"
        return "ready" if self.filled >= self.nbytes else "filling"

    def summary(self) -> dict:
        return {"state": self.state, "bytes": self.filled, "target_bytes": self.nbytes, "taken": self.taken}

    def start(self) -> None:
        """Fill the reserve in the background (nothing when it is off or already filling). A reserve file left by
        an earlier agent of this state dir is dropped: what it held is not known."""
        if not self.nbytes:
            return
        if self._thread is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)
        self._spawn(delay_s=0.0, refill=False)

    def _spawn(self, delay_s: float, refill: bool = True) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._busy_until = max(self._busy_until, time.monotonic() + delay_s)
        self._thread = threading.Thread(target=self._fill, args=(refill,), name="landing-reserve", daemon=True)
        self._thread.start()

    def _fill(self, refill: bool) -> None:
        if refill:  # after a transfer: the lowest priority, only spare CPU (the agent's start has nothing to disturb)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self._stop.is_set() and time.monotonic() < self._busy_until:
            self._stop.wait(min(0.5, self._busy_until - time.monotonic()))
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return
        try:
            while not self._stop.is_set():
                with self._lock:
                    if self.filled >= self.nbytes or not self.path.exists():
                        return
                    self.filled += _touch(fd, self.filled, min(FILL_CHUNK, self.nbytes - self.filled))
        except OSError:  # the file system is full: what was touched stays usable
            return
        finally:
            os.close(fd)

    def take(self, dest: Path, size: int) -> int:
        """Hand the reserve's pages to a new stage file: rename it to ``dest`` (which must not exist) cut to
        ``size`` bytes. Returns the bytes of ``dest`` that were already touched (0: nothing taken, ``dest``
        untouched). The filler stops first (a step at most)."""
        if not self.nbytes or size <= 0:
            return 0
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join()
        with self._lock:
            if not self.filled or not self.path.exists() or Path(dest).exists():
                return 0
            os.truncate(self.path, size)  # a larger reserve gives back the rest; a smaller one grows by a hole
            os.rename(self.path, dest)
            touched, self.filled = min(self.filled, size), 0
            self.taken += 1
        return touched

    def refill_later(self) -> None:
        """A transfer ended: refill once none has run for :data:`REFILL_AFTER_S` (another transfer pushes it on)."""
        if self.nbytes:
            self._busy_until = time.monotonic() + REFILL_AFTER_S
            if self.filled < self.nbytes:
                self._spawn(delay_s=REFILL_AFTER_S)

    def stop(self) -> None:
        """Stop filling and remove the reserve (the agent is closing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self.path.unlink(missing_ok=True)
            self.filled = 0


def _touch(fd: int, offset: int, count: int) -> int:
    """Make the pages of ``[offset, offset + count)`` of the file exist, zeroed and touched: faulted in writable
    through a mapping (the kernel allocates and clears each page, nothing is copied), else by writing zeros."""
    if os.fstat(fd).st_size < offset + count:
        os.ftruncate(fd, offset + count)
    try:
        with mmap.mmap(fd, count, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset) as mapped:
            mapped.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError):  # an older kernel: write the zeros
        os.pwrite(fd, bytes(count), offset)
    return count
