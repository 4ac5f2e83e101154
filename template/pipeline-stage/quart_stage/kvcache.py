"""The generation sessions a stage replica holds: their KV caches, positions, and a bounded budget of positions.

A session's cache covers the stage's own layers only (the state object is a transformers ``DynamicCache``,
or the emulated stand-in). The table charges each session ``max(tokens, reserved)`` positions against
``max_tokens`` (``QUART_KV_MAX_TOKENS``): a step that would go over is refused (429) before anything is
computed, so the cache can never grow past the bound. Sessions are freed on their last step, on DELETE,
and after ``idle_s`` without a request (a daemon sweeper thread, started with the first session: never
before a fork).

Thread safety: one lock guards the table and the accounting; each session has its own lock, held for the
whole of a step, so one session's steps run one at a time while different sessions run concurrently.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from quart_stage.errors import QuartError, invalid
from quart_stage.spans import fmt, kv_charge

H_SESSION, H_SESSION_POS, H_SESSION_RESERVE = "X-Quart-Session", "X-Quart-Session-Pos", "X-Quart-Session-Reserve"
H_SESSION_END, H_KV_TOKENS = "X-Quart-Session-End", "X-Quart-KV-Tokens"
FIELD, KV_FIELD = "session", "kv_cache"
RETRY_AFTER_S = 1


@dataclass
class Session:
    """One session on this replica: its cache state and how many positions it holds (and is charged for)."""

    id: str
    state: object
    tokens: int = 0
    reserved: int = 0
    charged: int = 0
    last_used: float = 0.0
    busy: int = 0
    dead: bool = False
    span: tuple[int, int] | None = None  # the layers this replica runs for it (a cooperative part), fixed at Pos 0
    stage: tuple[int, int] | None = None  # the stage's layers: a part is charged its share (spans.kv_charge)
    staged: tuple[int, int] | None = None  # a re-cut's pre-copy: the wider part it will run, charged already
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass(frozen=True)
class SessionInfo:
    """What ``GET /_/sessions`` lists for one session."""

    id: str
    tokens: int
    reserved: int
    idle_s: float


class SessionTable:
    """Sessions by id, at most ``max_tokens`` positions charged over all of them."""

    def __init__(self, max_tokens: int, idle_s: float, clock: Callable[[], float] = time.monotonic,
                 sweeper: bool = True):
        self.max_tokens, self.idle_s, self.clock = max_tokens, idle_s, clock
        self._sessions: dict[str, Session] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._sweeper_wanted = sweeper
        self._sweeper: threading.Thread | None = None

    # -- accounting -----------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self._used

    def occupancy(self) -> str:
        """The ``X-Quart-KV-Tokens`` value: ``used/max``."""
        return f"{self._used}/{self.max_tokens}"

    def held(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None or s.dead else s.tokens

    def _charge(self, s: Session, positions: int) -> None:
        """Charge ``s`` for ``positions`` (tokens or reserve, whichever is larger); 429 if the table is full."""
        want = kv_charge(max(positions, s.reserved), s.staged or s.span, s.stage)
        delta = want - s.charged
        if delta > 0 and self._used + delta > self.max_tokens:
            self._sweep_locked(self.clock())
            if self._used + delta > self.max_tokens:
                raise QuartError(
                    429, f"replica KV cache is full: {self._used} of {self.max_tokens} positions in use, this step "
                         f"needs {delta} more (QUART_KV_MAX_TOKENS)", KV_FIELD, {"Retry-After": str(RETRY_AFTER_S)})
        self._used += delta
        s.charged = want

    def _remove_locked(self, s: Session) -> None:
        if self._sessions.get(s.id) is s:
            del self._sessions[s.id]
        if not s.dead:
            s.dead = True
            self._used -= s.charged
            s.charged = 0

    # -- a step ---------------------------------------------------------------------------------
    @contextmanager
    def step(self, session_id: str, pos: int, new: int, reserve: int,
             make_state: Callable[[], object], span: tuple[int, int] | None = None,
             stage: tuple[int, int] | None = None) -> Iterator[Session]:
        """Hold session ``session_id`` for one step of ``new`` positions after ``pos``.

        Pos 0 (re)starts the session (what the replica held under that id is freed). Otherwise the session must
        hold exactly ``pos`` positions of the same layers ``span`` of ``stage`` (409 naming what it holds); a part
        is charged its share of the positions (:func:`quart_stage.spans.kv_charge`). Capacity is charged before the
        body runs (429 when full); on success the session holds ``pos + new``; if the body raises, the session is freed
        (its cache may be half-updated) and the gateway replays.
        """
        need = kv_charge(max(pos + new, reserve), span, stage)
        if need > self.max_tokens:
            raise invalid(KV_FIELD, f"the session needs {need} positions; this replica holds at most "
                                    f"{self.max_tokens} (QUART_KV_MAX_TOKENS)")
        s = self._enter(session_id, pos, reserve, make_state, span, stage)
        try:
            with s.lock:
                if s.dead or s.tokens != pos or s.span != span:
                    raise self._mismatch(session_id, pos, 0 if s.dead or s.span != span else s.tokens)
                with self._lock:
                    self._charge(s, pos + new)
                try:
                    yield s
                except BaseException:
                    with self._lock:
                        self._remove_locked(s)
                    raise
                s.tokens = pos + new
        finally:
            with self._lock:
                s.busy -= 1
                s.last_used = self.clock()

    def _enter(self, session_id: str, pos: int, reserve: int, make_state: Callable[[], object],
               span: tuple[int, int] | None, stage: tuple[int, int] | None) -> Session:
        with self._lock:
            self._sweep_locked(self.clock())
            s = self._sessions.get(session_id)
            if pos == 0:
                if s is not None:
                    self._remove_locked(s)
                s = Session(session_id, make_state(), reserved=reserve, last_used=self.clock(), span=span,
                            stage=stage)
                self._charge(s, 0)  # the reserve, or nothing
                self._sessions[session_id] = s
                self._start_sweeper()
            elif s is None:
                raise self._mismatch(session_id, pos, 0)
            s.busy += 1
            return s

    def _mismatch(self, session_id: str, pos: int, held: int) -> QuartError:
        what = "does not hold this session" if held == 0 else f"holds {held} positions of this session"
        return QuartError(409, f"replica {what}, the request is for position {pos}: replay from position 0", FIELD,
                          {"X-Quart-Session-Pos": str(held)}, detail={"held": held})

    # -- freeing --------------------------------------------------------------------------------
    def drop(self, session_id: str) -> bool:
        """Free a session now (DELETE, or the last step); False if this replica does not hold it."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                return False
            self._remove_locked(s)
            return True

    def sweep(self) -> int:
        """Free the sessions idle for longer than ``idle_s`` (not those in a step); how many were freed."""
        with self._lock:
            return self._sweep_locked(self.clock())

    def _sweep_locked(self, now: float) -> int:
        idle = [s for s in self._sessions.values() if s.busy == 0 and now - s.last_used > self.idle_s]
        for s in idle:
            self._remove_locked(s)
        return len(idle)

    def _start_sweeper(self) -> None:
        if not self._sweeper_wanted or self._sweeper is not None:
            return
        period = max(0.05, min(self.idle_s / 4.0, 5.0))

        def run() -> None:
            while True:
                time.sleep(period)
                self.sweep()

        self._sweeper = threading.Thread(target=run, name="quart-kv-sweeper", daemon=True)
        self._sweeper.start()

    # -- listing --------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """``GET /_/sessions``: every session, the positions in use and the cap."""
        with self._lock:
            now = self.clock()
            self._sweep_locked(now)
            rows = [SessionInfo(s.id, s.tokens, s.reserved, round(now - s.last_used, 3))
                    for s in self._sessions.values()]
            used = self._used
        return {"sessions": [r.__dict__ for r in rows], "kv_tokens": used, "kv_tokens_max": self.max_tokens,
                "idle_timeout_s": self.idle_s}

    # -- migration (quart_stage.kvmigrate) -------------------------------------------------------
    @contextmanager
    def holding(self, session_id: str) -> Iterator[Session]:
        """Session ``session_id`` under its lock (no step runs meanwhile), to read its cache; 404 if unknown."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or s.dead:
                raise QuartError(404, f"this replica holds no session {session_id[:140]!r}", FIELD)
            s.busy += 1
        try:
            with s.lock:
                yield s
        finally:
            with self._lock:
                s.busy -= 1
                s.last_used = self.clock()

    def adopt(self, session_id: str, tokens: int, reserve: int, make_state: Callable[[], object],
              fill: Callable[[object], None], span: tuple[int, int] | None = None,
              stage: tuple[int, int] | None = None, staged: bool = False) -> None:
        """Install migrated cache into session ``session_id`` at ``tokens`` positions: a new session is made
        (charged ``max(tokens, reserve)``; 429 when full), an existing one must hold exactly ``tokens``
        (409). ``fill(state)`` puts the layers in, under the session's lock. The session then runs ``span`` of
        ``stage`` (None: the whole stage), which must cover the part it ran (409): a re-cut widens a part.
        ``staged`` (a re-cut's pre-copy): the layers wait beside the part, which goes on stepping (the session
        holds ``tokens`` or more), charged as ``span`` already; a later install of the positions since widens it."""
        if max(tokens, reserve) > self.max_tokens:
            raise invalid(KV_FIELD, f"the session needs {max(tokens, reserve)} positions; this replica holds at "
                                    f"most {self.max_tokens} (QUART_KV_MAX_TOKENS)")
        with self._lock:
            self._sweep_locked(self.clock())
            s = self._sessions.get(session_id)
            if (s is None or s.dead) and staged:
                raise self._mismatch(session_id, tokens, 0)
            if s is None or s.dead:
                s = Session(session_id, make_state(), tokens=tokens, reserved=reserve, last_used=self.clock())
                self._charge(s, tokens)
                self._sessions[session_id] = s
                self._start_sweeper()
            s.busy += 1
        try:
            with s.lock:
                if s.dead or (s.tokens < tokens if staged else s.tokens != tokens):
                    raise self._mismatch(session_id, tokens, 0 if s.dead else s.tokens)
                part = s.span, s.stage
                if s.span is not None and span is not None and not span[0] <= s.span[0] < s.span[1] <= span[1]:
                    raise QuartError(409, f"the session runs layers {fmt(s.span)} here, which {fmt(span)} does not "
                                          "cover", FIELD)
                was = s.staged
                with self._lock:  # installed layers join its own: charged their share now (429 when full)
                    s.reserved = max(s.reserved, reserve)
                    if staged:
                        s.staged = span
                    else:
                        s.span, s.stage = (span, stage) if span is not None else (None, None)
                        s.staged = None
                    try:
                        self._charge(s, s.tokens)
                    except QuartError:
                        s.span, s.stage, s.staged = *part, was
                        raise
                try:
                    fill(s.state)
                except BaseException:
                    with self._lock:
                        s.span, s.stage, s.staged = *part, was
                        self._charge(s, s.tokens)  # back to the part's share
                    raise
        finally:
            with self._lock:
                s.busy -= 1
                s.last_used = self.clock()

    def trim(self, session_id: str, drop: tuple[int, int], stage: tuple[int, int],
             free: Callable[[object], None]) -> None:
        """Session ``session_id`` stops running the layers ``drop`` (a re-cut moved their cache to the replica that
        runs the part before): they must be the first of the layers it runs here, not all (409 otherwise);
        ``free(state)`` drops their cache and its charge falls to the rest's share. 404 when unknown."""
        with self.holding(session_id) as s:
            ran = s.span or stage
            if drop[0] != ran[0] or not drop[1] < ran[1]:
                raise QuartError(409, f"the session runs layers {fmt(ran)} here: {fmt(drop)} is not a proper "
                                      "first part of them", FIELD)
            free(s.state)
            with self._lock:
                s.span, s.stage = (drop[1], ran[1]), stage
                self._charge(s, s.tokens)
