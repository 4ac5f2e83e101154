"""Talking to the node's KeysManager from a stage pod, without torch: the stage's spec and JSON calls.

Shared by the attach path (``quart_stage.attach``: map the cached segment) and the fork path
(``quart_stage.forward``: a replica forked on the node, this pod forwarding to it). Both name the stage the
same way, so the pods of one function share one zygote per node.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from quart_stage.config import StageConfig
from quart_stage.unixhttp import UnixHTTPConnection

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: this container's CPU quota
_NOT_SENT = ("QUART_KEYSMANAGER_SOCKET",)  # where the KeysManager is, not what the stage is


class NodeCacheError(RuntimeError):
    """The node's KeysManager could not be reached or refused (the message says why; ``status`` its answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


def cgroup_cpus(cpu_max: str = CGROUP_CPU_MAX) -> float | None:
    """This container's CPU limit from its cgroup (v2 ``cpu.max``: "quota period", or "max" for none)."""
    try:
        with open(cpu_max) as fh:
            quota, period = fh.read().split()[:2]
        return None if quota == "max" else max(0.01, int(quota) / int(period))
    except (OSError, ValueError):
        return None


def stage_spec(cfg: StageConfig, cpu_max: str = CGROUP_CPU_MAX) -> dict:
    """The KeysManager's ``StageSpec`` of this stage: its function name and ``QUART_*`` environment. Its CPUs
    are the pod's CPU limit (what the gateway's CPU compensation grants, ``faas-cli --cpu-limit``), so the
    replica the node's KeysManager forks outside the pod's cgroup gets that many cores and torch threads;
    ``QUART_THREADS`` without a limit."""
    env = {k: v for k, v in sorted(cfg.to_env().items()) if k not in _NOT_SENT}
    source = (cfg.model_dir or cfg.model_url or "stage").rstrip("/")
    base = _NAME_CHARS.sub("-", os.path.basename(source)).strip("-.")[:80] or "stage"
    digest = hashlib.sha256(json.dumps(env).encode()).hexdigest()[:8]
    return {"function": f"{base}-stage-{cfg.stage_index}-{digest}", "env": env,
            "cpus": cgroup_cpus(cpu_max) or float(cfg.threads)}


def km_call(socket_path: str, method: str, route: str, body: Any, timeout_s: float) -> dict:
    """One JSON call on the KeysManager's socket; its answer, or NodeCacheError naming the cause."""
    conn = UnixHTTPConnection(socket_path, timeout_s)
    try:
        payload = None if body is None else json.dumps(body).encode()
        conn.request(method, route, body=payload, headers={"Content-Type": "application/json"} if payload else {})
        resp = conn.getresponse()
        raw = resp.read()
    except OSError as exc:
        raise NodeCacheError(f"cannot reach the KeysManager at {socket_path}: {exc}") from None
    finally:
        conn.close()
    try:
        answer = json.loads(raw)
    except ValueError:
        raise NodeCacheError(f"the KeysManager answered {resp.status} with a body that is not JSON", resp.status) from None
    if resp.status != 200 or not isinstance(answer, dict):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise NodeCacheError(f"the KeysManager answered {resp.status}: {error}", resp.status)
    return answer
