"""Stage pods addressed directly on Kubernetes (``QUART_PLATFORM=kubernetes``, the standalone plugin).

OpenFaaS hides a function's pods behind ``/function/<name>``; here the plugin reads them from the Kubernetes API
instead: the EndpointSlices of the function's Service (label ``kubernetes.io/service-name=<function>``, in the
function's namespace), **watched** — one list, then a watch from its ``resourceVersion``; a watch that ends is
resumed from the last version seen, one whose version expired (410 Gone) re-lists. Every endpoint a slice lists
becomes a :class:`Pod` replica at ``http://<address>:<port>/`` (the slice's port: the watchdog's 8080 on
OpenFaaS), so the router and the session engine call pods directly: per-session affinity, per-replica slots
and the KV book hold with many pods per stage.

A pod's ``state`` follows its endpoint's conditions: ``ready`` (``conditions.ready``, unset meaning ready) takes
new calls; ``unready`` takes none but keeps its sessions; ``draining`` (terminating, or gone from every slice)
takes none and its sessions move to another pod by replay (:mod:`gateway_plugin.generation.sessions`); ``dead``
(its connection refused, :meth:`PodDirectory.mark_unreachable`) takes none until its slices next change.

Authentication is the pod's service account: the bearer token (re-read at every request: the kubelet rotates
it) and the cluster CA from ``QUART_KUBERNETES_CREDENTIALS_DIR``; RBAC: get/list/watch on
``discovery.k8s.io`` endpointslices in the functions' namespace (deploy/kubernetes, docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from gateway_plugin.config import PluginConfig
from gateway_plugin.ports import Replica
from gateway_plugin.replicas import StaticReplica

log = logging.getLogger("quart.kubernetes")

SERVICE_NAME = "kubernetes.io/service-name"  # the label an EndpointSlice names its Service by
WATCHDOG_PORT = 8080  # OpenFaaS's watchdog, when a slice lists no port
PAGE = 500  # slices per list page
WATCH_S = 300  # the API server ends a watch after this long (it is resumed at once)
BACKOFF_S = (0.2, 30.0)  # first and longest pause after a failed list or watch
SYNC_WAIT_S = 5.0  # how long ``follow`` waits for a new namespace's first list


@dataclass(slots=True)
class Pod(StaticReplica):
    """One pod of a stage function, called directly; ``state``: ready | unready | draining | dead."""

    state: str = "ready"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One address of one pod, as a slice lists it."""

    id: str
    url: str
    ready: bool
    terminating: bool


class ApiError(Exception):
    """The Kubernetes API answered an error (``status``: its HTTP status or the Status object's code)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def slice_endpoints(obj: Mapping[str, Any]) -> tuple[str | None, list[Endpoint]]:
    """(the Service it belongs to, its endpoints) of one EndpointSlice object (pure)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    ports = [p for p in obj.get("ports") or () if (p.get("protocol") or "TCP") == "TCP" and p.get("port")]
    named = [p for p in ports if p.get("name") == "http"]
    port = int((named or ports)[0]["port"]) if ports else WATCHDOG_PORT
    ipv6 = obj.get("addressType") == "IPv6"
    out = []
    for ep in obj.get("endpoints") or ():
        addresses = ep.get("addresses") or ()
        if not addresses:
            continue
        address = addresses[0]
        host = f"[{address}]" if ipv6 else address
        pod = (ep.get("targetRef") or {}).get("name")
        conditions = ep.get("conditions") or {}
        out.append(Endpoint(id=f"{pod}@{host}:{port}" if pod else f"{host}:{port}", url=f"http://{host}:{port}/",
                            ready=conditions.get("ready") is not False,  # unset: ready (the API's convention)
                            terminating=conditions.get("terminating") is True))
    return labels.get(SERVICE_NAME), out


