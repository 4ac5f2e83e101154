"""The function registry: the desired state the OpenFaaS control-plane calls change.

``deploy / update / remove / scale / update_limits / get`` back ``/system/functions`` and
``/system/scale-function``; ``pipelines()`` groups stage functions by model. What runs follows from
here by reconciliation (:mod:`.reconciler`), which the registry asks to act now through ``changed``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime

from quart_kernel.capacity import deploy_refusal
from quart_kernel.replicaset import note_key_scale, within_bounds
from quart_provider.deploy_limits import DeployCaps, check_count, check_labels, check_model, check_name
from quart_provider.deployment import FunctionDeployment, Resources
from quart_provider.hosts import Host
from quart_provider.images import ImageIndex, resolve
from quart_provider.secrets import SecretStore
from quart_provider.store import DeploymentStore
from quart_provider.types import Endpoint, FunctionState
from quart_stage import labels as vocab
from quart_stage.errors import QuartError, invalid

from keysmanager.aio import within

INVALIDATE_TIMEOUT_S = 5.0  # one host's answer to "drop the cached stage" (a host that is down gives none)


class Registry:
    """Deployed functions by name, and the key-stage scale-up history the placer reads."""

    def __init__(self, images: ImageIndex, hosts: Mapping[str, Host], max_body_bytes: int,
                 changed: Callable[[], None], retire: Callable[[FunctionState, Endpoint], None],
                 secrets: SecretStore, store: DeploymentStore | None = None, uids: range | None = None,
                 caps: DeployCaps | None = None) -> None:
        self.store = store  # durable copy of every function (None: in memory only)
        self.uids = uids  # one uid per function for its replicas (None: they run as the gateway's user)
        self.images = images
        self.secrets = secrets
        self.hosts = hosts
        self.max_body_bytes = max_body_bytes
        self.changed = changed  # reconcile now
        self.retire = retire  # drain and stop one replica
        self.functions: dict[str, FunctionState] = {}
        self.key_history: dict[str, int] = {}  # function → scale-ups flagged as a key stage's
        self.caps = caps or DeployCaps(1000, 64, 4096)
        self.reserved: dict[str, str] = {}  # /function/<name> someone else answers → who (deploy_limits)
        self._pipelines: dict[str, list[str]] = {}
        self._pipelines_key: tuple = ()

    def get(self, name: str) -> FunctionState:
        fn = self.functions.get(name)
        if fn is None:
            raise QuartError(404, f"function {name!r} not found", "functionName")
        return fn

    async def deploy(self, deployment: FunctionDeployment) -> FunctionState:
        """Create a function (POST /system/functions); starts ``com.openfaas.scale.min`` replicas."""
        if deployment.service in self.functions:
            raise QuartError(400, f"function {deployment.service!r} already exists; update it with "
                                    "PUT /system/functions", "service")
        check_count(deployment.namespace, (f.deployment.namespace for f in self.functions.values()), self.caps)
        self._check_limits(deployment)
        self._check_secrets(deployment)
        runnable = resolve(deployment, self.images)
        self._check_capacity(deployment, runnable.kind)
        fn = FunctionState(deployment, runnable, deployment.min_replicas, datetime.now(UTC),
                           secrets_source=str(self.secrets.folder), run_as=self._free_uid())
        self.functions[deployment.service] = fn
        self._save(fn)
        self.changed()
        return fn

    async def update(self, deployment: FunctionDeployment) -> FunctionState:
        """Replace a function's spec (PUT /system/functions): a rolling update to a new generation.

        When what a replica runs is unchanged (same image resolution, environment, limits and
        concurrency: only labels such as ``com.openfaas.scale.min/max`` or annotations differ), the
        running replicas are kept and only the desired count is clamped to the new bounds. When only the CPUs
        differ (QUART's CPU compensation), nothing rolls: the generation stays, and the
        reconciler resizes the running replicas in place (``resize`` actions of `quart_kernel.convergence`).
        """
        fn = self.get(deployment.service)
        self._check_limits(deployment)
        self._check_secrets(deployment)
        runnable = resolve(deployment, self.images)
        self._check_capacity(deployment, runnable.kind)
        before = fn.replica_spec(self.max_body_bytes)
        fn.deployment, fn.runnable = deployment, runnable
        fn.desired = within_bounds(fn.desired, deployment.max_replicas, deployment.min_replicas)
        after = fn.replica_spec(self.max_body_bytes)
        if replace(after, cpus=before.cpus) != before:  # more than the CPUs: a new generation
            fn.generation += 1
            await self._invalidate(fn.name)
        self._save(fn)
        self.changed()
        return fn

    async def remove(self, name: str) -> None:
        """Delete a function (DELETE /system/functions): drain and stop all its replicas."""
        fn = self.get(name)
        del self.functions[name]
        if self.store is not None:
            self.store.delete(name)
        fn.desired = 0
        for endpoint in list(fn.replicas.values()):
            self.retire(fn, endpoint)
        fn.wake()
        await self._invalidate(name)

    async def scale(self, name: str, replicas: int, key: bool = False) -> int:
        """Set desired replicas (clamped to ``com.openfaas.scale.max``); returns the count applied."""
        return self.set_desired(name, replicas, key)

    def set_desired(self, name: str, replicas: int, key: bool = False) -> int:
        """:meth:`scale` from code on the loop (the balancer's scale from zero): saved, counted, reconciled."""
        if replicas < 0:
            raise QuartError(400, f"replicas must not be negative, got {replicas}", "replicas")
        fn = self.get(name)
        applied = within_bounds(replicas, fn.deployment.max_replicas)
        note_key_scale(self.key_history, name, fn.desired, applied, key)
        if applied != fn.desired:
            fn.desired = applied
            self._save(fn)
        self.changed()
        return applied

    def _save(self, fn: FunctionState) -> None:
        if self.store is not None:
            self.store.save(fn.name, fn.deployment.to_request(), fn.desired, fn.created_at, fn.run_as)

    def _free_uid(self, wanted: int | None = None) -> int | None:
        """``wanted`` when it is in the range and no other function has it, else the lowest free uid."""
        if self.uids is None:
            return None
        taken = {fn.run_as for fn in self.functions.values()}
        if wanted in self.uids and wanted not in taken:
            return wanted
        for uid in self.uids:
            if uid not in taken:
                return uid
        raise QuartError(507, f"every uid of replica_uids ({self.uids.start}-{self.uids.stop - 1}) has a function",
                         "service")

    def restore(self) -> list[str]:
        """The functions a previous gateway on this state folder had, deployed again at their desired
        replicas (`quartctl up` after `down`, a crash or a restart); returns their names."""
        if self.store is None:
            return []
        restored = []
        for stored in self.store.load():
            name = str(stored.request.get("service"))
            try:
                deployment = FunctionDeployment.from_json(stored.request, self.secrets.namespace)
                runnable = resolve(deployment, self.images)
            except QuartError as exc:
                self.store.set_aside(name, str(exc))
                continue
            desired = within_bounds(stored.desired, deployment.max_replicas)
            self.functions[deployment.service] = FunctionState(deployment, runnable, desired, stored.created_at,
                                                               secrets_source=str(self.secrets.folder),
                                                               run_as=self._free_uid(stored.run_as))
            restored.append(deployment.service)
        if restored:
            self.changed()
        return restored

    async def update_limits(self, name: str, cpus: float | None = None, memory_bytes: int | None = None) -> None:
        """Change a function's CPU / memory limits (the CPU compensator's actuator): CPUs alone in place, memory by
        a rolling update."""
        fn = self.get(name)
        old = fn.deployment.limits or Resources()
        limits = Resources(
            memory=str(memory_bytes) if memory_bytes else old.memory,
            cpu=f"{cpus:g}" if cpus else old.cpu,
            memory_bytes=memory_bytes or old.memory_bytes,
            cpus=cpus or old.cpus,
        )
        await self.update(replace(fn.deployment, limits=limits))

    def pipelines(self) -> dict[str, list[str]]:
        """model → its stage functions in stage order (:func:`quart_stage.labels.pipelines`: a model whose
        stages are not numbered 0…n−1, or a function with malformed labels, is no pipeline).

        Computed once per change of the functions or their deployments (the key: each function's name and
        deployment, which deploy / update / remove / restore replace; held, so compared by identity first),
        not once per request; the answer is shared: callers must not change it."""
        key = tuple((name, fn.deployment) for name, fn in self.functions.items())
        if key != self._pipelines_key:
            self._pipelines = vocab.pipelines((fn.name, fn.deployment.labels) for fn in self.functions.values())
            self._pipelines_key = key
        return self._pipelines

    def _check_capacity(self, deployment: FunctionDeployment, kind: str) -> None:
        """A function that can never run here is refused (:func:`quart_kernel.capacity.deploy_refusal`)."""
        refusal = deploy_refusal(kind, deployment.min_replicas, self.hosts)
        if refusal is not None:
            raise invalid(*refusal)

    def _check_limits(self, deployment: FunctionDeployment) -> None:
        """Reserved names and the label caps (:mod:`.deploy_limits`)."""
        check_name(deployment.service, self.pipelines(), self.reserved)
        check_model(deployment.labels.get(vocab.MODEL), self.functions, self.reserved)
        check_labels(deployment.labels, self.caps)
        check_labels(deployment.annotations, self.caps, "annotations")

    def _check_secrets(self, deployment: FunctionDeployment) -> None:
        """A deploy naming a secret that does not exist is refused (OpenFaaS: the pod could not start)."""
        missing = self.secrets.missing(deployment.secrets)
        if missing:
            raise invalid("secrets", f"secret(s) {', '.join(map(repr, missing))} do not exist in namespace "
                                     f"{self.secrets.namespace!r}; create them first (faas-cli secret create)")

    async def _invalidate(self, name: str) -> None:
        """Hosts drop what they cached of the function's previous spec (zygotes)."""
        # bounded: a host that is down cannot answer (its KeysManager re-checks fingerprints when it is back)
        await asyncio.gather(*(within(INVALIDATE_TIMEOUT_S, h.invalidate(name)) for h in self.hosts.values()),
                             return_exceptions=True)
