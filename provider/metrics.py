"""Prometheus metrics under the OpenFaaS gateway's names, so its dashboards and alert rules work.

- ``gateway_function_invocation_started{function_name}`` (a counter, typed unknown: below)
- ``gateway_function_invocation_total{function_name,code}`` (counter)
- ``gateway_functions_seconds{function_name,code}`` (histogram)
- ``gateway_service_count{function_name}`` (gauge: desired replicas)

``function_name`` is ``<name>.<namespace>`` as in OpenFaaS. Counting is plain dict arithmetic on the
event loop (no locks, no per-request objects); prometheus_client renders the text format on scrape.
The counters keep OpenFaaS's names exactly (the Go client adds no ``_total`` suffix to
``..._started``), so they are emitted as explicit samples.

``/metrics`` answers OpenMetrics 1.0 (``exposition``) unless the scraper asks for the text format 0.0.4 only
(``Accept: text/plain``), which is what the OpenFaaS gateway serves. OpenMetrics wants a counter's samples to
end in ``_total``; so that the name OpenFaaS's dashboards query stays ``gateway_function_invocation_started``,
that one family is typed ``unknown`` (``untyped`` in the text format; ``rate()`` works on it the same).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from quart_transport.exposition import render_registry

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # prometheus DefBuckets


class _Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0


class GatewayMetrics:
    """Counters the proxy updates and the collector that exposes them."""

    def __init__(self, replicas: Callable[[], dict[str, int]]) -> None:
        self._replicas = replicas  # function_name → desired replicas, read at scrape time
        self.started: dict[str, int] = {}
        self.total: dict[tuple[str, str], int] = {}
        self.seconds: dict[tuple[str, str], _Histogram] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def invocation_started(self, function_name: str) -> None:
        self.started[function_name] = self.started.get(function_name, 0) + 1

    def invocation_done(self, function_name: str, code: int, seconds: float) -> None:
        key = (function_name, str(code))
        self.total[key] = self.total.get(key, 0) + 1
        hist = self.seconds.get(key)
        if hist is None:
            hist = self.seconds[key] = _Histogram()
        hist.counts[bisect_left(BUCKETS, seconds)] += 1
        hist.sum += seconds

    def collect(self) -> Iterator[Metric]:
        # typed unknown: a counter's samples must end in _total (OpenMetrics; prometheus_client's text format
        # declares the family as ..._total too), and the name OpenFaaS's dashboards query has none
        started = Metric("gateway_function_invocation_started", "The total number of function HTTP requests started.",
                         "unknown")
        for name, value in self.started.items():
            started.add_sample("gateway_function_invocation_started", {"function_name": name}, value)
        total = Metric("gateway_function_invocation", "Function metrics", "counter")
        for (name, code), value in self.total.items():
            total.add_sample("gateway_function_invocation_total", {"function_name": name, "code": code}, value)
        seconds = Metric("gateway_functions_seconds", "Function time taken", "histogram")
        for (name, code), hist in self.seconds.items():
            labels = {"function_name": name, "code": code}
            cumulative = 0
            for bound, count in zip(BUCKETS, hist.counts, strict=False):
                cumulative += count
                seconds.add_sample("gateway_functions_seconds_bucket", {**labels, "le": repr(bound)}, cumulative)
            cumulative += hist.counts[-1]
            seconds.add_sample("gateway_functions_seconds_bucket", {**labels, "le": "+Inf"}, cumulative)
            seconds.add_sample("gateway_functions_seconds_count", labels, cumulative)
            seconds.add_sample("gateway_functions_seconds_sum", labels, hist.sum)
        count = Metric("gateway_service_count", "Current count of replicas for function", "gauge")
        for name, value in self._replicas().items():
            count.add_sample("gateway_service_count", {"function_name": name}, value)
        yield from (started, total, seconds, count)

    def render(self) -> bytes:
        """The text format 0.0.4, as the OpenFaaS gateway serves it."""
        return generate_latest(self.registry)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """(body, content type) for a scrape: OpenMetrics unless ``accept`` asks for the text format only."""
        return render_registry(self.registry, accept)