class KubernetesAPI:
    """The few EndpointSlice calls the plugin makes, over aiohttp, with the service account's token and CA."""

    def __init__(self, url: str, credentials_dir: str) -> None:
        self.url = url.rstrip("/")
        self.credentials_dir = credentials_dir
        self._ssl: ssl.SSLContext | None = None

    def _path(self, namespace: str) -> str:
        return f"{self.url}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token_file = os.path.join(self.credentials_dir, "token")
        if os.path.isfile(token_file):
            with open(token_file, encoding="utf-8") as fh:
                headers["Authorization"] = f"Bearer {fh.read().strip()}"
        return headers

    def ssl_context(self) -> ssl.SSLContext | bool:
        """TLS verified with the cluster CA (``ca.crt`` beside the token) for an https API (aiohttp's default for
        http)."""
        if not self.url.startswith("https:"):
            return True
        if self._ssl is None:
            ca = os.path.join(self.credentials_dir, "ca.crt")
            self._ssl = ssl.create_default_context(cafile=ca if os.path.isfile(ca) else None)
        return self._ssl

    async def _failed(self, resp: aiohttp.ClientResponse) -> ApiError:
        text = (await resp.text())[:300]
        with contextlib.suppress(ValueError, AttributeError):
            text = str(json.loads(text).get("message") or text)
        return ApiError(resp.status, text)

    async def list_slices(self, http: aiohttp.ClientSession, namespace: str) -> tuple[list[dict[str, Any]], str]:
        """Every EndpointSlice of a Service in ``namespace`` (page by page) and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        params = {"labelSelector": SERVICE_NAME, "limit": str(PAGE)}
        while True:
            async with http.get(self._path(namespace), params=params, headers=self._headers(),
                                ssl=self.ssl_context(), timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status != 200:
                    raise await self._failed(resp)
                doc = await resp.json(content_type=None)
            items += doc.get("items") or []
            meta = doc.get("metadata") or {}
            if not meta.get("continue"):
                return items, str(meta.get("resourceVersion") or "")
            params = {**params, "continue": meta["continue"]}

    async def watch_slices(self, http: aiohttp.ClientSession, namespace: str,
                    version: str) -> AsyncIterator[dict[str, Any]]:
        """The watch events after ``version`` (one JSON object a line) until the server ends the watch."""
        params = {"labelSelector": SERVICE_NAME, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_S)}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_S + 30)
        async with http.get(self._path(namespace), params=params, headers=self._headers(), ssl=self.ssl_context(),
                            timeout=timeout) as resp:
            if resp.status != 200:
                raise await self._failed(resp)
            buffer = b""
            async for chunk in resp.content.iter_any():  # a slice may be longer than a stream reader's line limit
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)


class PodDirectory:
    """The pods of each followed stage function, kept current by one list + watch per namespace."""

    def __init__(self, api: KubernetesAPI) -> None:
        self.api = api
        self.namespace_of: dict[str, str] = {}  # function -> its namespace (what ``follow`` was told)
        self.slices: dict[str, dict[str, dict[str, Any]]] = {}  # namespace -> slice name -> slice object
        self.pods: dict[str, dict[str, Pod]] = {}  # function -> pod id -> pod (those its slices list)
        self.synced: dict[str, asyncio.Event] = {}  # namespace -> set once its first list is in
        self.relists = 0  # lists after the first (an expired version, 410)
        self._tasks: dict[str, asyncio.Task] = {}
        self._http: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ what the view asks

    def ready(self, function: str) -> list[Pod]:
        return [p for p in self.pods.get(function, {}).values() if p.state == "ready"]

    def mark_unreachable(self, function: str, replica: Replica) -> None:
        """A call found no one at the pod's address: no new calls until its slices next change."""
        pod = self.pods.get(function, {}).get(replica.id)
        if pod is replica and pod.state == "ready":
            pod.state = "dead"

    async def follow(self, functions: Mapping[str, str]) -> None:
        """Keep the pods of these functions (name -> namespace); a new namespace's watch starts (its first list
        is waited for, bounded)."""
        changed = [f for f, namespace in functions.items() if self.namespace_of.get(f) != namespace]
        self.namespace_of = dict(functions)
        for function in set(self.pods) - set(functions):
            for pod in self.pods.pop(function).values():
                pod.state = "draining"
        for function in changed:  # the others' pods change with their slices only (a dead pod stays out till then)
            self._rebuild(function)
        new = set(functions.values()) - set(self._tasks)
        for namespace in new:
            self.synced[namespace] = asyncio.Event()
            self._tasks[namespace] = asyncio.get_running_loop().create_task(self._watch_forever(namespace))
        if new:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*(self.synced[n].wait() for n in new)), SYNC_WAIT_S)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ------------------------------------------------------------------ keeping them current

    def _rebuild(self, function: str) -> None:
        """The function's pods from its namespace's slices: listed ones get their endpoint's state, others leave."""
        namespace = self.namespace_of.get(function)
        listed: dict[str, Endpoint] = {}
        for obj in self.slices.get(namespace or "", {}).values():
            service, endpoints = slice_endpoints(obj)
            if service != function:
                continue
            for ep in endpoints:  # a pod in two slices (moving between them): ready if either says so
                if ep.id not in listed or (ep.ready and not ep.terminating):
                    listed[ep.id] = ep
        pods = self.pods.setdefault(function, {})
        for pid in set(pods) - set(listed):
            pods.pop(pid).state = "draining"  # its sessions move off by replay (still held by them)
        for pid, ep in listed.items():
            pod = pods.get(pid)
            if pod is None:
                pod = pods[pid] = Pod(pid, ep.url)
            pod.state = "draining" if ep.terminating else "ready" if ep.ready else "unready"

    def _apply(self, namespace: str, kind: str, obj: dict[str, Any]) -> None:
        name = (obj.get("metadata") or {}).get("name", "")
        slices = self.slices.setdefault(namespace, {})
        old = slices.get(name)
        if kind == "DELETED":
            slices.pop(name, None)
        else:
            slices[name] = obj
        touched = {slice_endpoints(o)[0] for o in (old, obj) if o is not None}
        for function in touched:
            if function is not None and self.namespace_of.get(function) == namespace:
                self._rebuild(function)

    def _relisted(self, namespace: str, items: list[dict[str, Any]]) -> None:
        self.slices[namespace] = {(o.get("metadata") or {}).get("name", ""): o for o in items}
        for function, ns in self.namespace_of.items():
            if ns == namespace:
                self._rebuild(function)
        self.synced[namespace].set()

    async def _watch_forever(self, namespace: str) -> None:
        """List, then watch from the list's version; resumed where it ended, re-listed after 410 Gone."""
        if self._http is None:
            self._http = aiohttp.ClientSession()
        version = ""
        pause = BACKOFF_S[0]
        while True:
            try:
                if not version:
                    items, version = await self.api.list_slices(self._http, namespace)
                    if self.synced[namespace].is_set():
                        self.relists += 1
                    self._relisted(namespace, items)
                events = 0
                async for event in self.api.watch_slices(self._http, namespace, version):
                    events += 1
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        raise ApiError(int(obj.get("code") or 500), str(obj.get("message") or obj))
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._apply(namespace, kind, obj)
                if events:
                    pause = BACKOFF_S[0]
                else:  # a watch that ends with nothing (a proxy cutting it short): not in a tight loop
                    await asyncio.sleep(pause)
                    pause = min(BACKOFF_S[1], pause * 2)
            except ApiError as exc:
                if exc.status == 410:  # the version expired: list again, at once
                    log.info("EndpointSlices in %s: %s; listing again", namespace, exc)
                    version = ""
                    continue
                log.warning("EndpointSlices in %s: %s%s", namespace, exc, " (the plugin's service account needs "
                            "get/list/watch on endpointslices there: docs/kubernetes.md)" if exc.status == 403 else "")
                await asyncio.sleep(pause)
                pause = min(BACKOFF_S[1], pause * 2)
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                log.warning("EndpointSlices in %s: %s: %s", namespace, type(exc).__name__, exc)
                await asyncio.sleep(pause)
                pause = min(BACKOFF_S[1], pause * 2)


PLATFORMS = ("openfaas", "kubernetes")


def pod_directory(config: PluginConfig) -> PodDirectory | None:
    """The pod directory ``QUART_PLATFORM=kubernetes`` asks for (None: function-level dispatch through the gateway)."""
    if config.platform not in PLATFORMS:
        raise ValueError(f"QUART_PLATFORM must be one of {', '.join(PLATFORMS)}, got {config.platform!r}")
    if config.platform != "kubernetes":
        return None
    return PodDirectory(KubernetesAPI(config.kubernetes_api_url, config.kubernetes_credentials_dir))
