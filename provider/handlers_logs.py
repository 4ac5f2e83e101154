"""``GET /system/logs``: replicas' output in the shape faas-cli reads (faas-provider's ``logs`` package).

Query (faas-provider ``logs.Request``, the last value of a repeated key wins): ``name`` (required),
``namespace``, ``instance`` (one replica), ``tail`` (the last N messages; <= 0 all), ``follow``
(Go's ``ParseBool``; anything else is false), ``since`` (RFC3339). Answer: 200
``application/x-ndjson``, one ``{"name","namespace","instance","timestamp","text"}`` per line; a
query that does not parse is a 422 (as faas-provider), an unknown function or namespace a 404.

Sources are the log files the hosts write (:meth:`~quart_provider.hosts.Host.log_files`). They carry no
per-line time: a line already written is stamped with its file's last write, a line read while
following with the time it was read, and ``since`` skips files last written before it. ``follow``
streams until the client disconnects (or ``upstream_timeout_s``), picking up replicas started meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from aiohttp import web
from multidict import MultiMapping
from quart_provider.gateway import EmbeddedGateway
from quart_stage.errors import QuartError, invalid
from quart_transport import namespaces

POLL_S = 0.1
_TRUE = {"1", "t", "T", "TRUE", "true", "True"}


@dataclass(frozen=True, slots=True)
class LogQuery:
    name: str
    namespace: str | None = None
    instance: str = ""
    tail: int = 0
    follow: bool = False
    since: datetime | None = None

    @classmethod
    def parse(cls, query: MultiMapping[str]) -> LogQuery:
        def last(key: str) -> str:
            values = query.getall(key, [])
            return values[-1] if values else ""

        name = last("name")
        if not name:
            raise invalid("name", "name (the function) is required")
        try:
            tail = int(last("tail") or 0)
        except ValueError:
            raise QuartError(422, f"could not parse the log request: tail {last('tail')!r} is not an integer",
                             "tail") from None
        since = None
        if last("since"):
            try:
                since = datetime.fromisoformat(last("since").replace("Z", "+00:00"))
            except ValueError:
                raise QuartError(422, f"could not parse the log request: since {last('since')!r} is not RFC3339",
                                 "since") from None
            if since.tzinfo is None:
                raise QuartError(422, "could not parse the log request: since needs a time zone (RFC3339)", "since")
        return cls(name, last("namespace") or None, last("instance"), tail, last("follow") in _TRUE, since)


@dataclass(slots=True)
class _Tail:
    """What of one log file was read: lines are handed out whole."""

    instance: str
    path: Path
    offset: int = 0
    rest: bytes = field(default=b"")

    def read_new(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]


def _stamp(ts: datetime) -> str:
    return ts.isoformat().replace("+00:00", "Z")


class LogHandlers:
    def __init__(self, gateway: EmbeddedGateway) -> None:
        self.gateway = gateway
        self.config = gateway.config

    async def logs(self, request: web.Request) -> web.StreamResponse:
        query = LogQuery.parse(request.query)
        namespaces.check(query.namespace, self.config.namespace)
        fn = self.gateway.registry.get(query.name)  # 404 naming it
        tails: dict[Path, _Tail] = {}
        backlog: list[tuple[datetime, str, str]] = []
        for tail in await self._new_tails(fn.name, query.instance, tails):
            try:
                written = datetime.fromtimestamp(tail.path.stat().st_mtime, UTC)
            except OSError:
                continue
            lines = tail.read_new()
            if query.since is None or written >= query.since:
                backlog += [(written, tail.instance, line) for line in lines]
        backlog.sort(key=lambda item: item[0])
        if query.tail > 0:
            backlog = backlog[-query.tail:]
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)

        async def send(items: list[tuple[datetime, str, str]]) -> None:
            if items:
                await response.write("".join(json.dumps(
                    {"name": fn.name, "namespace": self.config.namespace, "instance": instance,
                     "timestamp": _stamp(ts), "text": text}) + "\n" for ts, instance, text in items).encode())

        try:
            await send(backlog)
            deadline = asyncio.get_running_loop().time() + self.config.upstream_timeout_s
            while query.follow and asyncio.get_running_loop().time() < deadline:
                if request.transport is None or request.transport.is_closing():
                    return response  # the client went away
                await asyncio.sleep(POLL_S)
                await self._new_tails(fn.name, query.instance, tails)
                now = datetime.now(UTC)
                await send([(now, t.instance, line) for t in tails.values() for line in t.read_new()])
            await response.write_eof()
        except (ConnectionResetError, ConnectionError):
            pass  # the client went away mid-write
        return response

    async def _new_tails(self, name: str, instance: str, tails: dict[Path, _Tail]) -> list[_Tail]:
        """Start following the log files of ``name``'s replicas not followed yet; returns them."""
        new = []
        for replica, path in await self.gateway.log_files(name):
            if path not in tails and (not instance or instance == replica):
                tails[path] = _Tail(replica, path)
                new.append(tails[path])
        return new
