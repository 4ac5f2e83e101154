"""`quartctl bench blitzscale --workload generation`: the scale-up of ``quartctl bench blitzscale`` under a burst
of generation sessions, judged on BlitzScale's own metrics: time to first token (TTFT) and time between tokens
(TBT).

The stage is the same 1 GB one-stage decoder on the same netns hosts, with *emulated* compute for generation
steps (``--decode-ms`` per decode step of the whole stage, ``--prefill-ms-per-token`` per prompt position; a
part of the stage costs its share of the layers) and a KV cache of ``--kv-sessions`` sessions per replica
(``QUART_KV_MAX_TOKENS`` = that many sessions of prompt + max tokens; a part of the stage is charged its share).
A new session that finds every ready replica's KV cache full waits in line at the gateway's entry
(first come first served, up to ``--room-wait-s``: ``QUART_GEN_ROOM_WAIT_S``), then gets a 429; the bench's
clients retry a 429 every ``--retry-ms`` (TTFT counts from the first try). The gateway's session engine
(``gateway_plugin.generation``) runs in this process.

Timeline: sessions arrive at ``--steady-rate`` per second on ``h0``'s one replica for ``--steady-s`` s (the
steady TBT: tokens in that window after its first second), then the scale-up is asked for (t0) and
``--rate`` more sessions per second arrive for ``--burst-s`` s on top of the steady ones. The row's TTFT is
over the sessions that arrived from t0 on; its TBT over every token produced from t0 until the last session
ended (the scale-up and the rejoins included). Every token is checked against the emulated model's own
(``wrong``: sessions whose tokens differ; ``lost``: sessions that ended in an error).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from quart_kernel.scheduling.live_split import REJOIN_MODES
from quart_provider.config import DEFAULT_NAMESPACE
from quart_tools.bench.blitz import PeerCluster
from quart_tools.bench.blitzscale_gateway import FUNCTION, deployment, percentile, scaled_gateway
from quart_tools.bench.blitzscale_timeline import Timeline


@dataclass
class Stream:
    """One session as its client saw it."""

    arrived: float
    burst: bool
    expected: list[int]
    opened: float = 0.0  # when the engine placed it (after any 429s at the entry)
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    retries: int = 0
    rejoins: int = 0
    replays: int = 0
    split: bool = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workload generation")
    g.add_argument("--decode-ms", type=float, default=80.0, help="emulated decode step of the whole stage (80)")
    g.add_argument("--prefill-ms-per-token", type=float, default=1.0, help="emulated prefill per position (1)")
    g.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (64)")
    g.add_argument("--max-tokens", type=int, default=16, help="tokens generated per session (16)")
    g.add_argument("--kv-sessions", type=int, default=6, help="sessions a replica's KV cache holds (6)")
    g.add_argument("--steady-rate", type=float, default=2.0, help="steady sessions/s on h0, all along (2)")
    g.add_argument("--steady-s", type=float, default=5.0, help="steady phase before the scale-up, s (5)")
    g.add_argument("--gen-rate", type=float, default=5.0, help="burst sessions/s on top, from t0 (5)")
    g.add_argument("--gen-burst-s", type=float, default=8.0, help="burst length, s (8)")
    g.add_argument("--retry-ms", type=float, default=20.0, help="a client's retry after a 429 at the entry (20)")
    g.add_argument("--room-wait-s", type=float, default=30.0,
                   help="QUART_GEN_ROOM_WAIT_S of the engine: a new session's wait in line for KV room (30; 0 = 429 "
                        "at once, the clients' retries decide who gets freed room)")
    g.add_argument("--rejoin", default="auto", choices=REJOIN_MODES,
                   help="QUART_GEN_REJOIN of the engine (default auto)")
    g.add_argument("--recut", default="on", choices=("on", "off"),
                   help="QUART_GEN_RECUT of the engine: re-cut splits while sessions wait for room (on)")
    g.add_argument("--slots", type=int, default=32, help="steps a replica runs at once (com.quart.concurrency)")


def expected_tokens(prompt: list[int], n: int, seed: int, vocab: int) -> list[int]:
    """The emulated model's tokens (quart_stage.kvmigrate.EmulatedKV: a hash of the seed and the session's ids)."""
    from quart_stage.kvmigrate import EmulatedKV

    state = EmulatedKV(seed, 1)
    state.ids = list(prompt)
    out = [state.token(vocab)]
    while len(out) < n:
        state.ids.append(out[-1])
        out.append(state.token(vocab))
    return out


async def run_generation(cluster: PeerCluster, hosts: list[str], mode: str, args: argparse.Namespace,
                         vocab: int) -> dict:
    """One scale-up under a generation burst; the gateway and its replicas are stopped at the end."""
    from gateway_plugin.generation.config import GenerationConfig
    from gateway_plugin.generation.sessions import SessionEngine
    from quart_stage.errors import QuartError

    need = args.prompt_tokens + args.max_tokens
    env = {"QUART_EMULATED_DECODE_MS": str(args.decode_ms),
           "QUART_EMULATED_PREFILL_MS_PER_TOKEN": str(args.prefill_ms_per_token),
           "QUART_KV_MAX_TOKENS": str(args.kv_sessions * need)}
    dep = deployment(DEFAULT_NAMESPACE, args.service_ms, 1, env, concurrency=args.slots)
    rng = random.Random(7)
    async with scaled_gateway(cluster, hosts, mode, dep) as g:
        engine = SessionEngine(g.view, GenerationConfig(kv_tokens=args.kv_sessions * need, replica_wait_s=120.0,
                                                        max_replays=5, rejoin=args.rejoin, room_wait_s=args.room_wait_s,
                                                        recut=args.recut == "on"))
        timeline = Timeline(engine, FUNCTION, g.first, need, float("inf"), time.monotonic)
        stop = asyncio.Event()
        try:
            async def one(at: float, burst: bool) -> Stream:
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
                seed = rng.getrandbits(32)
                stream = Stream(time.monotonic(), burst, expected_tokens(prompt, args.max_tokens, seed, vocab))
                deadline = stream.arrived + 120
                try:
                    while True:
                        try:
                            session = await engine.open("blitzscale", [FUNCTION], prompt, args.max_tokens,
                                                        {"temperature": 0.0, "seed": seed}, frozenset())
                            break
                        except QuartError as exc:
                            if exc.status != 429 or time.monotonic() > deadline:
                                raise
                            stream.retries += 1
                            await asyncio.sleep(args.retry_ms / 1000)
                    stream.opened, stream.split = time.monotonic(), bool(session.splits)
                    timeline.admitted += stream.opened >= timeline.t0
                    async for token in engine.tokens(session):
                        stream.times.append(time.monotonic())
                        if len(stream.times) > 1:
                            timeline.step(stream.times[-1], stream.split, stream.times[-1] - stream.times[-2])
                        stream.tokens.append(token)
                    stream.rejoins, stream.replays = session.rejoins, session.replays
                except QuartError as exc:
                    stream.error = exc.message
                return stream

            await one(time.monotonic(), False)  # warm the path
            start = time.monotonic()
            t0 = start + args.steady_s
            steady_n = int(args.steady_rate * (args.steady_s + args.gen_burst_s))
            tasks = [asyncio.create_task(one(start + i / args.steady_rate, False)) for i in range(steady_n)]
            await asyncio.sleep(max(0.0, t0 - time.monotonic()))
            t0 = timeline.t0 = await g.scale_up()
            sampler = asyncio.create_task(timeline.run(stop))
            tasks += [asyncio.create_task(one(t0 + i / args.gen_rate, True))
                      for i in range(int(args.gen_rate * args.gen_burst_s))]
            whole_at = await g.whole()
            streams = list(await asyncio.gather(*tasks))
            stop.set()
            await sampler
        finally:
            stop.set()
            await engine.close()
        return summarize(mode, streams, start + 1.0, t0, whole_at, engine.live_splits.shadows) | await g.row() | {
            "first_served_ms": g.first_served_ms(), "rejoin_moves": moves(engine.live_splits.moved),
            "recuts": moves([(b, s) for b, s, _ in engine.live_splits.recuts])
            | {"precopy_ms_p50": percentile([1000 * p for _, _, p in engine.live_splits.recuts], 0.5)},
            "room_wait": {"waited": engine.room.counts.waited, "late_429": engine.room.counts.late,
                          "full_429": engine.room.counts.full},
            "timeline": timeline.table(),
            "rejoin_replays": {"count": len(engine.live_splits.replayed),
                               "ms_p50": percentile([1000 * s for _, s in engine.live_splits.replayed], 0.5),
                               "ms_max": percentile([1000 * s for _, s in engine.live_splits.replayed], 1.0)}}


def summarize(mode: str, streams: list[Stream], steady_from: float, t0: float, whole_at: float, shadows: int
              ) -> dict:
    """The row: TTFT of the sessions that arrived from t0, TBT of every token from t0, steady TBT before t0."""
    steady_tbt, tbt, split_tbt, loading_tbt = [], [], [], []
    for s in streams:
        for a, b in zip(s.times, s.times[1:], strict=False):
            if steady_from <= b < t0:
                steady_tbt.append(1000 * (b - a))
            elif b >= t0:
                tbt.append(1000 * (b - a))
                if s.split:
                    split_tbt.append(1000 * (b - a))
                if b < whole_at:
                    loading_tbt.append(1000 * (b - a))
    late = [s for s in streams if s.times and s.arrived >= t0]
    ttft = [1000 * (s.times[0] - s.arrived) for s in late]
    waits = [1000 * (s.opened - s.arrived) for s in late]  # TTFT's part spent waiting for KV room at the entry
    done = [s for s in streams if not s.error]
    return {"mode": mode, "ready_ms": round(1000 * (whole_at - t0), 1),
            "ttft_p50_ms": percentile(ttft, 0.5), "ttft_p99_ms": percentile(ttft, 0.99),
            "tbt_p50_ms": percentile(tbt, 0.5), "tbt_p99_ms": percentile(tbt, 0.99),
            "entry_wait_p50_ms": percentile(waits, 0.5), "entry_wait_p99_ms": percentile(waits, 0.99),
            "split_tbt_p99_ms": percentile(split_tbt, 0.99), "loading_tbt_p99_ms": percentile(loading_tbt, 0.99),
            "steady_tbt_p50_ms": percentile(steady_tbt, 0.5), "steady_tbt_p99_ms": percentile(steady_tbt, 0.99),
            "sessions": len(streams), "burst_sessions": sum(s.burst for s in streams),
            "completed": len(done), "lost": len(streams) - len(done),
            "wrong": sum(s.tokens != s.expected for s in done),
            "split": sum(s.split for s in streams), "rejoins": sum(s.rejoins for s in streams),
            "rejoin_replays_started": shadows,
            "retries_429": sum(s.retries for s in streams), "tbt_samples": len(tbt),
            "replays": sum(s.replays for s in streams),
            "errors": sorted({s.error[:200] for s in streams if s.error})[:3],
            "late_sessions": {"cols": ["arrived_s", "wait_ms", "ttft_ms", "split"],
                              "rows": [[round(s.arrived - t0, 3), round(w, 1), round(t, 1), int(s.split)]
                                       for s, w, t in zip(late, waits, ttft, strict=True)]}}


def moves(moved: list[tuple[int, float]]) -> dict:
    """The migrate rejoins: how many, the KV bytes each moved, and how long each stream waited for its move."""
    return {"count": len(moved), "kv_bytes_p50": percentile([b for b, _ in moved], 0.5),
            "wait_ms_p50": percentile([1000 * s for _, s in moved], 0.5),
            "wait_ms_max": percentile([1000 * s for _, s in moved], 1.0)}


def report(rows: list[dict], args: argparse.Namespace) -> dict:
    """The document: the rows, the steady TBT (median of the rows' own), and the two ratios the issue asks, per
    round with ``--runs`` (each round's live against the same round's peer-fetch) and how many rounds met both."""
    steady = _steady([r for r in rows])
    runs = sorted({r.get("run", 0) for r in rows})
    per_run = [gen_ratios([r for r in rows if r.get("run", 0) == i]) for i in runs]
    met = [x.get("live_ttft_p99_over_peer_fetch", 9) <= 0.5 and x.get("live_tbt_p99_over_steady", 9) <= 1.5
           for x in per_run]
    out = {"workload": "generation", "steady_tbt_p99_ms": steady,
           "ratios": per_run[0] if len(per_run) == 1 else per_run, "rows": rows,
           "emulated": {"decode_ms": args.decode_ms, "prefill_ms_per_token": args.prefill_ms_per_token,
                        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                        "kv_sessions": args.kv_sessions, "slots": args.slots},
           "load": {"steady_rate": args.steady_rate, "steady_s": args.steady_s, "rate": args.gen_rate,
                    "burst_s": args.gen_burst_s, "retry_ms": args.retry_ms, "rejoin": args.rejoin, "recut": args.recut,
                    "room_wait_s": args.room_wait_s}}
    if len(per_run) > 1:
        out["runs_meeting_targets"] = f"{sum(met)} of {len(per_run)}"
    return out


def _steady(rows: list[dict]) -> float:
    """The steady TBT p99: the median of the rows' own (each mode's steady phase, before its scale-up)."""
    return statistics.median([r["steady_tbt_p99_ms"] for r in rows if r.get("steady_tbt_p99_ms")] or [0.0])


def gen_ratios(rows: list[dict]) -> dict[str, float]:
    """One round's live TTFT p99 over peer-fetch's and live TBT p99 over the round's steady TBT p99 (the same
    machine load: rounds differ)."""
    by, steady = {r["mode"]: r for r in rows}, _steady(rows)
    ratios = {}
    if "live" in by and "peer-fetch" in by and by["peer-fetch"]["ttft_p99_ms"]:
        ratios["live_ttft_p99_over_peer_fetch"] = round(by["live"]["ttft_p99_ms"] / by["peer-fetch"]["ttft_p99_ms"], 3)
    if "live" in by and steady and by["live"]["tbt_p99_ms"]:
        ratios["live_tbt_p99_over_steady"] = round(by["live"]["tbt_p99_ms"] / steady, 3)
    return ratios
