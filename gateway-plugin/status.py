"""What the status page (``/ui/``) and ``quartctl status`` show: one JSON document of the running system.

Per pipeline: its stages in order with each one's queue, λ (arrivals/s over the window), μ, desired / ready
replicas and bounds, why it is not ready, and every replica with its host, state and start source
(fork / peer / multicast / live / cold / process); the key stages and the controller's last decisions
(desired replicas and the policy's reason per stage); latency percentiles over the window; and short
histories for the charts (latency p50/p99 per second, replicas per stage per control step). Times are
seconds before ``now`` (the plugin's monotonic clock), so a page needs no clock of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway_plugin.snapshot import StageSnapshot

HISTORY_S = 300.0  # how far back the charts reach
DECISIONS = 10  # last decisions listed per pipeline


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def latency_series(recent: Iterable[tuple[float, str, float, int]], model: str, now: float,
                   history_s: float = HISTORY_S) -> list[dict[str, float]]:
    """Per second (``age_s`` from now): p50, p99 (ms) and count of the model's finished requests."""
    buckets: dict[int, list[float]] = {}
    for end, name, latency_ms, _status in recent:
        if name == model and now - end <= history_s:
            buckets.setdefault(int(now - end), []).append(latency_ms)
    return [{"age_s": float(age), "p50_ms": percentile(v, 0.5), "p99_ms": percentile(v, 0.99), "count": len(v)}
            for age, v in sorted(buckets.items(), reverse=True)]


def _stage(plugin: Any, index: int, name: str, snap: StageSnapshot | None, now: float) -> dict[str, Any]:
    metrics = plugin.collector.stages.get(name)
    queue = plugin.router.queues.get(name)
    out: dict[str, Any] = {
        "index": index, "name": name,
        "queue": len(queue.jobs) if queue is not None else 0,
        "arrival_rate": round(metrics.arrival_rate(now), 3) if metrics is not None else 0.0,
        "service_rate": round(snap.service_rate, 3) if snap is not None else 0.0,
        "mean_wait_ms": round(1000 * snap.mean_wait_s, 2) if snap is not None else 0.0,
    }
    out.update(plugin.gateway.stage_status(name) or {})  # desired, ready, bounds, why not ready, its replicas
    return out


def status_document(plugin: Any) -> dict[str, Any]:
    """The whole status (see the module docstring) of the plugin's gateway."""
    now = plugin.controller.clock()
    pipelines = []
    recent = list(plugin.collector.recent)
    for model, functions in sorted(plugin.view.pipelines().items()):
        snap = plugin.controller.last_snapshots.get(model)
        snaps = {s.name: s for s in snap.stages} if snap is not None else {}
        rows = [row for row in plugin.controller.timeline if row["model"] == model and now - row["time"] <= HISTORY_S]
        last = rows[-1] if rows else None
        latencies = [lat for end, name, lat, _ in recent if name == model and now - end <= plugin.collector.window_s]
        pipelines.append({
            "model": model,
            "stages": [_stage(plugin, i, name, snaps.get(name), now) for i, name in enumerate(functions)],
            "key_stages": list(last["key_stages"]) if last else [],
            "latency": {"window_s": plugin.collector.window_s, "count": len(latencies),
                        "p50_ms": percentile(latencies, 0.5), "p99_ms": percentile(latencies, 0.99)},
            "decisions": [{"age_s": round(now - row["time"], 2), "desired": row["desired"],
                           "replicas": row["replicas"], "queue": row["queue"], "key_stages": row["key_stages"],
                           "reasons": row["reasons"]} for row in rows[-DECISIONS:]][::-1],
            "history": {"latency": latency_series(recent, model, now),
                        "replicas": [{"age_s": round(now - row["time"], 2), "replicas": row["replicas"],
                                      "desired": row["desired"]} for row in rows[-600:]]},
        })
    return {"policy": plugin.config.policy, "control_period_s": plugin.config.control_period_s,
            "hosts": plugin.gateway.hosts_status(), "pipelines": pipelines}
