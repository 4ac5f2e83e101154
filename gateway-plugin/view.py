"""The plugin's one view of a platform: :class:`GatewayView` over any :class:`~gateway_plugin.ports.Platform`.

The platform (the embedded gateway, or the OpenFaaS view of the standalone plugin) says what is deployed and
where its replicas are; this view reads the functions' labels the same way for both: the router's
:class:`~gateway_plugin.ports.ReplicaSource` (the plugin's default concurrency where a function sets none), the
controller's ``Inventory`` (``StageState`` per stage) and its ``DecisionNotes``, and what the router, the session
engine and the generation API read per function (CPUs and parameter bytes, batch limits, decode batch, model folder).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from gateway_plugin.batching import BatchLimits, batch_state, limits_from_labels
from gateway_plugin.ports import Platform, Range, Replica
from gateway_plugin.snapshot_builder import StageState
from quart_kernel.admission import ServiceTimes
from quart_stage import labels as vocab
from quart_stage.config import computes_on_cpu


class GatewayView:
    """ReplicaSource + Inventory + DecisionNotes over a platform, its labels read once per deployment."""

    def __init__(self, platform: Platform, default_concurrency: int = 1) -> None:
        self.platform = platform
        self.default_concurrency = default_concurrency
        self._meta: dict[str, tuple[Mapping[str, str], tuple[float, int]]] = {}  # function -> (its labels, stage_meta)
        self._batch: dict[str, tuple[Mapping[str, str], BatchLimits]] = {}  # function -> (its labels, batch limits)
        self.batch_default = BatchLimits()  # the plugin's QUART_BATCH_MAX / QUART_BATCH_WAIT_MS (Plugin sets it)

    # ---------------------------------------------------------------- ReplicaSource (the platform's, concurrency here)

    def ready(self, function: str) -> Sequence[Replica]:
        return self.platform.ready(function)

    def concurrency(self, function: str) -> int:
        facts = self.platform.function(function)
        return (facts.concurrency if facts is not None else 0) or self.default_concurrency

    def take(self, function: str, replica: Replica) -> None:
        self.platform.take(function, replica)

    def give_back(self, function: str, replica: Replica) -> None:
        self.platform.give_back(function, replica)

    def wait(self, function: str) -> asyncio.Future[None]:
        return self.platform.wait(function)

    def waiting(self, function: str) -> int:
        return self.platform.waiting(function)

    def service_times(self, function: str) -> ServiceTimes:
        return self.platform.service_times(function)

    def note_held(self, function: str, replica: Replica, held: Range) -> None:
        self.platform.note_held(function, replica, held)

    def mark_unreachable(self, function: str, replica: Replica) -> None:
        self.platform.mark_unreachable(function, replica)

    def scale_from_zero(self, functions: Sequence[str]) -> None:
        self.platform.scale_from_zero(functions)

    # ---------------------------------------------------------------- Inventory, DecisionNotes

    def pipelines(self) -> dict[str, list[str]]:
        return self.platform.pipelines()

    def stage_state(self, function: str) -> StageState:
        facts = self.platform.function(function)
        if facts is None:
            raise KeyError(f"no function named {function!r} is deployed")
        labels = vocab.StageLabels.lenient(facts.labels)
        return StageState(
            ready=facts.ready, desired=facts.desired, cpus=facts.cpus or 1.0,
            min_replicas=facts.min_replicas, max_replicas=facts.max_replicas,
            concurrency=facts.concurrency or self.default_concurrency,
            param_bytes=labels.param_bytes, profiled_service_s=labels.profile_ms / 1000.0,
            start_s=facts.start_s, cpu_bound=computes_on_cpu(facts.env),
            **batch_state(self.batch_limits(function, self.batch_default)),
        )

    def note_decision(self, function: str, text: str) -> None:
        self.platform.note_decision(function, text)

    def check_placement(self, function: str) -> None:
        self.platform.check_placement(function)

    # ---------------------------------------------------------------- what the router and the engines read per function

    def stage_meta(self, function: str) -> tuple[float, int]:
        """(cpus, parameter bytes) of a stage, read from its labels once per deployment (the router asks per call)."""
        facts = self.platform.function(function)
        if facts is None:
            return (1.0, 0)
        cached = self._meta.get(function)
        if cached is None or cached[0] is not facts.labels:
            meta = (facts.cpus or 1.0, vocab.StageLabels.lenient(facts.labels).param_bytes)
            cached = self._meta[function] = (facts.labels, meta)
        return cached[1]

    def batch_limits(self, function: str, default: BatchLimits) -> BatchLimits:
        """What the function's ``com.quart.batch.*`` labels say (``default`` where they say nothing), once per deployment."""
        facts = self.platform.function(function)
        if facts is None:
            return default
        cached = self._batch.get(function)
        if cached is None or cached[0] is not facts.labels:
            cached = self._batch[function] = (facts.labels, limits_from_labels(facts.labels, default))
        return cached[1]

    def decode_batch_max(self, function: str, default: int) -> int:
        """Sessions per batched decode step on the function's replicas: its ``com.quart.batch.decode-max`` label
        (validated at deploy), else ``default`` (``QUART_GEN_DECODE_BATCH_MAX``)."""
        facts = self.platform.function(function)
        if facts is None:
            return default
        return vocab.StageLabels.lenient(facts.labels).decode_batch or default

    def model_dir(self, model: str) -> str | None:
        """Where a pipeline's tokenizer is: its stage 0's ``QUART_MODEL_DIR``, else its ``QUART_MODEL_URL``."""
        stages = self.pipelines().get(model)
        facts = self.platform.function(stages[0]) if stages else None
        env = facts.env if facts is not None else {}
        return env.get("QUART_MODEL_DIR") or env.get("QUART_MODEL_URL")

    def namespace_of(self, model: str) -> str | None:
        """The namespace a pipeline's stage functions live in (None: no such pipeline)."""
        stages = self.pipelines().get(model)
        facts = self.platform.function(stages[0]) if stages else None
        return facts.namespace if facts is not None else None
