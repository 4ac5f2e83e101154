"""Clients of the KeysManager API (JSON over HTTP): sync for tools/tests, async for aiohttp.

The address is the daemon's Unix socket path, or ``http://HOST:PORT`` for its TCP listener, which needs
the cluster's bearer token (``token=``; see ``keysmanager.auth``).

    km = KeysManagerClient("/run/.../km.sock")       # or KeysManagerClient("http://10.200.3.2:7077", token=...)
    km.ensure_cached(spec)
    [replica] = km.start(spec, 1)
    requests.post(replica.url, data=...)
    km.stop(replica.id)
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit

from quart_stage.unixhttp import UnixHTTPConnection

from keysmanager.auth import bearer_header
from keysmanager.types import HostReport, ReplicaInfo, StageSpec, StartOrder, StartReport, ZygoteInfo


class KeysManagerError(RuntimeError):
    """The daemon answered with an error (4xx/5xx) or could not be reached."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"KeysManager error {status}: {message}" + (f" (field {field})" if field else ""))
        self.status = status
        self.message = message
        self.field = field


def _spec_body(spec: StageSpec, peers: Sequence[str] = ()) -> dict[str, Any]:
    """``{"spec"}``, with ``peers`` (KeysManagers holding the stage, tried before the registry) when given."""
    return {"spec": spec.to_dict(), **({"peers": list(peers)} if peers else {})}


def _plan_body(spec: StageSpec, order: StartOrder) -> dict[str, Any]:
    """``POST /v1/starts``: the spec and the plan, whole."""
    return {"spec": spec.to_dict(), "plan": order.to_dict()}


def _start_body(spec: StageSpec, count: int, mode: str | None, survive: bool, wait: bool, cache: bool | None,
                source: str = "auto", peers: Sequence[str] = (), live: bool = False, listen: str = "tcp",
                layers: Sequence[int] | None = None):
    body: dict[str, Any] = {**_spec_body(spec, peers), "count": count, "survive": survive, "wait": wait}
    if live:
        body["live"] = True
    if listen != "tcp":
        body["listen"] = listen
    if layers is not None:
        body["layers"] = list(layers)
    if source != "auto":
        body["source"] = source
    if mode is not None:
        body["mode"] = mode
    if cache is not None:
        body["cache"] = cache
    return body


def _tcp_address(address: str) -> tuple[str, int] | None:
    """(host, port) of an ``http://HOST:PORT`` address; None for a Unix socket path."""
    if not address.startswith("http://"):
        return None
    parts = urlsplit(address)
    if not parts.hostname or not parts.port:
        raise ValueError(f"KeysManager address {address!r} must be http://HOST:PORT or a Unix socket path")
    return parts.hostname, parts.port


def _headers(address: str, token: str | None) -> dict[str, str]:
    """The bearer header for a TCP address; a TCP address without a token is refused here already."""
    if _tcp_address(address) is None:
        return {}
    if not token:
        raise ValueError(f"the KeysManager at {address} is on TCP: it needs the cluster's token (token=...)")
    return bearer_header(token)


