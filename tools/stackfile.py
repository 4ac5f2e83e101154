"""The faas-cli stack.yml of a partitioned model (written by `quartctl partition`): one function per stage.

Fields faas-netes honours on Kubernetes (labels, limits/requests, constraints, annotations) are written so
that the same file deploys unchanged with `faas-cli deploy -f` on OpenFaaS and `quartctl up -f` on one
machine (the embedded gateway accepts and keeps them). What faas-netes does with each: docs/kubernetes.md.
"""

from __future__ import annotations

import math
import os

from quart_stage.config import DEFAULT_MAX_BODY_BYTES
from quart_stage.manifest import Manifest

from keysmanager.registry import MODEL_URL_ENV

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # realpath: also through a symlinked package
HANDLERS = {"decoder": "decoder-lm", "encoder": "encoder"}  # model family -> handler folder in functions/

GPU_CONSTRAINT = "nvidia.com/gpu.present=true"  # node label of NVIDIA GPU feature discovery / GPU operator
GPU_PROFILE = "quart-gpu"  # an OpenFaaS Pro Profile (runtimeClassName, tolerations); CE ignores the annotation


def _mebibytes(n: int) -> str:
    return f"{max(64, int(math.ceil(n / (1 << 20))))}Mi"


def stack_document(model: str, family: str, stages: int, out: str, *, profile: str | None = None,
                   manifest: Manifest | None = None, compute: str = "cpu", scale_min: int = 1,
                   scale_max: int = 16, concurrency: int = 1, model_dir_value: str | None = "",
                   gateway: str = "http://127.0.0.1:8080", image: str | None = None, threads: int = 1,
                   max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, emulated_mean_ms: float | None = None,
                   stack_dir: str | None = None, model_url: str | None = None,
                   gpu_constraint: str = GPU_CONSTRAINT, gpu_profile: str = GPU_PROFILE) -> dict:
    """The faas-cli stack.yml of a partitioned model: one `<model>-stage-<i>` function per stage.

    model_dir_value: what QUART_MODEL_DIR says ("" = the absolute `out` path; None = no model dir, for
    parameter-free emulated stages). stack_dir: where stack.yml will live (handler paths are relative
    to it; default `out`). model_url: the model in the registry (``s3://…``, ``QUART_MODEL_URL``), which
    replaces QUART_MODEL_DIR: a host fetches the stage from there. For ``compute="cuda"`` stages,
    gpu_constraint (faas-netes turns ``key=value`` constraints into a nodeSelector) and gpu_profile (the
    ``com.openfaas.profile`` annotation of OpenFaaS Pro) place them on GPU nodes; "" leaves either out.
    What faas-netes does with each field: docs/kubernetes.md.
    """
    stack_dir = os.path.abspath(stack_dir or out)
    folder = HANDLERS.get(family, "decoder-lm")
    handler = os.path.join(REPO_ROOT, "functions", folder)
    if os.path.commonpath([stack_dir, REPO_ROOT]) == REPO_ROOT:  # inside the repo: relative, as faas-cli expects
        handler = os.path.relpath(handler, stack_dir)
        handler = handler if handler.startswith(".") else "./" + handler
    if model_dir_value == "":
        model_dir_value = os.path.abspath(out)
    functions = {}
    for i in range(stages):
        env = {"QUART_MODEL_DIR": model_dir_value} if model_dir_value is not None else {}
        if model_url and model_dir_value is not None:
            env = {MODEL_URL_ENV: model_url}
        env |= {"QUART_STAGE_INDEX": str(i), "QUART_NUM_STAGES": str(stages), "QUART_COMPUTE": compute,
               "QUART_MAX_BODY_BYTES": str(max_body_bytes), "QUART_THREADS": str(threads),
               "max_inflight": str(concurrency), "read_timeout": "60s", "write_timeout": "60s",
               "exec_timeout": "60s", "upstream_timeout": "55s"}
        if compute == "emulated":
            if emulated_mean_ms is not None:
                env["QUART_EMULATED_MEAN_MS"] = str(emulated_mean_ms)
            elif profile:
                env["QUART_PROFILE"] = profile
            if model_dir_value is None:
                env["QUART_MODEL"] = model
        param_bytes = manifest.stages[i].parameter_bytes if manifest else 0
        gpu = compute == "cuda"
        fn = {
            "lang": "pipeline-stage",
            "handler": handler,
            "image": image or f"quart-faas/{folder}:0.1.0",
            "environment": env,
            "labels": {
                "com.openfaas.scale.min": str(scale_min), "com.openfaas.scale.max": str(scale_max),
                # the gateway refuses a factor outside 1-100 (404 on every call with scale_from_zero=true): its
                # default 20; the QUART controller is the autoscaler (docs/kubernetes.md: AlertManager's rule off)
                "com.openfaas.scale.factor": "20", "com.openfaas.scale.zero": "false",
                "com.quart.model": model, "com.quart.stage": str(i), "com.quart.stages": str(stages),
                "com.quart.concurrency": str(concurrency),
            },
            "limits": {"memory": _mebibytes(2 * param_bytes + (512 << 20)), "cpu": str(max(1, threads))},
            "requests": {"memory": _mebibytes(param_bytes + (256 << 20)), "cpu": str(max(1, threads))},
        }
        if gpu and gpu_constraint:
            fn["constraints"] = [gpu_constraint]
        if gpu and gpu_profile:
            fn["annotations"] = {"com.openfaas.profile": gpu_profile}
        functions[f"{model}-stage-{i}"] = fn
    return {"version": 1.0, "provider": {"name": "openfaas", "gateway": gateway}, "functions": functions}


def write_stack(doc: dict, path: str, command: str | None = None) -> None:
    import yaml

    header = "# Generated by `quartctl partition`; deploy with `faas-cli deploy -f` or `quartctl deploy`.\n"
    if command:
        header += f"# {command}\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(header)
        yaml.safe_dump(doc, f, sort_keys=False)
