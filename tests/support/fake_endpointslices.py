"""A fake of the Kubernetes EndpointSlice API (``discovery.k8s.io/v1``) on loopback, as the plugin's pod directory
(gateway_plugin.kubernetes_pods) uses it: list (paged with ``limit``/``continue``) and watch (newline-delimited JSON
events after a ``resourceVersion``, BOOKMARKs, ``timeoutSeconds``), a bearer token checked on every call, and a
history that can be compacted so that an old version is answered with a 410 Gone ERROR event, as the API server
does. Tests edit slices with :meth:`FakeEndpointSlices.put` / :meth:`delete` (from the server's event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from pathlib import Path
from typing import Any

from aiohttp import web

PREFIX = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def endpoint_slice(name: str, service: str, pods: list[tuple[str, str, bool]], port: int = 8080,
                   terminating: frozenset[str] = frozenset()) -> dict[str, Any]:
    """An EndpointSlice of ``service``: (pod name, address, ready) per endpoint, all on ``port``."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service,
                                              "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "targetRef": {"kind": "Pod", "name": pod},
                       "conditions": {"ready": ready, "serving": ready or pod in terminating,
                                      "terminating": pod in terminating}}
                      for pod, address, ready in pods],
    }


def _selected(obj: dict[str, Any], selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, eq, value = term.partition("=")
        if key not in labels or (eq and labels[key] != value):
            return False
    return True


class FakeEndpointSlices:
    """The fake API server's state and routes; ``url`` once :meth:`start` ran."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.version = 100
        self.slices: dict[str, dict[str, dict[str, Any]]] = {}  # namespace -> name -> object
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # (version, namespace, type, object)
        self.oldest = 0  # watches from a version before this are answered 410 Gone
        self.cut = 0  # bumped to end every open watch
        self.changed = asyncio.Condition()
        self.lists = 0
        self.watches = 0
        self.refused = 0  # calls without the token
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, tls: ssl.SSLContext | None = None) -> FakeEndpointSlices:
        app = web.Application()
        app.router.add_get(PREFIX, self._endpointslices)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=tls).start()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        self.cut += 1  # open watches end (a handler still running holds the runner's cleanup)
        async with self.changed:
            self.changed.notify_all()
        if self.runner is not None:
            await self.runner.cleanup()

    async def _event(self, namespace: str, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"]["namespace"] = namespace
        if kind == "DELETED":
            self.slices.get(namespace, {}).pop(obj["metadata"]["name"], None)
        else:
            self.slices.setdefault(namespace, {})[obj["metadata"]["name"]] = obj
        self.history.append((self.version, namespace, kind, obj))
        async with self.changed:
            self.changed.notify_all()

    async def put(self, namespace: str, obj: dict[str, Any]) -> None:
        kind = "MODIFIED" if obj["metadata"]["name"] in self.slices.get(namespace, {}) else "ADDED"
        await self._event(namespace, kind, obj)

    async def delete(self, namespace: str, name: str) -> None:
        await self._event(namespace, "DELETED", self.slices[namespace][name])

    async def change_unseen(self, namespace: str, obj: dict[str, Any] | None = None, delete: str = "") -> None:
        """Open watches end before they see this change (put ``obj`` or delete slice ``delete``), and the history is
        compacted to it: a watch resumed from an older version is answered 410 Gone, so the change is seen only by
        listing again."""
        self.cut += 1
        self.oldest = self.version + 1
        if obj is not None:
            await self.put(namespace, obj)
        else:
            await self.delete(namespace, delete)

    async def _endpointslices(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            self.refused += 1
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        namespace, query = request.match_info["namespace"], request.query
        selector = query.get("labelSelector", "")
        if query.get("watch") in ("1", "true"):
            return await self._watch(request, namespace, selector, int(query.get("resourceVersion") or 0),
                                     float(query.get("timeoutSeconds") or 60), query.get("allowWatchBookmarks") == "true")
        self.lists += 1
        items = sorted((o for o in self.slices.get(namespace, {}).values() if _selected(o, selector)),
                       key=lambda o: o["metadata"]["name"])
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0) or len(items) or 1
        page = items[start:start + limit]
        meta: dict[str, Any] = {"resourceVersion": str(self.version)}
        if start + limit < len(items):
            meta["continue"] = str(start + limit)
        return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1", "metadata": meta,
                                  "items": page})

    async def _watch(self, request: web.Request, namespace: str, selector: str, since: int, timeout_s: float,
                     bookmarks: bool) -> web.StreamResponse:
        self.watches += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)

        async def send(kind: str, obj: dict[str, Any]) -> None:
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        cut = self.cut
        while loop.time() < deadline and cut == self.cut:
            if since < self.oldest:
                await send("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
                                     "code": 410, "message": f"too old resource version: {since} ({self.oldest})"})
                break
            for version, ns, kind, obj in self.history:
                if version > since and ns == namespace and _selected(obj, selector):
                    await send(kind, obj)
            if self.version > since and bookmarks:
                await send("BOOKMARK", {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                        "metadata": {"resourceVersion": str(self.version)}})
            since = max(since, self.version)
            async with self.changed:
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    break
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp


def self_signed_server(folder: Path) -> tuple[Path, ssl.SSLContext]:
    """A throwaway CA certificate for 127.0.0.1 (``folder/ca.crt``, also the server's) and the server's TLS context."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-kubernetes")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    ca, key_file = folder / "ca.crt", folder / "server.key"
    ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(ca, key_file)
    return ca, context