class KeysManagerClient:
    """Synchronous client; one short-lived connection per call (safe to share between threads)."""

    def __init__(self, address: str, timeout: float = 600.0, token: str | None = None) -> None:
        self.address = str(address)
        self.timeout = timeout
        self._tcp = _tcp_address(self.address)
        self._auth = _headers(self.address, token)

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        conn = (http.client.HTTPConnection(*self._tcp, timeout=self.timeout) if self._tcp
                else UnixHTTPConnection(self.address, self.timeout))
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {**self._auth, **({"Content-Type": "application/json"} if payload is not None else {})}
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except OSError as exc:
            raise KeysManagerError(503, f"cannot reach the KeysManager at {self.address}: {exc}") from exc
        finally:
            conn.close()
        data = json.loads(raw) if raw else {}
        if resp.status >= 400:
            raise KeysManagerError(resp.status, data.get("error", raw.decode(errors="replace")), data.get("field"))
        return data

    def health(self) -> dict:
        return self._call("GET", "/v1/health")

    def ensure_cached(self, spec: StageSpec, peers: Sequence[str] = ()) -> dict:
        """Make sure a zygote holds the stage's parameters; returns its ZygoteInfo as a dict."""
        return self._call("POST", "/v1/cache", _spec_body(spec, peers))

    def prefetch(self, spec: StageSpec, peers: Sequence[str] = ()) -> dict:
        """Start making a registry stage local (from ``peers``, else the registry); returns at once."""
        return self._call("POST", "/v1/prefetch", _spec_body(spec, peers))

    def stage(self, function: str) -> dict:
        """What the host has of the stage's file: ``state`` held / fetching / absent, bytes, source, seconds."""
        return self._call("GET", f"/v1/stages/{function}")

    def attach(self, spec: StageSpec) -> dict:
        """Cache the stage; its segment (path and tensor index), checkpoint sha256 and manifest, as a stage pod
        gets them (``quart_stage.attach``)."""
        return self._call("POST", "/v1/attach", {"spec": spec.to_dict()})

    def start(
        self,
        spec: StageSpec,
        count: int = 1,
        mode: str | None = None,
        survive: bool = False,
        wait: bool = True,
        cache: bool | None = None,
        source: str = "auto",
        peers: Sequence[str] = (),
        live: bool = False,
        listen: str = "tcp",
        layers: Sequence[int] | None = None,
    ) -> list[ReplicaInfo]:
        """Start ``count`` replicas: fork when cached, cold otherwise (``source="cold"``: always cold).
        ``wait``: return once they are healthy. ``peers``: KeysManagers holding the stage (for a registry stage).
        ``live``: a registry stage still arriving serves its verified layers at once (``keysmanager.live``).
        ``listen="unix"``: each serves on a Unix socket beside the API socket (``ReplicaInfo.socket``).
        ``layers``: ``(a, b)``, a part of a registry stage to fetch and serve first, then the rest
        (``keysmanager.parts``, ParaServe)."""
        data = self._call("POST", "/v1/replicas",
                          _start_body(spec, count, mode, survive, wait, cache, source, peers, live, listen, layers))
        return [ReplicaInfo.from_dict(r) for r in data["replicas"]]

    def start_planned(self, spec: StageSpec, order: StartOrder) -> StartReport:
        """One planned start, carried out whole by the KeysManager (``keysmanager.starts``): one call."""
        return StartReport.from_dict(self._call("POST", "/v1/starts", _plan_body(spec, order)))

    def stop(self, replica_id: str, drain: bool = True) -> ReplicaInfo:
        data = self._call("POST", f"/v1/replicas/{replica_id}/stop", {"drain": drain})
        return ReplicaInfo.from_dict(data)

    def resize(self, replica_id: str, cpus: float) -> ReplicaInfo:
        return ReplicaInfo.from_dict(self._call("POST", f"/v1/replicas/{replica_id}/cpus", {"cpus": cpus}))

    def replicas(self, function: str | None = None, memory: bool = True) -> list[ReplicaInfo]:
        path = _replicas_path(function, memory)
        return [ReplicaInfo.from_dict(r) for r in self._call("GET", path)["replicas"]]

    def zygotes(self) -> list[ZygoteInfo]:
        return [ZygoteInfo.from_dict(z) for z in self._call("GET", "/v1/zygotes")["zygotes"]]

    def invalidate(self, function: str) -> dict:
        return self._call("POST", "/v1/invalidate", {"function": function})

    def report(self) -> HostReport:
        return HostReport.from_dict(self._call("GET", "/v1/report"))

    def pin(self, functions: list[str], sole: list[str] | None = None) -> list[str]:
        """Replace the stages whose zygotes the LRU evicts last and never for another zygote (key stages)."""
        return self._call("PUT", "/v1/pins", _pins_body(functions, sole))["pinned"]

    def pinned(self) -> list[str]:
        return self._call("GET", "/v1/pins")["pinned"]

    def shutdown(self) -> dict:
        """Stop every replica that may not survive, drop all zygotes, exit."""
        return self._call("POST", "/v1/shutdown", {})


