"""The stack.yml `quartctl partition` writes carries what faas-netes honours on Kubernetes (scale labels,
limits and requests, GPU constraints and profile annotations) and still deploys unchanged on the embedded
gateway: `quartctl up -f` of a written stack serves it, with those fields kept."""

from __future__ import annotations

import json

import requests
import yaml
from quart_provider.deployment import FunctionDeployment
from quart_provider.stack import load_stack
from quart_stage.labels import StageLabels
from quart_tools.partition import main, partition
from quart_tools.stackfile import GPU_CONSTRAINT, GPU_PROFILE
from support.cli import down_and_wait, quartctl


def _deployments(stack_path) -> dict[str, FunctionDeployment]:
    """What the embedded gateway makes of each function: the requests faas-cli would send, validated."""
    stack = load_stack(stack_path, env={})
    return {f.name: FunctionDeployment.from_json(f.request, "openfaas-fn") for f in stack.functions}


def test_cuda_stages_carry_gpu_placement_scale_labels_and_limits(tmp_path):
    out = tmp_path / "tiny"
    partition("tiny", 2, str(out), weights="none", progress=False, stack={"compute": "cuda", "scale_max": 6})
    deployments = _deployments(out / "stack.yml")
    assert list(deployments) == ["tiny-stage-0", "tiny-stage-1"]
    for stage, d in enumerate(deployments.values()):
        assert d.labels["com.openfaas.scale.min"] == "1" and d.labels["com.openfaas.scale.max"] == "6"
        assert d.labels["com.openfaas.scale.factor"] == "20"  # the gateway's default; it refuses 0
        assert d.labels["com.openfaas.scale.zero"] == "false"
        assert StageLabels.parse(d.labels).stage == stage
        assert d.constraints == [GPU_CONSTRAINT]  # faas-netes: key=value → the pod's nodeSelector
        assert d.annotations == {"com.openfaas.profile": GPU_PROFILE}
        assert d.limits and d.limits.memory_bytes and d.limits.cpus == 1.0
        assert d.requests and d.requests.memory_bytes and d.requests.memory_bytes < d.limits.memory_bytes
        assert d.env_vars["QUART_COMPUTE"] == "cuda"
        status = d.to_json()  # what GET /system/function answers: the fields are kept, not dropped
        assert status["constraints"] == [GPU_CONSTRAINT] and status["annotations"] == d.annotations


def test_gpu_placement_flags_and_cpu_stages(tmp_path):
    args = ["--model", "tiny", "--stages", "2", "--weights", "none", "--compute", "cuda"]
    assert main([*args, "--out", str(tmp_path / "a"), "--gpu-constraint", "", "--gpu-profile", "big-gpu"]) == 0
    for d in _deployments(tmp_path / "a" / "stack.yml").values():
        assert d.constraints == [] and d.annotations == {"com.openfaas.profile": "big-gpu"}
    assert main(["--model", "tiny", "--stages", "2", "--weights", "none", "--compute", "cpu",
                 "--out", str(tmp_path / "c")]) == 0
    for d in _deployments(tmp_path / "c" / "stack.yml").values():  # a CPU stack never asks for GPU nodes
        assert d.constraints == [] and d.annotations == {}


def test_stack_fields_the_gateway_does_not_use_are_accepted(tmp_path):
    out = tmp_path / "tiny"
    partition("tiny", 2, str(out), weights="none", progress=False, stack={"compute": "cuda"})
    doc = yaml.safe_load((out / "stack.yml").read_text())
    doc["configuration"] = {"templates": [{"name": "pipeline-stage"}]}
    for fn in doc["functions"].values():  # faas-cli build-time fields and a secret
        fn |= {"build_args": {"TORCH_INDEX_URL": "https://example.invalid/cu128"}, "skip_build": True,
               "secrets": ["registry-token"], "readonly_root_filesystem": True}
    (out / "stack.yml").write_text(yaml.safe_dump(doc))
    for d in _deployments(out / "stack.yml").values():
        assert d.secrets == ["registry-token"] and d.read_only_root_filesystem
        assert d.constraints == [GPU_CONSTRAINT]


def test_quartctl_up_serves_a_written_stack_with_its_kubernetes_fields(tmp_path):
    out = tmp_path / "tiny"
    partition("tiny", 2, str(out), weights="none", progress=False, stack={"compute": "emulated",
                                                                           "emulated_mean_ms": 1.0})
    state = tmp_path / "state"
    res = quartctl("up", "-f", str(out / "stack.yml"), "--port", "0", "--state-dir", str(state), "--detach",
                   cwd=tmp_path)
    tracked: list[int] = []
    try:
        assert res.returncode == 0, res.stdout + res.stderr
        info = json.loads((state / "up.json").read_text())
        tracked = [info["pid"]] + [h["pid"] for h in info["hosts"]]
        password = (state / "secrets" / "basic-auth-password").read_text().strip()
        for name in ("tiny-stage-0", "tiny-stage-1"):
            status = requests.get(f"{info['url']}/system/function/{name}", auth=("admin", password),
                                  timeout=10).json()
            assert status["labels"]["com.openfaas.scale.factor"] == "20", status
            assert status["labels"]["com.openfaas.scale.zero"] == "false"
            assert status["limits"]["cpu"] == "1" and status["requests"]["memory"].endswith("Mi")
        answer = requests.post(f"{info['url']}/function/tiny", json={"input_ids": [[1, 2, 3]]}, timeout=120)
        assert answer.status_code == 200, answer.text[:300]
    finally:
        down_and_wait(state, tmp_path, tracked)
