"""One generation session in flight (where its KV caches are, what it fed and generated), and what the session
engine's helpers — the live splits (:mod:`.cooperative`) and the ParaServe chains (:mod:`.groupsessions`) — may
ask of the engine (:class:`SessionHost`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
from gateway_plugin import layers
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.kvbook import KVBook
from gateway_plugin.generation.roomwait import RoomQueue
from gateway_plugin.ports import Replica, ReplicaSource
from quart_stage.sample_history import with_history


class StepFailed(Exception):
    """A stage replica could not run a step; the session replays elsewhere."""

    def __init__(self, stage: int, replica: Any, why: str, keep: bool = False) -> None:
        super().__init__(why)
        self.stage, self.replica, self.why, self.keep = stage, replica, why, keep  # keep: the replica may serve the replay


@dataclass
class Split:
    """A session's stage run in two parts: ``partial`` runs ``part``, the session's whole replica ``rest``."""

    partial: Any
    part: layers.Range
    rest: layers.Range
    part_tokens: int = 0  # KV positions booked on the live replica: its part's share + ``reserve``
    rest_tokens: int = 0  # ... and on the whole replica
    reserve: int = 0  # the part of ``part_tokens`` held for the rejoin (live_split.split_booking)
    shadow: Any = None  # the background replay's Session, while it runs or until the switch
    task: asyncio.Task | None = None
    base: str = ""  # the session id the replay was started from (a failover in between makes it stale)
    given_up: bool = False  # the replay failed: the session stays split
    recut_off: bool = False  # a re-cut was refused: the cut stays where it is
    recut: Any = None  # a re-cut under way (cooperative.PreCopy): its pre-copy, until the next step finishes it
    extra: list = field(default_factory=list)  # (replica, positions) the replay booked beyond the session's own


@dataclass
class Chain:
    """A session's stage run by part replicas in order: ``hops`` (replica, the layers it runs), each booked
    ``charges[i]`` positions."""

    hops: list[tuple[Any, layers.Range]]
    charges: list[int]

    def bookings(self) -> list[tuple[Any, int]]:
        return [(r, n) for (r, _), n in zip(self.hops, self.charges, strict=True)]

    def members(self) -> list[Any]:
        return [r for r, _ in self.hops]


@dataclass
class Session:
    """One generation in flight: where its caches are, what it fed, what it generated."""

    model: str
    stages: list[str]
    replicas: list[Any]  # the whole replica of each stage (None where a chain runs it)
    need: int  # positions booked on each of its replicas
    prompt: list[int]
    max_tokens: int
    sample: dict[str, Any]
    eos: frozenset[int]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # positions every replica holds
    replays: int = 0
    moves: int = 0  # replays that moved it off a draining replica
    rejoins: int = 0  # splits ended onto a live replica that became whole
    splits: dict[int, Split] = field(default_factory=dict)  # stage index -> its cooperative split
    chains: dict[int, Chain] = field(default_factory=dict)  # stage index -> the ParaServe parts that run it
    reprefills: int = 0  # KV migrations that failed and replayed
    freed: bool = False
    finish_reason: str = ""
    micro: int = 0  # its micro-batch group at every stage (decodebatch: S groups keep S stages busy at once)
    logprobs: list[dict] = field(default_factory=list)  # per generated token: {"logprob", "top"?} when asked
    answered: dict = field(default_factory=dict)  # the last stage's answer to the last step (its logprobs)
    prompt_logprobs: list[dict] = field(default_factory=list)  # echo: prompt tokens 1.. (their logprobs), when asked

    def took(self, doc: dict) -> int:
        """The token of the last stage's answer to a step; its logprobs (when asked) kept for :meth:`add`."""
        token = int(doc["token"])
        self.answered = {k: doc[k] for k in ("logprob", "top") if k in doc}
        if doc.get("prompt_from") == len(self.prompt_logprobs) + 1:  # a prefill's part (a replay's again: kept once)
            self.prompt_logprobs += list(doc.get("prompt") or ())
        return token

    def add(self, token: int) -> None:
        """A step's token is the session's next (its logprobs too, when asked)."""
        self.generated.append(token)
        if "logprobs" in self.sample:
            self.logprobs.append(self.answered)

    def step_sample(self) -> dict[str, Any]:
        """The last stage's sample for the next step (quart_stage.sample_history.with_history)."""
        return with_history(self.sample, self.prompt, self.generated)

    def calls(self, k: int) -> list[tuple[Any, layers.Range | None]]:
        """The replica calls of stage ``k`` of a step: (replica, its layers or None for the whole stage)."""
        split, chain = self.splits.get(k), self.chains.get(k)
        if chain is not None:
            return list(chain.hops)
        if split is None:
            return [(self.replicas[k], None)]
        return [(split.partial, split.part), (self.replicas[k], split.rest)]

    def partials(self) -> list[Any]:
        """The part replicas it holds caches on besides its whole ones (splits' live parts, chains' parts)."""
        return [s.partial for s in self.splits.values()] + [r for c in self.chains.values() for r in c.members()]

    def bookings(self) -> list[tuple[Any, int]]:
        """What it holds booked: (replica, positions) for every stage, a split's or a chain's parts each their share."""
        out = []
        for k, replica in enumerate(self.replicas):
            out += stage_bookings(self.chains.get(k) or replica, self.need, self.splits.get(k))
        return out


def stage_bookings(placed: Any, need: int, split: Split | None) -> list[tuple[Any, int]]:
    """What one stage of a session books: a ParaServe chain each part its share, else the whole replica ``need``
    positions, or with a split its share and the live replica the rest."""
    if placed is None:
        return []
    if isinstance(placed, Chain):  # a ParaServe chain
        return placed.bookings()
    if split is None:
        return [(placed, need)]
    return [(placed, split.rest_tokens), (split.partial, split.part_tokens)]


class SessionHost(Protocol):
    """What the engine's helpers use of it: the book, the settings, the clock, the replicas, and five acts on a
    session (`gateway_plugin.generation.sessions.SessionEngine` is the one host)."""

    book: KVBook
    config: GenerationConfig
    clock: Callable[[], float]
    source: ReplicaSource  # ``ready(function)``: every ready replica, parts too
    room: RoomQueue  # ``waiting(function)``: new sessions in line for room

    def client(self) -> aiohttp.ClientSession: ...

    def forget(self, replica: Replica, session_id: str, then: Callable[[], None] | None = None) -> None:
        """``DELETE /_/sessions/<id>`` on one replica in the background; ``then()`` once it is answered."""

    def drop(self, session: Session) -> None:
        """The session's id deleted on every replica of it (its parts too), in the background."""

    def renew(self, session: Session, new_id: str | None = None) -> None:
        """The session goes on under a new id (a fresh one, or ``new_id``)."""

    def rehome(self, session: Session, stage: int, placed: Replica | Chain) -> None:
        """Stage ``stage`` runs on ``placed`` (booked) under a new id; the next step replays from position 0."""

    async def step(self, session: Session, new: list[int], pos: int, last: bool) -> int:
        """One step of the session through its stages; the last stage's token."""
