"""Per-stage sliding-window metrics the router feeds and the controller reads; per-request records.

The router reports every event (arrival at a stage, dispatch to a replica, completion with the
stage's timing headers); ``StageMetrics`` keeps them for ``window_s`` seconds and answers λ_i, μ_i,
mean wait, CV_i of inter-arrival times, utilisation and mean activation bytes from running sums
(O(1) per event and per snapshot; the simulator uses the same class). Queue length and
busy counts are read live from the router. ``MetricsCollector`` exports everything on a private
prometheus registry (``/metrics``) and as JSON, and appends one JSON line per finished request
(arrival, per-stage wait and service, status) for CV-model training, CPU profiling and reports.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily


@dataclass(slots=True)
class StageVisit:
    """One request's pass through one stage (a record field; times in ms)."""

    stage: int
    function: str
    wait_ms: float
    service_ms: float  # round trip to the replica
    compute_ms: float = 0.0  # X-Quart-Compute-Ms
    serde_ms: float = 0.0  # X-Quart-Deserialize-Ms + X-Quart-Serialize-Ms
    replica: str = ""
    attempts: int = 1
    queue_len: int = 0  # queue length the request found on arrival at the stage
    cpus: float = 1.0
    activation_bytes: int = 0
    param_bytes: int = 0


TOKEN_BUCKETS_S = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FIRST_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0, 160.0, 640.0)
INTER_TOKEN_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                         7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                     120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class RequestRecord:
    """One pipeline request, as written to the JSONL records file."""

    id: str
    model: str
    arrival: float  # seconds (the router's clock)
    end: float
    status: int
    latency_ms: float
    stages: list[StageVisit] = field(default_factory=list)
    error: str = ""
    ttft_ms: float | None = None  # a generation: arrival -> its first token
    tpot_ms: float | None = None  # a generation: mean time per token after the first
    tokens: int = 0  # a generation: tokens generated

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class BatchTimes:
    """Service time of a stage's calls by how many requests (or decode steps) each carried, since the start."""

    __slots__ = ("_by_size",)

    def __init__(self) -> None:
        self._by_size: dict[int, list[float]] = {}  # size → [calls, Σ service s]

    def record(self, size: int, service_s: float) -> None:
        entry = self._by_size.get(size)
        if entry is None:
            entry = self._by_size[size] = [0, 0.0]
        entry[0] += 1
        entry[1] += service_s

    def table(self) -> tuple[tuple[int, int, float], ...]:
        """(size, calls, mean service s of such a call), by size."""
        return tuple((size, int(n), total / n) for size, (n, total) in sorted(self._by_size.items()) if n)


