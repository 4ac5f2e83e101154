"""The label vocabulary of stage functions: names, parsing, and pipelines from labels.

OpenFaaS's own labels (``com.openfaas.scale.*``) keep OpenFaaS's meaning and defaults; ours are
``com.quart.*``. ``quartctl partition`` writes them into stack.yml; the provider, the plugin and the
simulator read them through this module only. A malformed label is a 400 naming ``labels.<name>``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from quart_stage.errors import QuartError

SCALE_MIN = "com.openfaas.scale.min"
SCALE_MAX = "com.openfaas.scale.max"
SCALE_ZERO = "com.openfaas.scale.zero"
MODEL = "com.quart.model"  # the pipeline this function is a stage of
STAGE = "com.quart.stage"  # 0-based position in the pipeline
STAGES = "com.quart.stages"  # stage count of the pipeline
CONCURRENCY = "com.quart.concurrency"  # requests one replica serves at once (0 = unlimited)
PARAM_BYTES = "com.quart.param-bytes"  # parameter bytes of one replica
PROFILE_MS = "com.quart.profile-ms"  # profiled service time of the stage
BATCH_MAX = "com.quart.batch.max"  # requests the router sends a replica in one call (1 = no batching)
BATCH_WAIT_MS = "com.quart.batch.wait-ms"  # how long a short batch waits for more requests (0 = none)
DECODE_BATCH_MAX = "com.quart.batch.decode-max"  # generation sessions in one batched decode step (1 = no batching)
MAX_DECODE_BATCH = 256  # the largest decode batch a label or setting may ask for
BATCH_PROFILE_MS = "com.quart.batch.profile-ms"  # profiled ms of one call by batch size, "1:23,16:100" (policies)
# "off": replicas cold-start like a plain OpenFaaS function (the paper's baselines); "on": fork from the cache
KEYSMANAGER = "com.quart.keysmanager"

DEFAULT_MIN_REPLICAS = 1  # OpenFaaS's default minimum
DEFAULT_MAX_REPLICAS = 20  # OpenFaaS CE's default maximum


def _error(key: str, message: str) -> QuartError:
    return QuartError(400, f"label {key} {message}", f"labels.{key}")


def label_int(labels: Mapping[str, str], key: str, default: int, minimum: int = 0) -> int:
    """An integer label (``default`` when absent or empty); below ``minimum`` or not an integer → 400."""
    raw = labels.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise _error(key, f"must be an integer, got {raw!r}") from None
    if value < minimum:
        raise _error(key, f"must be at least {minimum}, got {value}")
    return value


def label_float(labels: Mapping[str, str], key: str, default: float, minimum: float = 0.0) -> float:
    """A finite number label, at least ``minimum``."""
    raw = labels.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(str(raw).strip())
    except ValueError:
        raise _error(key, f"must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value < minimum:
        raise _error(key, f"must be a finite number of at least {minimum:g}, got {raw!r}")
    return value


def label_switch(labels: Mapping[str, str], key: str, default: bool) -> bool:
    """An ``on`` / ``off`` label."""
    raw = labels.get(key)
    if raw is None or raw == "":
        return default
    if raw not in ("on", "off"):
        raise _error(key, f"must be on or off, got {raw!r}")
    return raw == "on"


@dataclass(frozen=True, slots=True)
class StageLabels:
    """What the labels of one function say about it."""

    model: str | None  # None: not a pipeline stage
    stage: int = 0
    stages: int = 0  # 0 = not stated
    min_replicas: int = DEFAULT_MIN_REPLICAS
    max_replicas: int = DEFAULT_MAX_REPLICAS
    concurrency: int = 0
    param_bytes: int = 0
    profile_ms: float = 0.0
    param_cache: bool = True
    decode_batch: int = 0  # 0 = the gateway's QUART_GEN_DECODE_BATCH_MAX

    @classmethod
    def parse(cls, labels: Mapping[str, str]) -> StageLabels:
        """Every label checked; the first malformed one → 400 naming it."""
        out = cls(
            model=labels.get(MODEL) or None,
            stage=label_int(labels, STAGE, 0),
            stages=label_int(labels, STAGES, 0),
            min_replicas=label_int(labels, SCALE_MIN, DEFAULT_MIN_REPLICAS),
            max_replicas=label_int(labels, SCALE_MAX, DEFAULT_MAX_REPLICAS),
            concurrency=label_int(labels, CONCURRENCY, 0),
            param_bytes=label_int(labels, PARAM_BYTES, 0),
            profile_ms=label_float(labels, PROFILE_MS, 0.0),
            param_cache=label_switch(labels, KEYSMANAGER, True),
            decode_batch=label_int(labels, DECODE_BATCH_MAX, 0, minimum=1),
        )
        if out.decode_batch > MAX_DECODE_BATCH:
            raise _error(DECODE_BATCH_MAX, f"must be at most {MAX_DECODE_BATCH}, got {out.decode_batch}")
        if out.min_replicas > out.max_replicas:
            raise _error(SCALE_MIN, f"({out.min_replicas}) is above {SCALE_MAX} ({out.max_replicas})")
        if out.stages and out.stage >= out.stages:
            raise _error(STAGE, f"({out.stage}) must be below {STAGES} ({out.stages})")
        return out

    @classmethod
    def lenient(cls, labels: Mapping[str, str]) -> StageLabels:
        """Like :meth:`parse`, but a function whose labels are malformed is not a stage of any pipeline
        (a bad label on one function must not break every other model's route)."""
        try:
            return cls.parse(labels)
        except QuartError:
            return cls(model=None)


def pipelines(functions: Iterable[tuple[str, Mapping[str, str]]]) -> dict[str, list[str]]:
    """model → its stage functions in stage order, from ``(function name, labels)`` pairs.

    Functions with malformed labels, and models whose stage numbers are not 0…n−1 once each, are left
    out: a pipeline with a hole or a duplicate cannot be routed."""
    stages: dict[str, list[tuple[int, str]]] = {}
    for name, labels in functions:
        parsed = StageLabels.lenient(labels)
        if parsed.model:
            stages.setdefault(parsed.model, []).append((parsed.stage, name))
    out: dict[str, list[str]] = {}
    for model, members in stages.items():
        members.sort()
        if [index for index, _ in members] == list(range(len(members))):
            out[model] = [name for _, name in members]
    return out
