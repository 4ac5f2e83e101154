"""``/metrics`` is valid OpenMetrics (prometheus_client's own OpenMetrics parser reads all of it) with the OpenFaaS
gateway's metric names, and still the text format 0.0.4 for a scraper that asks for that only; the Grafana
dashboard in deploy/monitoring queries only series it serves."""

from __future__ import annotations

import json
import re
import time

import requests
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as text_families
from support.embedded_system import deploy_echo_pipeline, plugin_system
from support.paths import REPO

ROOT = REPO


def test_metrics_parse_as_openmetrics_with_openfaas_names(tmp_path, monkeypatch):
    system = plugin_system(tmp_path, monkeypatch, "0.2")
    try:
        deploy_echo_pipeline(system, "m", 2)
        assert requests.post(f"{system.url}/function/m", data=b"x", timeout=30).status_code == 200
        assert requests.post(f"{system.url}/function/m-stage-0", data=b"x", timeout=30).status_code == 200
        res = requests.post(f"{system.url}/v1/embeddings", json={"model": "m", "input": "x"}, timeout=30)
        assert res.status_code == 400 and res.json()["error"]["param"] == "model", res.text  # served; echo: no pooling
        assert requests.get(f"{system.url}/health", timeout=10).status_code == 200
        time.sleep(0.5)  # a control period: the stage gauges have values
        for accept in ("", "application/openmetrics-text; version=1.0.0; charset=utf-8,*/*;q=0.1"):
            res = requests.get(f"{system.url}/metrics", headers={"Accept": accept} if accept else {}, timeout=10)
            assert res.headers["Content-Type"].startswith("application/openmetrics-text"), res.headers
            families = {f.name: f for f in text_string_to_metric_families(res.text)}  # raises on invalid input
            samples = {s.name for f in families.values() for s in f.samples}
            assert {"gateway_function_invocation_started", "gateway_function_invocation_total",
                    "gateway_functions_seconds_bucket", "gateway_service_count"} <= samples, samples
            assert "quart_stage_queue_length" in samples and "quart_pipeline_requests_total" in samples
            assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:time_to_first_token_seconds",
                    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens"} <= set(families)  # vLLM's names too
            started = [s for s in families["gateway_function_invocation_started"].samples
                       if s.labels["function_name"] == "m-stage-0.openfaas-fn"]
            assert started and started[0].value >= 1
        # every series the Grafana dashboard queries is one this /metrics serves
        dashboard = json.loads((ROOT / "deploy/monitoring/grafana-dashboard.json").read_text())
        queried = {name for panel in dashboard["panels"] for target in panel["targets"]
                   for name in re.findall(r"\b((?:gateway|quart)_[a-z0-9_]+)", target["expr"])}
        assert len(queried) >= 8 and queried <= samples, queried - samples
        scrape = yaml.safe_load((ROOT / "deploy/monitoring/prometheus.yml").read_text())
        assert scrape["scrape_configs"][0]["metrics_path"] == "/metrics"
        # the text format the OpenFaaS gateway serves, for a scraper that asks for it
        res = requests.get(f"{system.url}/metrics", headers={"Accept": "text/plain;version=0.0.4"}, timeout=10)
        assert res.headers["Content-Type"].startswith("text/plain")
        assert "# TYPE gateway_function_invocation_started untyped" in res.text
        assert any(f.name == "gateway_function_invocation_started" for f in text_families(res.text))
    finally:
        system.close()
