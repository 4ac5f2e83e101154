"""The generation data plane of the simulator: sessions that prefill once, then decode one token per step,
through the stages, pinned per stage to the replica that holds their KV cache (``SimConfig.generation``).

As the live gateway runs them (docs/generation.md, `gateway_plugin.generation`):

- **Entry and KV capacity**: a session books prompt + new tokens on one replica of every stage for its whole
  life (`kvbook.KVBook`: among the replicas with room, the least loaded, ties to the least booked). A session
  that finds no replica with room at some stage waits at the entry (the live gateway answers 429 +
  Retry-After and the client retries: the same wait); beyond ``queue_cap`` waiting sessions it is refused.
- **Steps**: the prefill step carries the prompt through every stage, then each decode step one position;
  a stage's step takes ``max(decode_s, positions × prefill_s_per_token)`` × the CPU effect × a gamma draw
  (`quart_stage.emulated.StepTime`, the emulated stage's rule) plus the hop. The prompt goes in chunks of
  ``prefill_chunk`` positions (consecutive requests with growing Pos, as the protocol allows), each a step of its
  own. A free replica runs every decode step waiting there and the oldest prefill chunk as one batch
  (continuous batching with chunked prefill, up to ``decode_batch`` decodes): max(one weight read
  (``decode_s``), the chunk's compute) plus each decoding session's KV read at the GPU's memory bandwidth
  (``Calibration.hbm_gbytes_s``); ``decode_batch`` 1 runs one step at a time, FIFO. Steps of different sessions
  pipeline across stages. TTFT = entry wait + the prefill through the stages; TPOT = (last token − first) /
  (tokens − 1): one decode step through the pipeline, bound by the busiest stage when replicas are shared.
- **Scale-up**: a new replica takes new sessions only (affinity). A live (BlitzScale) replica takes sessions
  from its first layer: each of its steps runs the layers it holds and the rest on a whole replica of the stage
  (cooperative execution; the rest runs before new steps there); once whole it holds every layer of its
  sessions' caches (the missing layers' KV moves over the NIC meanwhile: not charged). A ParaServe part or
  helper serves sessions at its sub-pipeline's step time; when the group consolidates a helper's sessions move
  to a kept worker of the group with their KV (bytes over the NIC, charged to their next step there), no
  re-prefill.
- **Scale-down**: a replica with sessions drains (the convergence's surplus rule reads pinned sessions as in
  flight, as the live reconciler reads the KV book) and is released when its last session ends.

Draws are per (session, stage) for the prefill and from a per-stage pool for decode steps (session, step), the
same for every policy (common random numbers).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np
from gateway_plugin.metrics import BatchTimes
from quart_tools.genload import token_lengths
from quart_tools.sim.calibration import GB
from quart_tools.sim.events import COMPLETE, EventLoop
from quart_tools.sim.state import Replica, SimConfig, Tally, _Stage

DECODE_POOL = 1 << 16  # decode-step draws per stage
PREFILL, DECODE = 0, 1  # what a step is


class Session:
    __slots__ = ("req", "prompt", "new", "need", "reps", "tokens", "pos", "first", "last", "running", "extra", "move")

    def __init__(self, req: int, prompt: int, new: int, stages: int) -> None:
        self.req, self.prompt, self.new, self.need = req, prompt, new, prompt + new
        self.reps: list[Replica] = []  # pinned, one per stage
        self.tokens = 0  # tokens produced
        self.pos = 0  # prompt positions prefilled at the stage its prefill is at (chunked prefill)
        self.first = self.last = -1.0  # first and latest token times
        self.running: Replica | None = None  # the replica running its step now
        self.extra = [0.0] * stages  # seconds added to its next step per stage (a KV migration)
        self.move = -1  # stage whose replica it leaves once its running step is done (a consolidating helper)


class GenerationFlow:
    """Sessions through the stages: entry with KV booking, prefill, decode steps, live and ParaServe replicas."""

    def __init__(self, cfg: SimConfig, stages: list[_Stage], loop: EventLoop, tally: Tally,
                 release: Callable[[Replica, float], None], prompt: np.ndarray, new: np.ndarray) -> None:
        self.cfg, self.stages, self.loop, self.tally, self.release = cfg, stages, loop, tally, release
        self.hop = cfg.hop_s if cfg.hop_holds_replica else 0.0
        self.hbm_bytes_s = cfg.calibration.hbm_gbytes_s * GB
        self.prompt, self.new = prompt, new
        rng = np.random.default_rng((cfg.seed, 1))  # its own stream: the one-shot draws stay as they are
        cv = cfg.calibration.service_cv
        shape = 1.0 / (cv * cv) if cv > 0 else 0.0
        self.decode_draws = [rng.gamma(shape, 1.0 / shape, DECODE_POOL).tolist() if cv > 0 else [1.0] * DECODE_POOL
                             for _ in stages]
        self.booked: dict[Replica, int] = {}  # KV positions booked per replica
        self.queued: dict[Replica, deque] = {}  # steps waiting per replica
        self.active: set[Replica] = set()  # replicas running a step
        self.extra: list[list[Replica]] = [[] for _ in stages]  # live replicas and ParaServe helpers taking sessions
        self.sessions: dict[Replica, dict[int, Session]] = {}  # sessions pinned per replica
        self.decode_times = [BatchTimes() for _ in stages]  # decode-only batches' service by size (stage_decode)
        self.index = {st.function: st.index for st in stages}
        tally.ttft_ms = np.full(len(prompt), np.nan)
        tally.tpot_ms = np.full(len(prompt), np.nan)
        tally.token_gaps = []

    # ------------------------------------------------------------------------------ entry
    def arrive(self, req: int, now: float) -> None:
        st0 = self.stages[0]
        if len(st0.queue) >= self.cfg.queue_cap:
            self.tally.rejected += 1  # refused at the entry: TTFT and latency stay NaN
            return
        s = Session(req, int(self.prompt[req]), int(self.new[req]), len(self.stages))
        st0.arrivals.append(now)
        if not st0.queue and self._pin(s):
            self._step(s, 0, PREFILL, now)
        else:
            st0.queue.append((s, now))

    def _admit_waiting(self, now: float) -> None:
        q = self.stages[0].queue
        while q and self._pin(q[0][0]):
            s, _ = q.popleft()
            self._step(s, 0, PREFILL, now)

    def _candidates(self, st: _Stage) -> list[Replica]:
        extra = self.extra[st.index]
        extra[:] = [r for r in extra if (r.live and r.state == "starting")
                    or (r.helper and r.state == "ready" and r.consolidated_at < 0)]
        return [*st.ready, *extra]

    def _load(self, rep: Replica) -> int:
        q = self.queued.get(rep)
        return (len(q) if q else 0) + (rep in self.active)

    def _pin(self, s: Session) -> bool:
        """Book the session on one replica of every stage, or on none (no stage without room)."""
        chosen = []
        for st in self.stages:
            cap = st.spec.kv_tokens
            fits = [r for r in self._candidates(st) if cap - self.booked.get(r, 0) >= s.need]
            if not fits:
                return False
            chosen.append(min(fits, key=lambda r: (self._load(r), self.booked.get(r, 0))))
        for st, rep in zip(self.stages, chosen, strict=True):
            self._attach(st, rep, s)
        s.reps = chosen
        return True

    def _attach(self, st: _Stage, rep: Replica, s: Session) -> None:
        self.booked[rep] = self.booked.get(rep, 0) + s.need
        self.sessions.setdefault(rep, {})[s.req] = s
        if not rep.in_flight and rep in st.free:
            st.free.remove(rep)
        rep.in_flight += 1  # sessions pinned: what the convergence drains

    def _detach(self, st: _Stage, rep: Replica, s: Session, now: float) -> None:
        self.booked[rep] -= s.need
        del self.sessions[rep][s.req]
        rep.in_flight -= 1
        if rep.in_flight:
            return
        if rep.state == "draining":
            self.release(rep, now)
            self.queued.pop(rep, None)
        elif rep.state == "ready":
            st.free.append(rep)

    # ------------------------------------------------------------------------------ steps
    def _step(self, s: Session, index: int, kind: int, now: float) -> None:
        st = self.stages[index]
        rep = s.reps[index]
        st.metrics.on_arrival(now, st.spec.activation_bytes)
        if rep in self.active:
            self.queued.setdefault(rep, deque()).append((s, kind, now))
            st.waiting += 1
        else:
            self._run(st, rep, [(s, kind, now)], now)

    def _take(self, st: _Stage, rep: Replica, now: float) -> None:
        """The next batch of a free replica: every decode step waiting there (up to ``decode_batch``) and the
        oldest prefill chunk (chunked prefill beside continuous batching); one step at a time with
        ``decode_batch`` 1."""
        q = self.queued.get(rep)
        if not q:
            return
        if self.cfg.decode_batch <= 1:
            batch = [q.popleft()]
        else:
            batch, keep, prefill = [], deque(), False
            for item in q:
                if item[1] == PREFILL and not prefill:
                    prefill = True
                    batch.append(item)
                elif item[1] == DECODE and len(batch) - prefill < self.cfg.decode_batch:
                    batch.append(item)
                else:
                    keep.append(item)
            self.queued[rep] = keep
        st.waiting -= len(batch)
        self._run(st, rep, batch, now)

    def _run(self, st: _Stage, rep: Replica, batch: list[tuple[Session, int, float]], now: float) -> None:
        """One forward pass of ``batch``: max(the weight read, the prefill chunk's compute) plus the decoding
        sessions' KV reads; on a live replica only the layers it holds (the rest goes to a whole replica)."""
        spec = st.spec
        compute, kv = 0.0, 0.0
        for s, kind, enq in batch:
            st.metrics.on_dispatch(now, now - enq)
            if kind == PREFILL:
                chunk = self.cfg.prefill_chunk
                n = min(chunk, s.prompt - s.pos) if chunk > 0 else s.prompt - s.pos
                s.pos += n
                compute = max(compute, n * spec.prefill_s_per_token * st.draws[s.req])
            else:
                draw = self.decode_draws[st.index][(s.req * 7919 + s.tokens) % DECODE_POOL]
                compute = max(compute, spec.decode_s * draw)
                kv += (s.prompt + s.tokens) * spec.kv_bytes_per_token
        full = (max(compute, spec.decode_s) + kv / self.hbm_bytes_s) * rep.factor
        held = min(rep.layers, max(1, math.floor((now - rep.layer0) / rep.layer_dt) + 1))
        rest = full * (1.0 - held / rep.layers) if held < rep.layers else 0.0
        service = full - rest + self.hop
        for s, _kind, _enq in batch:
            service += s.extra[st.index]
            s.extra[st.index] = 0.0
            s.running = rep
        st.busy += 1
        self.active.add(rep)
        self.loop.push(now + service, COMPLETE, (rep, [(s, kind) for s, kind, _ in batch], service, rest))

    def complete(self, payload: tuple, now: float) -> None:
        rep, items, service, rest = payload
        st = self.stages[rep.stage]
        per_step = service / len(items)  # what the controller's window sees: the batch's time per step
        if all(kind == DECODE for _, kind in items) and rest == 0:
            self.decode_times[st.index].record(len(items), service)
        for _ in items:
            st.metrics.on_complete(now, per_step)
        st.busy -= 1
        self.active.discard(rep)
        for s, _kind in items:
            s.running = None
            if s.move == rep.stage:
                self._migrate(st, rep, s, now)
        self._next(st, rep, now)
        if rest > 0:  # a live replica ran its layers: the rest on a whole replica of the stage, first in line
            st.remainders.append((items, rest + self.hop))
            self._take_rest(st, now)
            return
        for s, kind in items:
            self._advance(s, st.index, kind, now)

    def _next(self, st: _Stage, rep: Replica, now: float) -> None:
        """A replica is done with a step: the oldest rest of a live replica's step (whole replicas), else its next
        batch."""
        if st.remainders and rep.state == "ready" and not rep.helper:
            self._run_rest(st, rep, now)
        else:
            self._take(st, rep, now)

    def _take_rest(self, st: _Stage, now: float) -> None:
        for rep in st.ready:
            if rep not in self.active:
                self._run_rest(st, rep, now)
                return

    def _run_rest(self, st: _Stage, rep: Replica, now: float) -> None:
        items, seconds = st.remainders.popleft()
        st.busy += 1
        self.active.add(rep)
        self.loop.push(now + seconds, COMPLETE, (rep, items, seconds, 0.0))

    def _advance(self, s: Session, index: int, kind: int, now: float) -> None:
        if kind == PREFILL:
            if s.pos < s.prompt:  # the prompt's next chunk, at this stage again (other steps go between)
                self._step(s, index, PREFILL, now)
                return
            s.pos = 0
        if index + 1 < len(self.stages):
            self._step(s, index + 1, kind, now)
            return
        tally = self.tally
        s.tokens += 1
        if s.first < 0:
            s.first = now
            tally.ttft_ms[s.req] = (now - tally.arrival[s.req]) * 1000.0
        else:
            tally.token_gaps.append((now, (now - s.last) * 1000.0))
        s.last = now
        if s.tokens < s.new:
            self._step(s, 0, DECODE, now)
            return
        if s.new > 1:
            tally.tpot_ms[s.req] = (s.last - s.first) * 1000.0 / (s.new - 1)
        tally.latency[s.req] = (now - tally.arrival[s.req]) * 1000.0
        for st, rep in zip(self.stages, s.reps, strict=True):
            self._detach(st, rep, s, now)
        self._admit_waiting(now)

    # ------------------------------------------------------------------------------ the controller's view
    def stage_generation(self, function: str) -> tuple[int, int, int]:
        """(sessions, KV positions booked, KV positions its ready replicas hold), as ``SessionEngine`` reports."""
        st = self.stages[self.index[function]]
        mine = [rep for rep in self.sessions if rep.stage == st.index]
        return (sum(len(self.sessions[rep]) for rep in mine), sum(self.booked.get(rep, 0) for rep in mine),
                st.spec.kv_tokens * len(st.ready))

    def stage_decode(self, function: str) -> tuple[tuple[tuple[int, int, float], ...], int]:
        """The stage's decode-only batches by size and the decode batch limit."""
        return self.decode_times[self.index[function]].table(), max(1, self.cfg.decode_batch)

    # ------------------------------------------------------------------------------ replicas
    def on_ready(self, stage: _Stage, rep: Replica, now: float) -> None:
        """A replica is loaded (a ParaServe helper: its part is in): it takes new sessions."""
        if rep.helper:
            self.extra[stage.index].append(rep)
        if not rep.in_flight:
            stage.free.append(rep)
        if stage.remainders and not rep.helper:
            self._take_rest(stage, now)
        self._admit_waiting(now)

    def live_first(self, rep: Replica, now: float) -> None:
        """A live start's first layer is in: it takes new sessions, running the layers it holds."""
        if rep.state != "starting":
            return
        rep.live = True
        self.extra[rep.stage].append(rep)
        self._admit_waiting(now)

    def before_consolidated(self, rep: Replica, now: float) -> None:
        """A ParaServe group consolidates: a helper's sessions move to a kept worker with their KV."""
        if not rep.helper:
            return
        st = self.stages[rep.stage]
        for s in list(self.sessions.get(rep, {}).values()):
            if s.running is rep:
                s.move = rep.stage  # after its step there
            else:
                self._migrate(st, rep, s, now)

    def _migrate(self, st: _Stage, rep: Replica, s: Session, now: float) -> None:
        s.move = -1
        kept = [r for r in rep.group if not r.helper and r.state == "ready"] or list(st.ready)
        fits = [r for r in kept if st.spec.kv_tokens - self.booked.get(r, 0) >= s.need]
        if not fits:
            return  # stays where it is until it ends (the helper drains)
        dest = min(fits, key=lambda r: (self._load(r), self.booked.get(r, 0)))
        q = self.queued.get(rep)
        mine = [item for item in q if item[0] is s] if q else []
        for item in mine:
            q.remove(item)
            st.waiting -= 1
        self._detach(st, rep, s, now)
        self._attach(st, dest, s)
        s.reps[st.index] = dest
        self.tally.kv_migrations += 1
        held = s.prompt + s.tokens
        s.extra[st.index] = held * st.spec.kv_bytes_per_token / (self.cfg.calibration.nic_gbytes_s * GB)
        for _s, kind, enq in mine:
            if dest in self.active:
                self.queued.setdefault(dest, deque()).append((s, kind, enq))
                st.waiting += 1
            else:
                self._run(st, dest, [(s, kind, enq)], now)


def session_lengths(arrivals, max_context: int, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, new tokens) per session: the trace's ContextTokens and GeneratedTokens capped as
    `quartctl load --generate` caps them (`quart_tools.genload.token_lengths`)."""
    if arrivals.tokens is None or arrivals.generated is None:
        raise ValueError("a generation workload needs arrivals with token lengths (a trace, or fixed lengths)")
    return token_lengths(arrivals.tokens, arrivals.generated, max_context=max_context, max_new_tokens=max_new_tokens)
