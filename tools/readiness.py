"""What `quartctl up` says about its functions: which ones a previous run left (and whether they stay), and,
once deployed, each function's readiness or why its replicas cannot run.

``up -f stack.yml`` deploys exactly that stack: functions restored from the state folder that the stack does
not name are removed, and the lines say which. ``up`` alone restores the previous run's functions and says so.
Readiness waits (bounded by ``--wait``) until every function has its desired replicas ready, or cannot get
them (no free slot: the placer's reason; a replica start that failed), then prints one line per function.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from quart_kernel.capacity import not_ready_reason

READY_PREFIX = "Function:"  # `up --detach` echoes these lines from the gateway's log


async def keep_only(gateway: Any, wanted: Iterable[str]) -> list[str]:
    """Remove every function not in ``wanted`` (restored from a previous run); returns their names."""
    keep = set(wanted)
    extra = sorted(name for name in gateway.functions if name not in keep)
    for name in extra:
        await gateway.registry.remove(name)
    return extra


def stuck(fn: Any, gateway: Any) -> str:
    """Why ``fn`` will not get its desired replicas without a change ('' while it still may)."""
    if len(fn.ready) >= fn.desired:
        return ""
    if fn.unplaced and len(fn.ready) + fn.unplaced >= fn.desired:  # every replica that could be placed is up
        return not_ready_reason(fn, gateway.functions.values(), gateway.hosts) or "its replicas cannot be placed"
    if fn.start_failures and fn.last_error:
        return fn.last_error
    return ""


async def wait_settled(gateway: Any, names: list[str], timeout_s: float, poll_s: float = 0.1) -> float:
    """Wait until each named function is ready or stuck, at most ``timeout_s``; returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        functions = [gateway.functions[n] for n in names if n in gateway.functions]
        if all(len(fn.ready) >= fn.desired or stuck(fn, gateway) for fn in functions):
            break
        await asyncio.sleep(poll_s)
    return time.monotonic() - started


def readiness_lines(gateway: Any, names: list[str]) -> tuple[list[str], int]:
    """One line per function (ready n/m, or why not) and how many are not ready."""
    lines, not_ready = [], 0
    for name in names:
        fn = gateway.functions.get(name)
        if fn is None:
            continue
        ready, desired = len(fn.ready), fn.desired
        if ready >= desired:
            lines.append(f"{READY_PREFIX} {name}: ready, {ready}/{desired} replica(s)")
            continue
        not_ready += 1
        why = stuck(fn, gateway) or not_ready_reason(fn, gateway.functions.values(), gateway.hosts) or "still starting"
        lines.append(f"{READY_PREFIX} {name}: NOT READY, {ready}/{desired} replica(s): {why}")
    return lines, not_ready
