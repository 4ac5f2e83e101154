"""What `quartctl partition` writes passes the OpenFaaS gateway's own label checks (gateway 0.27, chart defaults).

The gateway's rules, restated from its source (openfaas/faas ``gateway/plugin/external.go`` GetReplicas and
``gateway/scaling/function_scaler.go`` Scale), not imported: a label value that is empty or not an integer
falls back to the default (min 1, max 20, factor 20); a scaling factor outside 1..100 makes the query fail,
and with ``scale_from_zero=true`` every ``/function/<name>`` call then answers 404 "bad scaling factor";
scale from zero asks for ``max(1, min)`` replicas when none is available.
"""

from __future__ import annotations

import pytest
import yaml
from quart_tools.partition import partition
from support.paths import REPO

DEFAULTS = {"com.openfaas.scale.min": 1, "com.openfaas.scale.max": 20, "com.openfaas.scale.factor": 20}


class BadScalingFactor(Exception):
    pass


def label_value(raw: str | None, fallback: int) -> int:
    """The gateway's lenient label parse: empty or not an integer → the fallback."""
    if not raw:
        return fallback
    try:
        return int(raw)
    except ValueError:
        return fallback


def gateway_query(labels: dict[str, str]) -> dict[str, int]:
    """min/max/factor as the gateway's service query reads them; raises as it refuses a bad factor."""
    out = {key: label_value(labels.get(key), default) for key, default in DEFAULTS.items()}
    factor = out["com.openfaas.scale.factor"]
    if not 0 < factor <= 100:
        raise BadScalingFactor(f"bad scaling factor: {factor}, is not in range of [0 - 100]")
    return out


def scale_from_zero_target(labels: dict[str, str]) -> int:
    """The replicas the gateway asks for when a call finds none available."""
    return max(1, gateway_query(labels)["com.openfaas.scale.min"])


def test_the_replayed_checks_refuse_what_the_gateway_refuses():
    with pytest.raises(BadScalingFactor):
        gateway_query({"com.openfaas.scale.factor": "0"})
    with pytest.raises(BadScalingFactor):
        gateway_query({"com.openfaas.scale.factor": "101"})
    assert gateway_query({"com.openfaas.scale.factor": "x"})["com.openfaas.scale.factor"] == 20
    assert scale_from_zero_target({"com.openfaas.scale.min": "0"}) == 1


@pytest.mark.parametrize("scale_min", [0, 1, 3])
def test_partition_labels_pass_the_gateway_checks_and_scale_from_zero(tmp_path, scale_min):
    out = tmp_path / "tiny"
    partition("tiny", 2, str(out), weights="none", progress=False, stack={"scale_min": scale_min, "scale_max": 6})
    functions = yaml.safe_load((out / "stack.yml").read_text())["functions"]
    assert len(functions) == 2
    for fn in functions.values():
        labels = fn["labels"]
        assert all(isinstance(v, str) for v in labels.values())  # OpenFaaS labels are strings
        query = gateway_query(labels)
        assert 1 <= query["com.openfaas.scale.factor"] <= 100
        assert query["com.openfaas.scale.min"] == scale_min and query["com.openfaas.scale.max"] == 6
        assert scale_from_zero_target(labels) == max(1, scale_min)


def test_the_repository_stack_passes_the_gateway_checks():

    stack = yaml.safe_load((REPO / "stack.yml").read_text())
    for fn in stack["functions"].values():
        gateway_query(fn["labels"])
