"""docs/openapi.yml against the embedded gateway with schemathesis: generated requests for every operation,
no answer may be a 5xx and every status must be one the document lists (both generation modes:
valid and invalid requests; derandomized, so CI sees the same cases)."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error, status_code_conformance
from support.embedded_system import ThreadedSystem
from support.paths import REPO

SPEC = REPO / "docs" / "openapi.yml"
schema = schemathesis.openapi.from_path(str(SPEC))


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    # the plugin attached, as `quartctl up` runs it: it serves the /v1 generation API the document names
    running = ThreadedSystem(tmp_path_factory.mktemp("openapi"), attach_plugin=True, ready_wait_s=2,
                             async_initial_retry_s=0.05)
    res = requests.post(f"{running.url}/system/functions", json={"service": "echo", "image": "quart/echo:latest"},
                        auth=running.auth, timeout=30)
    assert res.status_code == 202, res.text
    try:
        yield running
    finally:
        running.close()


def test_the_document_names_every_route():
    paths = set(schema.raw_schema["paths"])
    for path in ("/system/functions", "/system/secrets", "/system/logs", "/system/namespaces", "/function/{functionName}",
                 "/async-function/{functionName}", "/system/scale-function/{functionName}", "/v1/models",
                 "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/health"):
        assert path in paths


@schema.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, system):
    if case.query and case.operation.path == "/system/logs":
        case.query["follow"] = False  # a followed log streams until the client leaves
    case.call_and_validate(base_url=system.url, auth=system.auth, timeout=15, checks=[not_a_server_error, status_code_conformance])