class StageMetrics:
    """Sliding windows of one stage with running sums. Times are the caller's clock in seconds.

    One implementation serves the live router and the simulator. Every event is O(1) and every
    statistic is O(1) (amortised: each event enters and leaves its window once): the sums of waits,
    service times, activation bytes and squared inter-arrival gaps follow the windows, and arrivals
    of the last ``recent_s`` are counted in a second window. The windows are the deques the statistics
    are defined on (an entry leaves when its time falls before ``now − window_s``, oldest first); the
    sums are rebuilt from them whenever as many entries have left as remain, so rounding cannot drift.
    ``trim_on_event=False`` (the simulator) trims only when a statistic is read: the same answers,
    fewer calls; memory stays bounded as long as something reads the metrics periodically.
    """

    __slots__ = ("window_s", "recent_s", "trim_on_event", "arrivals", "recent", "waits", "services",
                 "activations", "total_arrivals", "total_completions", "last_service_s", "_wait_sum",
                 "_busy_sum", "_act_sum", "_gap_sq_sum", "_removed", "batches", "active_since", "last_arrival",
                 "on_arrive")

    def __init__(self, window_s: float, recent_s: float = 1.0, trim_on_event: bool = True) -> None:
        self.window_s = window_s
        self.recent_s = recent_s  # the short window of arrival_rate(now, recent_s) (snapshot's λ recent)
        self.trim_on_event = trim_on_event
        self.arrivals: deque[float] = deque()  # arrival times
        self.recent: deque[float] = deque()  # arrival times of the last recent_s
        self.waits: deque[tuple[float, float]] = deque()  # (dispatch time, wait seconds)
        self.services: deque[tuple[float, float]] = deque()  # (completion time, service seconds)
        self.activations: deque[tuple[float, float]] = deque()  # (arrival time, input bytes)
        self.total_arrivals = 0
        self.total_completions = 0
        self.last_service_s = 0.0  # most recent mean service time, kept when the window empties
        self._wait_sum = 0.0
        self._busy_sum = 0.0
        self._act_sum = 0.0
        self._gap_sq_sum = 0.0  # Σ (a[k+1] − a[k])² over consecutive arrivals in the window
        self._removed = 0  # entries trimmed since the sums were last rebuilt
        self.batches = BatchTimes()  # service time of its calls by requests per call, since the start
        self.active_since = math.nan  # the first arrival after the stage was idle a whole window (nan: none yet)
        self.last_arrival = -math.inf
        self.on_arrive: Callable[[float], None] | None = None  # told of every arrival (the controller's kick)

    # ------------------------------------------------------------------------------ events
    def on_arrival(self, now: float, activation_bytes: float) -> None:
        if now - self.last_arrival > self.window_s:
            self.active_since = now
        self.last_arrival = now
        arrivals = self.arrivals
        if arrivals:
            gap = now - arrivals[-1]
            self._gap_sq_sum += gap * gap
        arrivals.append(now)
        self.recent.append(now)
        self.activations.append((now, activation_bytes))
        self._act_sum += activation_bytes
        self.total_arrivals += 1
        if self.trim_on_event:
            self._trim(now)
        if self.on_arrive is not None:
            self.on_arrive(now)

    def on_dispatch(self, now: float, wait_s: float) -> None:
        self.waits.append((now, wait_s))
        self._wait_sum += wait_s
        if self.trim_on_event:
            self._trim(now)

    def on_complete(self, now: float, service_s: float) -> None:
        self.services.append((now, service_s))
        self._busy_sum += service_s
        self.total_completions += 1
        if self.trim_on_event:
            self._trim(now)

    def on_batch(self, size: int, service_s: float) -> None:
        """One successful stage call that carried ``size`` requests (gateway_plugin.batching) and took ``service_s``."""
        self.batches.record(size, service_s)

    def batch_service_s(self) -> tuple[tuple[int, int, float], ...]:
        """(requests per call, calls, mean service s of such a call), by size: the stage's service time by batch."""
        return self.batches.table()

    # ------------------------------------------------------------------------------ window
    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        removed = 0
        arrivals = self.arrivals
        while arrivals and arrivals[0] < cutoff:
            first = arrivals.popleft()
            if arrivals:
                gap = arrivals[0] - first
                self._gap_sq_sum -= gap * gap
            removed += 1
        recent, recent_cutoff = self.recent, now - self.recent_s
        while recent and recent[0] < recent_cutoff:
            recent.popleft()
        waits = self.waits
        while waits and waits[0][0] < cutoff:
            self._wait_sum -= waits.popleft()[1]
            removed += 1
        services = self.services
        while services and services[0][0] < cutoff:
            self._busy_sum -= services.popleft()[1]
            removed += 1
        acts = self.activations
        while acts and acts[0][0] < cutoff:
            self._act_sum -= acts.popleft()[1]
            removed += 1
        if removed:
            self._removed += removed
            if self._removed > len(arrivals) + len(waits) + len(services) + len(acts):
                self._rebuild()

    def _rebuild(self) -> None:
        """Recompute the running sums from the windows (bounds floating-point drift)."""
        self._wait_sum = math.fsum(w for _, w in self.waits)
        self._busy_sum = math.fsum(s for _, s in self.services)
        self._act_sum = math.fsum(b for _, b in self.activations)
        a = self.arrivals
        self._gap_sq_sum = math.fsum((y - x) ** 2 for x, y in zip(a, itertools.islice(a, 1, None), strict=False))
        self._removed = 0

    # -------------------------------------------------------------------------- statistics
    def arrival_rate(self, now: float, window_s: float | None = None) -> float:
        """Arrivals per second over ``window_s`` (default the window; ``recent_s`` is O(1) too)."""
        self._trim(now)
        if window_s is None:
            return len(self.arrivals) / self.window_s
        if window_s == self.recent_s:
            return len(self.recent) / window_s
        cutoff, count = now - window_s, 0
        for t in reversed(self.arrivals):  # other short windows: count back from the newest
            if t < cutoff:
                break
            count += 1
        return count / window_s

    def recent_rate(self, now: float) -> tuple[float, int, float]:
        """(arrivals per second, arrivals, seconds of traffic) over the last ``recent_s``, or since the stage's
        traffic began when that is shorter: (n − 1) / (now − first), the arrivals after the first over the time
        since it (a stage that woke 0.2 s ago at 140 req/s has a rate of 140/s, not 28/s over a second)."""
        recent, cutoff = self.recent, now - self.recent_s
        while recent and recent[0] < cutoff:
            recent.popleft()
        n = len(recent)
        span = now - self.active_since if self.active_since == self.active_since else 0.0  # nan: no traffic yet
        if span >= self.recent_s or n == 0:
            return n / self.recent_s, n, span
        return ((n - 1) / span if span > 0 else 0.0), n, span

    def mean_service_s(self, now: float) -> float:
        self._trim(now)
        if self.services:
            self.last_service_s = max(0.0, self._busy_sum) / len(self.services)
        return self.last_service_s

    def mean_wait_s(self, now: float) -> float:
        self._trim(now)
        return max(0.0, self._wait_sum) / len(self.waits) if self.waits else 0.0

    def cv_arrival(self, now: float) -> float:
        """std / mean of inter-arrival times in the window; 1.0 (Poisson) with fewer than 3 arrivals."""
        self._trim(now)
        n = len(self.arrivals)
        if n < 3:
            return 1.0
        gaps = n - 1
        mean = (self.arrivals[-1] - self.arrivals[0]) / gaps  # the gaps telescope
        if mean <= 0:
            return 0.0
        variance = max(0.0, self._gap_sq_sum / gaps - mean * mean)
        return math.sqrt(variance) / mean

    def busy_s(self, now: float) -> float:
        self._trim(now)
        return max(0.0, self._busy_sum) if self.services else 0.0

    def mean_activation_bytes(self, now: float) -> float:
        self._trim(now)
        return max(0.0, self._act_sum) / len(self.activations) if self.activations else 0.0


