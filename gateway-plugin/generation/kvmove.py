"""Moving a generation session's KV cache from a ParaServe part onto a whole replica (ParaServe §6.2), and freeing
it (``DELETE /_/sessions/<id>``), gateway side.

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
    base = f"{part.url.rstrip('/')}/_/sessions/{session_id}/kv"
    query = {} if part.span is None else {"layers": layers.format_range(part.span)}
    async with http.get(base, params=query, timeout=timeout) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise StepError(f"export from {part.url} answered {resp.status}: {data[:200]!r}")
    if install is None:
        await install_kv(http, session_id, fed, reserve, whole, data, timeout)
    else:
        await install(session_id, fed, reserve, whole, data)
    return len(data)


async def install_kv(http: aiohttp.ClientSession, session_id: str, fed: int, reserve: int, whole: Hop, data: bytes,
                     timeout: aiohttp.ClientTimeout) -> None:
    """``PUT /_/sessions/<id>/kv`` of one exported part on ``whole``; `StepError` unless it answers 204."""
    headers = {"Content-Type": "application/octet-stream", SESSION_POS: str(fed), SESSION_RESERVE: str(reserve)}
    async with http.put(f"{whole.url.rstrip('/')}/_/sessions/{session_id}/kv", data=data, headers=headers,
                        timeout=timeout) as resp:
        answer = await resp.read()
        if resp.status != 204:
            raise StepError(f"install on {whole.url} answered {resp.status}: {answer[:200]!r}")


async def delete_session(client: aiohttp.ClientSession, url: str, session_id: str) -> None:
    """``DELETE /_/sessions/<id>`` on the replica at ``url``; a failure is ignored (the replica's idle sweep frees it)."""
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
        url = f"{url.rstrip('/')}/_/sessions/{session_id}"
        async with client.delete(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await resp.read()
