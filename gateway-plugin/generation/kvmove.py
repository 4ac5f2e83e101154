"""Moving a generation session's KV cache from a ParaServe part onto a whole replica (ParaServe §6.2) or a live
replica's wider part (a re-cut), trimming what moved off a part (``DELETE /_/sessions/<id>/kv?layers=``), and
freeing a session (``DELETE /_/sessions/<id>``), gateway side.

The stage side is `quart_stage.kvmigrate` (``GET``/``PUT /_/sessions/<id>/kv``: safetensors with each tensor's
sha256 and length, verified before anything changes). The bytes go part → gateway → whole replica. The session
engine's consolidation (`gateway_plugin.generation.groupsessions`) and a split session's rejoin of a live replica
that became whole (`gateway_plugin.generation.cooperative`) call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from gateway_plugin import layers

SESSION_POS, SESSION_RESERVE = "X-Quart-Session-Pos", "X-Quart-Session-Reserve"
SESSION_FROM, KV_STAGED = "X-Quart-Session-From", "X-Quart-KV-Staged"  # a re-cut's two copies (quart_stage.kvroutes)


@dataclass(frozen=True)
class Hop:
    """One replica and the layers it runs (None: its whole stage)."""

    url: str
    span: tuple[int, int] | None = None


class StepError(Exception):
    """A replica refused an export or an install."""


Install = Callable[[str, int, int, Hop, bytes], Awaitable[None]]


async def move_kv(http: aiohttp.ClientSession, session_id: str, fed: int, reserve: int, part: Hop, whole: Hop,
                  timeout: aiohttp.ClientTimeout, install: Install | None = None) -> int:
    """Move one part's KV cache of a session (``fed`` positions held, ``reserve`` booked) onto ``whole``: export
    (``GET /_/sessions/<id>/kv``, the part's layers), install there (verified before anything changes); the bytes
    moved. `StepError` when either side refuses."""
    if install is None:
        return (await copy_kv(http, session_id, reserve, part, whole, timeout)).size
    async with http.get(_kv_url(part.url, session_id), params=_query(part, 0), timeout=timeout) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise StepError(f"export from {part.url} answered {resp.status}: {data[:200]!r}")
    await install(session_id, fed, reserve, whole, data)
    return len(data)


@dataclass(frozen=True)
class Copied:
    """What one copy moved: its bytes and the positions the export held."""

    size: int
    tokens: int


async def copy_kv(http: aiohttp.ClientSession, session_id: str, reserve: int, part: Hop, onto: Hop,
                  timeout: aiohttp.ClientTimeout, start: int = 0, staged: bool = False) -> Copied:
    """Copy the cache of ``part``'s layers, positions ``start`` on, into the session on ``onto`` (``onto.span``: the
    part it runs afterwards; ``staged``: a re-cut's pre-copy, which waits beside the part). The bytes are relayed
    as they arrive, so the upload overlaps the download. `StepError` when either side refuses."""
    async with http.get(_kv_url(part.url, session_id), params=_query(part, start), timeout=timeout) as resp:
        size = resp.content_length
        if resp.status != 200 or size is None:
            data = await resp.read()
            if resp.status != 200:
                raise StepError(f"export from {part.url} answered {resp.status}: {data[:200]!r}")
            size = len(data)
        else:
            data = resp.content
        try:
            tokens = int(resp.headers.get(SESSION_POS, ""))
        except ValueError:
            raise StepError(f"export from {part.url} named no {SESSION_POS}") from None
        await install_kv(http, session_id, tokens, reserve, onto, data, timeout, size, start, staged)
    return Copied(size, tokens)


def _kv_url(url: str, session_id: str) -> str:
    return f"{url.rstrip('/')}/_/sessions/{session_id}/kv"


def _query(part: Hop, start: int) -> dict[str, str]:
    query = {} if part.span is None else {"layers": layers.format_range(part.span)}
    return query | ({"from": str(start)} if start else {})


async def install_kv(http: aiohttp.ClientSession, session_id: str, fed: int, reserve: int, whole: Hop,
                     data: bytes | aiohttp.StreamReader, timeout: aiohttp.ClientTimeout, size: int | None = None,
                     start: int = 0, staged: bool = False) -> None:
    """``PUT /_/sessions/<id>/kv`` of one exported part (positions ``start`` to ``fed``) on ``whole`` (``data``: its
    bytes, or the export's stream of ``size`` bytes); `StepError` unless it answers 204."""
    headers = {"Content-Type": "application/octet-stream", SESSION_POS: str(fed), SESSION_RESERVE: str(reserve)}
    if size is not None:
        headers["Content-Length"] = str(size)
    if whole.span is not None:  # the layers the session runs there afterwards (a re-cut's wider part)
        headers[layers.LAYERS] = layers.format_range(whole.span)
    if start:
        headers[SESSION_FROM] = str(start)
    if staged:
        headers[KV_STAGED] = "1"
    async with http.put(_kv_url(whole.url, session_id), data=data, headers=headers, timeout=timeout) as resp:
        answer = await resp.read()
        if resp.status != 204:
            raise StepError(f"install on {whole.url} answered {resp.status}: {answer[:200]!r}")


async def trim_kv(http: aiohttp.ClientSession, url: str, session_id: str, drop: tuple[int, int],
                  timeout: aiohttp.ClientTimeout) -> None:
    """``DELETE /_/sessions/<id>/kv?layers=A-B``: the replica at ``url`` stops running the first layers ``drop`` of
    the session and frees their cache (a re-cut moved it); `StepError` unless it answers 204."""
    url = _kv_url(url, session_id)
    async with http.delete(url, params={"layers": layers.format_range(drop)}, timeout=timeout) as resp:
        answer = await resp.read()
        if resp.status != 204:
            raise StepError(f"trim on {url} answered {resp.status}: {answer[:200]!r}")


async def delete_session(client: aiohttp.ClientSession, url: str, session_id: str) -> None:
    """``DELETE /_/sessions/<id>`` on the replica at ``url``; a failure is ignored (the replica's idle sweep frees it)."""
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
        url = f"{url.rstrip('/')}/_/sessions/{session_id}"
        async with client.delete(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await resp.read()
