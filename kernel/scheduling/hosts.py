"""HostView from what a KeysManager reports (its `report()` and, optionally, its `replicas()`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from quart_kernel.scheduling.types import HostView

_LIVE_STATES = {"starting", "ready"}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def host_view_from_report(report: Any, replicas: Iterable[Any] | None = None) -> HostView:
    """Build a HostView from a `keysmanager.client.HostReport` (or its JSON dict).

    `cached` may list function names or stage-key dicts/objects with a ``function`` field. `replicas`
    (ReplicaInfo objects or dicts of that host) fill `running` with live replicas per function; without
    it, `running` comes from the report's own ``running`` mapping if it has one.
    """
    cached_raw = _get(report, "cached", ()) or ()
    cached = frozenset(c if isinstance(c, str) else str(_get(c, "function")) for c in cached_raw)
    if replicas is not None:
        running: dict[str, int] = dict(
            Counter(str(_get(r, "function")) for r in replicas if _get(r, "state", "ready") in _LIVE_STATES)
        )
    else:
        running = {str(k): int(v) for k, v in (_get(report, "running", {}) or {}).items()}
    name = _get(report, "name")
    if not name:
        raise ValueError("a KeysManager report must name its host ('name')")
    return HostView(
        name=str(name),
        gpu_slots=int(_get(report, "gpu_slots", 0)),
        gpu_used=int(_get(report, "gpu_used", 0)),
        memory_limit=int(_get(report, "memory_limit", 0)),
        memory_used=int(_get(report, "memory_used", 0)),
        cached=cached,
        held=frozenset(str(f) for f in (_get(report, "held", ()) or ())),
        running=running,
    )