class AsyncKeysManagerClient:
    """The same API for aiohttp callers (the embedded gateway). Close with ``await client.close()``."""

    def __init__(self, address: str, timeout: float = 600.0, token: str | None = None) -> None:
        self.address = str(address)
        self.timeout = timeout
        self._tcp = _tcp_address(self.address)
        self._auth = _headers(self.address, token)
        self._session = None

    async def _session_get(self):
        import aiohttp

        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector() if self._tcp else aiohttp.UnixConnector(path=self.address)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._auth,
                                                  timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self._session

    async def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        import aiohttp

        session = await self._session_get()
        try:
            base = self.address if self._tcp else "http://localhost"
            async with session.request(method, base + path, json=body) as resp:
                raw = await resp.read()
                status = resp.status
        except aiohttp.ClientError as exc:
            raise KeysManagerError(503, f"cannot reach the KeysManager at {self.address}: {exc}") from exc
        data = json.loads(raw) if raw else {}
        if status >= 400:
            raise KeysManagerError(status, data.get("error", raw.decode(errors="replace")), data.get("field"))
        return data

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def health(self) -> dict:
        return await self._call("GET", "/v1/health")

    async def ensure_cached(self, spec: StageSpec, peers: Sequence[str] = ()) -> dict:
        return await self._call("POST", "/v1/cache", _spec_body(spec, peers))

    async def prefetch(self, spec: StageSpec, peers: Sequence[str] = ()) -> dict:
        return await self._call("POST", "/v1/prefetch", _spec_body(spec, peers))

    async def stage(self, function: str) -> dict:
        return await self._call("GET", f"/v1/stages/{function}")

    async def start(self, spec: StageSpec, count: int = 1, mode: str | None = None, survive: bool = False,
                    wait: bool = True, cache: bool | None = None, source: str = "auto",
                    peers: Sequence[str] = (), live: bool = False, listen: str = "tcp",
                    layers: Sequence[int] | None = None) -> list[ReplicaInfo]:
        data = await self._call("POST", "/v1/replicas",
                                _start_body(spec, count, mode, survive, wait, cache, source, peers, live, listen,
                                            layers))
        return [ReplicaInfo.from_dict(r) for r in data["replicas"]]

    async def start_planned(self, spec: StageSpec, order: StartOrder) -> StartReport:
        """One planned start, carried out whole by the KeysManager (``keysmanager.starts``): one call."""
        return StartReport.from_dict(await self._call("POST", "/v1/starts", _plan_body(spec, order)))

    async def stop(self, replica_id: str, drain: bool = True) -> ReplicaInfo:
        return ReplicaInfo.from_dict(await self._call("POST", f"/v1/replicas/{replica_id}/stop", {"drain": drain}))

    async def resize(self, replica_id: str, cpus: float) -> ReplicaInfo:
        return ReplicaInfo.from_dict(await self._call("POST", f"/v1/replicas/{replica_id}/cpus", {"cpus": cpus}))

    async def replicas(self, function: str | None = None, memory: bool = True) -> list[ReplicaInfo]:
        path = _replicas_path(function, memory)
        return [ReplicaInfo.from_dict(r) for r in (await self._call("GET", path))["replicas"]]

    async def zygotes(self) -> list[ZygoteInfo]:
        return [ZygoteInfo.from_dict(z) for z in (await self._call("GET", "/v1/zygotes"))["zygotes"]]

    async def invalidate(self, function: str) -> dict:
        return await self._call("POST", "/v1/invalidate", {"function": function})

    async def report(self) -> HostReport:
        return HostReport.from_dict(await self._call("GET", "/v1/report"))

    async def pin(self, functions: list[str], sole: list[str] | None = None) -> list[str]:
        return (await self._call("PUT", "/v1/pins", _pins_body(functions, sole)))["pinned"]

    async def pinned(self) -> list[str]:
        return (await self._call("GET", "/v1/pins"))["pinned"]


def _replicas_path(function: str | None, memory: bool) -> str:
    """``GET /v1/replicas``; ``memory=False`` skips the per-replica RSS/PSS readings (cheap polling)."""
    query = urlencode({k: v for k, v in (("function", function), ("memory", None if memory else "0")) if v})
    return "/v1/replicas" + (f"?{query}" if query else "")


def _pins_body(functions: list[str], sole: list[str] | None) -> dict[str, list[str]]:
    body = {"functions": sorted(set(functions))}
    if sole is not None:
        body["sole"] = sorted(set(sole))
    return body
