"""Prometheus exposition for both gateways' ``/metrics``: OpenMetrics 1.0 unless the scraper asks for the text
format 0.0.4 only (``Accept: text/plain``, what the OpenFaaS gateway serves)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

OPENMETRICS = openmetrics.CONTENT_TYPE_LATEST


def wants_openmetrics(accept: str) -> bool:
    """OpenMetrics when asked for, or when the scraper names no format (curl, a browser); text 0.0.4 otherwise."""
    return "application/openmetrics-text" in accept or "text/plain" not in accept


def render_registry(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """(body, content type) of ``registry`` in the format ``accept`` picks (:func:`wants_openmetrics`)."""
    if wants_openmetrics(accept):
        return openmetrics.generate_latest(registry), OPENMETRICS
    return generate_latest(registry), CONTENT_TYPE_LATEST
