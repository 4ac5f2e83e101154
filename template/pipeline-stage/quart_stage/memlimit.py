"""A replica's private memory, bounded (issue 31, item 1): one request cannot take its host.

When a replica is about to serve (its parameters mapped, its device prepared, before it drops to its own
uid), :func:`bound_replica` sets ``RLIMIT_DATA`` to the private memory it holds then (``VmData``: a forked
replica inherits its zygote's) plus a headroom: ``QUART_MEMORY_HEADROOM_BYTES``, else
max(1 GiB, 2 × its parameter bytes). ``RLIMIT_DATA`` counts private writable memory only, so parameters
shared from the KeysManager's segment are not charged to every replica. A request that would allocate past
it fails inside the replica (``MemoryError``: an error answer) instead of swapping the host out.
"""

from __future__ import annotations

import resource

MIN_HEADROOM_BYTES = 1 << 30


def data_bytes() -> int:
    """This process's private writable memory (``VmData`` of /proc/self/status; 0 where unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def headroom_bytes(configured: int, parameter_bytes: int) -> int | None:
    """The memory a replica may take beyond what it holds when it starts serving; None = unbounded."""
    if configured < 0:
        return None
    return configured if configured > 0 else max(MIN_HEADROOM_BYTES, 2 * parameter_bytes)


def bound_replica(configured: int, parameter_bytes: int) -> int | None:
    """Set ``RLIMIT_DATA`` (never raised above a lower existing limit); the limit set, or None (unbounded,
    or ``VmData`` unreadable)."""
    headroom, held = headroom_bytes(configured, parameter_bytes), data_bytes()
    if headroom is None or held <= 0:
        return None
    limit = held + headroom
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft < limit:
        return soft
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard if hard != resource.RLIM_INFINITY else limit))
    return limit
