"""Generation on a ParaServe group and its consolidation by KV-cache migration (ParaServe §6.2).

A cold stage served by a ParaServe group is a chain of P part replicas, each running a layer range of the stage
(``X-Quart-Layers``) and holding the KV cache of its own layers for every session (docs/generation.md). A
session's step passes through the parts in order, as a one-shot pass does; the part that holds the head answers
the token.

**Consolidation ("scale down").** When one worker of the group holds the whole stage, `GroupGenerator.consolidate`
moves every session to it: under each session's lock (its step in flight finishes first, no new one starts), each
other part's cache is exported (``GET /_/sessions/<id>/kv``, safetensors with each tensor's sha256 and length) and
installed on the whole worker (``PUT /_/sessions/<id>/kv``, which verifies every tensor before it changes
anything). Then the session's next step runs the whole stage there, from the positions it holds: no re-prefill.
A session whose migration fails (a part gone, a refused install) falls back to a replay on the whole worker
(prompt + generated at position 0, new session id) and is counted in ``reprefills``. Sessions migrate
a few at a time (each stream pauses only for its own move);
the bytes go part → gateway → whole worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from gateway_plugin import layers

SESSION, SESSION_POS, SESSION_RESERVE, SESSION_END = ("X-Quart-Session", "X-Quart-Session-Pos",
                                                      "X-Quart-Session-Reserve", "X-Quart-Session-End")
SAMPLE = "X-Quart-Sample"


@dataclass(frozen=True)
class Hop:
    """One replica of the chain and the layers it runs (None: its whole stage)."""

    url: str
    span: tuple[int, int] | None = None


@dataclass
class GroupSession:
    """One generation on a group: where its caches are, what it fed, what it generated, when."""

    prompt: list[int]
    max_tokens: int
    seed: int
    hops: list[Hop]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    generated: list[int] = field(default_factory=list)
    fed: int = 0
    reprefills: int = 0
    token_at: list[float] = field(default_factory=list)  # monotonic time of each token
    consolidated_at: float | None = None  # when its steps moved to the whole worker
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)


@dataclass
class Migration:
    """What one consolidation did."""

    sessions: int = 0
    migrated: int = 0
    reprefills: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


class StepError(Exception):
    """A part answered a step with something other than 200."""


class GroupGenerator:
    """Runs sessions over a chain of hops and consolidates them onto one whole worker."""

    def __init__(self, http: aiohttp.ClientSession, step_timeout_s: float = 60.0) -> None:
        self.http = http
        self.timeout = aiohttp.ClientTimeout(total=step_timeout_s)

    async def step(self, s: GroupSession) -> int:
        """One step of ``s`` (prefill at 0, else the last token) through its hops; the token."""
        sequence = s.prompt + s.generated
        new, pos = sequence[s.fed:], s.fed
        last = len(s.generated) + 1 == s.max_tokens
        body, ctype = json.dumps({"input_ids": [new]}).encode(), "application/json"
        for k, hop in enumerate(s.hops):
            headers = {"Content-Type": ctype, SESSION: s.id, SESSION_POS: str(pos),
                       SAMPLE: json.dumps({"seed": s.seed}), "Accept": "application/json"}
            if hop.span is not None:
                headers[layers.LAYERS] = layers.format_range(hop.span)
            if pos == 0:
                headers[SESSION_RESERVE] = str(len(s.prompt) + s.max_tokens)
            if last:
                headers[SESSION_END] = "1"
            status, data, ctype = await self._post(hop.url, body, headers)
            if status != 200:
                raise StepError(f"hop {k} ({hop.url}) answered {status}: {data[:200]!r}")
            body = data
        s.fed = len(sequence)
        return int(json.loads(body)["token"])

    async def _post(self, url: str, body: bytes, headers: dict[str, str], wait_s: float = 10.0
                    ) -> tuple[int, bytes, str]:
        """One hop; a 503 (a part that does not hold its layers yet: nothing changed there) is retried for
        up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            async with self.http.post(url, data=body, headers=headers, timeout=self.timeout) as resp:
                data = await resp.read()
                ctype = resp.headers.get("Content-Type", "application/octet-stream")
                if resp.status != 503 or time.monotonic() >= deadline:
                    return resp.status, data, ctype
            await asyncio.sleep(0.02)

    async def run(self, s: GroupSession) -> list[int]:
        """Every token of ``s``, one step at a time (each under the session's lock: a consolidation moves it
        between two steps)."""
        while len(s.generated) < s.max_tokens:
            async with s.lock:
                token = await self.step(s)
            s.generated.append(token)
            s.token_at.append(time.monotonic())
        return s.generated

    async def consolidate(self, sessions: Sequence[GroupSession], whole: Hop | Sequence[Hop],
                          parallel: int = 2) -> Migration:
        """Move every unfinished session of ``sessions`` onto ``whole`` (replicas that now hold the whole stage:
        one when the group scales down, several when it scales up — sessions are dealt round-robin): its KV
        cache from every other part, verified on arrival; a failure falls back to a replay. ``parallel``
        sessions move at once: each stream pauses only for its own move while the others go on in the group."""
        targets = [whole] if isinstance(whole, Hop) else list(whole)
        report = Migration()
        t0 = time.monotonic()
        open_ = [s for s in sessions if len(s.generated) < s.max_tokens]
        report.sessions = len(open_)
        gate = asyncio.Semaphore(max(1, parallel))

        async def one(i: int, s: GroupSession) -> None:
            async with gate:
                await self._move(s, targets[i % len(targets)], report)

        await asyncio.gather(*(one(i, s) for i, s in enumerate(open_)))
        report.seconds = time.monotonic() - t0
        return report

    async def _move(self, s: GroupSession, whole: Hop, report: Migration) -> None:
        async with s.lock:
            if len(s.generated) >= s.max_tokens:
                return
            if s.fed == 0:  # not prefilled yet: nothing to move
                s.hops = [whole]
                s.consolidated_at = time.monotonic()
                report.migrated += 1
                return
            try:
                sizes = await asyncio.gather(*(self._copy(s, hop, whole) for hop in s.hops if hop.url != whole.url))
                report.bytes += sum(sizes)
                report.migrated += 1
            except (StepError, aiohttp.ClientError, OSError, TimeoutError) as exc:
                report.failures.append(f"{s.id}: {exc}")
                report.reprefills += 1
                s.reprefills += 1
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    await self._delete(whole.url, s.id)
                s.id, s.fed = uuid.uuid4().hex, 0  # the next step replays prompt + generated on the whole worker
            s.hops = [whole]
            s.consolidated_at = time.monotonic()

    async def _copy(self, s: GroupSession, part: Hop, whole: Hop) -> int:
        """One part's cache of ``s`` → ``whole``; the bytes moved."""
        return await move_kv(self.http, s.id, s.fed, len(s.prompt) + s.max_tokens, part, whole, self.timeout,
                             self.install)

    async def install(self, session_id: str, fed: int, reserve: int, whole: Hop, data: bytes) -> None:
        await install_kv(self.http, session_id, fed, reserve, whole, data, self.timeout)

    async def _delete(self, url: str, session_id: str) -> None:
        async with self.http.delete(f"{url.rstrip('/')}/_/sessions/{session_id}",
                                    timeout=aiohttp.ClientTimeout(total=5)) as resp:
            await resp.read()


def chain_of(replicas: Sequence) -> list[Hop]:
    """The hops of a ParaServe group's replicas (objects with ``url`` and ``held`` / ``layers`` as the router
    sees them), ordered by the layers they hold; each runs its held range (None when it holds the whole stage)."""
    ordered = sorted(replicas, key=lambda r: (layers.held_range(r) or (0, 0))[0])
    return [Hop(r.url, None if layers.is_whole(r) else layers.held_range(r)) for r in ordered]


Install = Callable[[str, int, int, Hop, bytes], Awaitable[None]]


async def move_kv(http: aiohttp.ClientSession, session_id: str, fed: int, reserve: int, part: Hop, whole: Hop,
                  timeout: aiohttp.ClientTimeout, install: Install | None = None) -> int:
    """Move one part's KV cache of a session (``fed`` positions held, ``reserve`` booked) onto ``whole``: export
    (``GET /_/sessions/<id>/kv``, the part's layers), install there (verified before anything changes); the bytes
    moved. `StepError` when either side refuses. Both the group driver and the gateway's session engine use it."""
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
