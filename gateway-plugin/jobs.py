"""What travels through the pipeline router (:mod:`gateway_plugin.router`): an accepted request (:class:`Job`), a
stage function's FIFO queue with its dispatcher (:class:`StageQueue`), and what one dispatch of a queue's head did
(:class:`Head`)."""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gateway_plugin.metrics import StageVisit

__all__ = ["Head", "Job", "StageQueue"]


@dataclass(slots=True, eq=False)  # identity semantics: jobs live in sets
class Job:
    """One accepted pipeline request travelling through the stages."""

    id: str
    model: str
    stages: list[str]
    body: bytes
    content_type: str
    arrival: float
    deadline: float
    future: asyncio.Future
    accept: str = ""  # the client's Accept header, for the last stage only (the others exchange safetensors)
    stage: int = 0
    layer_at: int | None = None  # the first layer of the stage not run yet; None at the stage's start
    enqueued_at: float = 0.0
    queue_len_seen: int = 0
    tried: set = field(default_factory=set)
    attempts: int = 0
    visits: list[StageVisit] = field(default_factory=list)
    task: asyncio.Task | None = None
    began: bool = False  # its call's task has started (a task cancelled before it never gives its slot back)
    done: bool = False
    solo: bool = False  # sent alone, never in a batch (its batch's answer did not split: gateway_plugin.batching)
    member: Any = None  # (body, its batch member) memo of gateway_plugin.batching.member_for: a body parsed once


class Head(enum.Enum):
    """What :meth:`Router.serve_head` did: launched the head's call, found the queue empty, or no free replica."""

    LAUNCHED = "launched"
    EMPTY = "empty"
    NO_REPLICA = "no replica"


@dataclass(slots=True)
class StageQueue:
    """A stage function's FIFO queue, its calls in flight (``busy``) and its dispatcher task."""

    function: str
    jobs: deque = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    busy: int = 0
    dispatcher: asyncio.Task | None = None
    parked: bool = False  # the dispatcher waits for a job (the queue is empty)