class ServingMetrics:
    """The serving metrics under vLLM's names (``vllm:*``, label ``model_name``), beside the project's own, so that
    dashboards, KEDA triggers and HPA rules written for vLLM read the gateway unchanged (docs/generation.md,
    "Metrics"). Fed by the ``/v1`` doors: a request waits from its arrival until its session is placed (KV room
    on every stage), then runs until its answer ends."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()  # None: a private one (no collector)
        label = ["model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "requests waiting for room (KV cache) before they run",
                             label, registry=registry)
        self.running = Gauge("vllm:num_requests_running", "requests running (placed sessions, embedding passes)",
                             label, registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "arrival to the first generated token", label,
                              buckets=FIRST_TOKEN_BUCKETS_S, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "time between consecutive generated tokens", label,
                             buckets=INTER_TOKEN_BUCKETS_S, registry=registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "the same gaps under vLLM's older name", label,
                              buckets=INTER_TOKEN_BUCKETS_S, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "arrival to the end of the answer", label,
                             buckets=REQUEST_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens processed (prefilled or embedded)", label,
                                     registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "tokens generated", label, registry=registry)

    def finished(self, model: str, e2e_s: float, prompt_tokens: int, generated: int = 0,
                 ttft_s: float | None = None, gaps_s: Iterable[float] = ()) -> None:
        """One request ended: its latency, its tokens (``prompt_tokens`` only when they were processed), its TTFT
        and the gaps between its tokens."""
        self.e2e.labels(model).observe(e2e_s)
        if prompt_tokens:
            self.prompt_tokens.labels(model).inc(prompt_tokens)
        if generated:
            self.generation_tokens.labels(model).inc(generated)
        if ttft_s is not None:
            self.ttft.labels(model).observe(ttft_s)
        itl, tpot = self.itl.labels(model), self.tpot.labels(model)
        for gap in gaps_s:
            itl.observe(gap)
            tpot.observe(gap)


class MetricsCollector:
    """All stages of all pipelines: windows, prometheus export, JSON snapshot, JSONL records."""

    def __init__(self, window_s: float = 10.0, records: IO[str] | None = None) -> None:
        self.window_s = window_s
        self.stages: dict[str, StageMetrics] = {}
        self.arrival_hook: Callable[[str, float], None] | None = None  # the controller's kick (watch_arrivals)
        self.records = records
        self._records_lock = threading.Lock()
        self.registry = CollectorRegistry()
        self.c_requests = Counter("quart_pipeline_requests", "finished pipeline requests", ["model", "code"], registry=self.registry)
        self.recent: deque[tuple[float, str, float, int]] = deque(maxlen=20_000)  # (end, model, latency ms, status)
        self.h_ttft = Histogram("quart_generation_ttft_seconds", "time to the first generated token", ["model"],
                                buckets=TOKEN_BUCKETS_S, registry=self.registry)
        self.h_tpot = Histogram("quart_generation_tpot_seconds", "mean time per generated token after the first",
                                ["model"], buckets=TOKEN_BUCKETS_S, registry=self.registry)
        self.serving = ServingMetrics(self.registry)

    def stage(self, function: str) -> StageMetrics:
        if function not in self.stages:
            self.stages[function] = StageMetrics(self.window_s)
            self._watch(function)
        return self.stages[function]

    def watch_arrivals(self, hook: Callable[[str, float], None] | None) -> None:
        """Tell ``hook(function, now)`` of every arrival at every stage, present and future (None: no one)."""
        self.arrival_hook = hook
        for function in self.stages:
            self._watch(function)

    def _watch(self, function: str) -> None:
        hook = self.arrival_hook
        self.stages[function].on_arrive = None if hook is None else (lambda now: hook(function, now))

    def record(self, rec: RequestRecord) -> None:
        self.c_requests.labels(rec.model, str(rec.status)).inc()
        self.recent.append((rec.end, rec.model, rec.latency_ms, rec.status))  # the status page's latency chart
        if rec.ttft_ms is not None:
            self.h_ttft.labels(rec.model).observe(rec.ttft_ms / 1000)
        if rec.tpot_ms is not None:
            self.h_tpot.labels(rec.model).observe(rec.tpot_ms / 1000)
        if self.records is not None:
            with self._records_lock:
                self.records.write(rec.to_json() + "\n")

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)


SNAPSHOT_GAUGES = (  # (metric, help, StageSnapshot attribute)
    ("quart_stage_arrival_rate", "λ_i, requests/s over the window", "arrival_rate"),
    ("quart_stage_service_rate", "μ_i, requests/s of one replica", "service_rate"),
    ("quart_stage_replicas", "r_i, ready replicas", "replicas"),
    ("quart_stage_queue_length", "q_i, requests waiting", "queue_len"),
    ("quart_stage_wait_seconds", "W_i, mean queueing delay over the window", "mean_wait_s"),
    ("quart_stage_arrival_cv", "CV_i of inter-arrival times", "cv_arrival"),
    ("quart_stage_utilisation", "busy time / (replicas × window)", "utilisation"),
    ("quart_stage_sessions", "generation sessions placed on the stage", "sessions"),
    ("quart_stage_kv_tokens", "KV-cache positions its sessions booked", "kv_tokens"),
    ("quart_stage_kv_capacity", "KV-cache positions its ready replicas hold at most", "kv_capacity"),
)


class SnapshotGauges:
    """The controller's latest pipeline snapshots as prometheus gauges, read at scrape time (a custom
    collector: nothing is written back into the metrics the snapshots were built from)."""

    def __init__(self, snapshots: Callable[[], Iterable[Any]]) -> None:
        self.snapshots = snapshots

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snaps = list(self.snapshots())
        for metric, doc, attr in SNAPSHOT_GAUGES:
            family = GaugeMetricFamily(metric, doc, labels=["model", "stage", "function"])
            for snap in snaps:
                for s in snap.stages:
                    family.add_metric([snap.model, str(s.index), s.name], float(getattr(s, attr)))
            yield family
