"""`quartctl bench paraserve --workload generation`: ParaServe with generation sessions (issue 29).

The cluster of `quart_tools.bench.paraserve` (netns hosts with tbf-limited NICs, a KeysManager on each, the
ranged-read registry, one decoder stage of ``--stage-mb`` real bytes with *emulated* compute): each row is one cold
start of the stage by the embedded gateway with P parts (P = 1: the ordinary cold start) while ``--sessions``
generation sessions arrive at ``--rate``/s from the cold start (prompt ``--prompt`` tokens, ``--max-tokens`` new
tokens, emulated steps: ``--decode-ms`` per decode step and ``--prefill-ms-per-token`` of the whole stage, each
part taking its share of the parameters). Every session goes through the gateway's own session engine
(`gateway_plugin.generation.sessions.SessionEngine`, what the ``/v1`` and ``/function`` doors call, wired to the
embedded gateway as the plugin wires it): while the stage has no whole replica it opens on the group's P parts
(`gateway_plugin.generation.groupsessions`: each part holds the KV cache of its own layers), else on a whole one.

When one worker of the group holds the whole stage, the engine consolidates every session onto it at its next
step (ParaServe §6.2): its KV caches are gathered there (verified) and the stream goes on with no re-prefill. Once
every worker is whole, the gateway keeps as many as the sliding-window rule says (its desired count; ``kept``)
and drains the others. Then the same prompts run again as fresh sessions on whole workers, all at once: their
tokens are the reference (``identical``) and their TPOT is ``tpot_whole_ms``; ``tpot_after_ms`` is the moved
sessions' time per token after their first token on the whole worker (p50 over sessions). ``wrong``: tokens that
differ from the emulation's own function of (seed, ids) (`quart_stage.kvmigrate.EmulatedKV`). The SLO run: ``--slo-runs`` cold starts with P
chosen by the gateway's generation planner (`plan_generation`, TTFT SLO ``--ttft-slo-ms``, default 0.5 ×
single-host cold TTFT; TPOT SLO ``--tpot-slo-ms``, default 2 × P = 1's TPOT) calibrated from the rows.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

from quart_tools.bench.blitz import PeerCluster, fresh_keysmanagers
from quart_tools.bench.paraserve_calib import FUNCTION

MODEL = "blitzscale"  # the model name build_stage gives


def _deployment(namespace: str, args: argparse.Namespace):
    from quart_provider.deployment import FunctionDeployment
    from quart_tools.bench.blitz import MODEL_URL

    return FunctionDeployment.from_json({
        "service": FUNCTION, "image": "quart/pipeline-stage",
        "envVars": {"QUART_MODEL_URL": MODEL_URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "emulated",
                    "QUART_EMULATED_MEAN_MS": str(args.decode_ms), "QUART_EMULATED_CV": "0",
                    "QUART_EMULATED_DECODE_MS": str(args.decode_ms),
                    "QUART_EMULATED_PREFILL_MS_PER_TOKEN": str(args.prefill_ms_per_token)},
        "labels": {"com.quart.model": MODEL, "com.quart.stage": "0", "com.quart.stages": "1",
                   "com.quart.concurrency": "64", "com.openfaas.scale.min": "1", "com.openfaas.scale.max": "1"}},
        namespace)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The generation workload's options of `quartctl bench paraserve`."""
    add = p.add_argument_group("--workload generation (quart_tools.bench.paraserve_gen)").add_argument
    add("--workload", choices=("oneshot", "generation"), default="oneshot",
        help="one-shot passes (default) or generation sessions with KV-cache migration")
    add("--sessions", type=int, default=8, help="sessions per cold start (default 8)")
    add("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    add("--max-tokens", type=int, default=256, help="new tokens per session (default 256)")
    add("--decode-ms", type=float, default=30.0, help="emulated decode step, whole stage (default 30)")
    add("--prefill-ms-per-token", type=float, default=0.25,
        help="emulated prefill per prompt token, whole stage (default 0.25)")
    add("--ttft-slo-ms", type=float, default=0.0, help="TTFT SLO (default 0.5 x single-host cold)")
    add("--tpot-slo-ms", type=float, default=0.0, help="TPOT SLO (default 2 x P = 1's TPOT)")


def expected_tokens(prompt: list[int], seed: int, n: int, vocab: int) -> list[int]:
    """The tokens an emulated pipeline answers for ``prompt`` (the stage's own function, no network)."""
    from quart_stage.kvmigrate import EmulatedKV

    state, out, ids = EmulatedKV(seed, 1), [], list(prompt)
    for _ in range(n):
        state.ids = ids
        out.append(state.token(vocab))
        ids = ids + [out[-1]]
    return out


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def _tpot_ms(times: list[float], since: float | None = None) -> float | None:
    """Mean time per token after the first (or between the tokens after ``since``)."""
    if since is not None:
        times = [t for t in times if t >= since]
    return round(1000 * (times[-1] - times[0]) / (len(times) - 1), 2) if len(times) > 1 else None


@dataclass
class Stream:
    """One session as the bench sees it: its tokens and when each came."""

    prompt: list[int]
    seed: int
    arrived: float
    tokens: list[int] = field(default_factory=list)
    token_at: list[float] = field(default_factory=list)
    consolidated_at: float | None = None  # the first token answered by a whole worker after a move off the group
    reprefills: int = 0


async def run_stream(engine, prompt: list[int], seed: int, max_tokens: int) -> Stream:
    """One session through the gateway's session engine (the ``/v1`` and ``/function`` doors' own path)."""
    stream = Stream(prompt, seed, time.monotonic())
    session = await engine.open(MODEL, [FUNCTION], prompt, max_tokens, {"seed": seed}, frozenset())
    chained = False  # whether the session ran on the group's parts at its last token
    async for token in engine.tokens(session):
        stream.tokens.append(token)
        stream.token_at.append(time.monotonic())
        if chained and not session.chains and stream.consolidated_at is None:
            stream.consolidated_at = stream.token_at[-1]
        chained = bool(session.chains)
    stream.reprefills = session.reprefills
    return stream


async def cold_start(cluster: PeerCluster, hosts: list[str], parts: int, args: argparse.Namespace,
                     gen_config: dict | None = None) -> dict:
    """One cold start with its sessions; ``parts`` 0: the gateway's generation planner chooses P."""
    from gateway_plugin.generation.config import GenerationConfig
    from gateway_plugin.generation.sessions import SessionEngine
    from gateway_plugin.plugin import GatewayView
    from quart_kernel.scheduling import make_placer
    from quart_provider.config import GatewayConfig
    from quart_provider.gateway import EmbeddedGateway
    from quart_provider.keysmanager_host import KeysManagerHost
    from quart_tools.bench.blitz import TOKEN
    from quart_tools.bench.paraserve_calib import part_bytes, worker_timelines

    from keysmanager.client import AsyncKeysManagerClient

    config = GatewayConfig(port=0, state_dir=cluster.work / f"gwgen-{parts}-{time.monotonic_ns()}",
                           reconcile_interval_s=0.05, host_timeout_s=3.0, host_down_after_s=30.0, peer_fetch=False,
                           ready_probe_s=0.002, nic_gbps=args.nic_gbps, registry_gbps=args.registry_gbps,
                           paraserve=parts != 1, paraserve_parts=max(0, parts), paraserve_max_parts=len(hosts),
                           **(gen_config or {}))
    km_hosts = [KeysManagerHost(h, AsyncKeysManagerClient(cluster.url(h), token=TOKEN, timeout=300), 1, 64 << 30)
                for h in hosts]
    gw = EmbeddedGateway(config, km_hosts, make_placer("first-fit"))
    await gw.start()
    engine = SessionEngine(GatewayView(gw), GenerationConfig(replica_wait_s=600.0, step_timeout_s=120.0))
    gw.watch_sessions(engine.book.booked)  # as the plugin wires it: drains wait for sessions, groups keep workers
    gw.watch_demand(engine.group_chains.demand)
    rng = random.Random(parts)
    try:
        paraserve = gw.reconciler.paraserve
        t0, t0_wall = time.monotonic(), time.time()
        await gw.registry.deploy(_deployment(config.namespace, args))
        fn = gw.functions[FUNCTION]

        async def one(i: int) -> Stream:
            await asyncio.sleep(max(0.0, t0 + i / args.rate - time.monotonic()))
            prompt = [rng.randrange(args.vocab) for _ in range(args.prompt)]
            return await run_stream(engine, prompt, rng.getrandbits(62), args.max_tokens)

        done = await asyncio.gather(*(one(i) for i in range(args.sessions)), return_exceptions=True)
        ok = [s for s in done if isinstance(s, Stream)]
        row = {"P": (paraserve.chosen[0][1] if paraserve.chosen else 1),
               "sessions": args.sessions, "lost": args.sessions - len(ok),
               "errors": sorted({f"{type(e).__name__}: {e}"[:200] for e in done if not isinstance(e, Stream)}),
               "wrong": sum(1 for s in ok if s.tokens != expected_tokens(s.prompt, s.seed, args.max_tokens, args.vocab)),
               "first_token_ms": round(1000 * (min(s.token_at[0] for s in ok) - t0), 1) if ok else None}
        ttft = [1000 * (s.token_at[0] - s.arrived) for s in ok]
        row.update(ttft_p50_ms=_pct(ttft, 0.5), ttft_p99_ms=_pct(ttft, 0.99), ttft_ms=[round(x, 1) for x in ttft],
                   tpot_p50_ms=_pct([_tpot_ms(s.token_at) for s in ok if len(s.token_at) > 1], 0.5))
        row["session_tpot_ms"] = [_tpot_ms(s.token_at) for s in ok]
        row["first_served_ms"] = row["first_token_ms"]
        row["workers"] = await worker_timelines(cluster, hosts, t0_wall, {}, part_bytes(paraserve))
        row["kept"] = [n for f, n in paraserve.kept if f == FUNCTION]
        if row["P"] > 1:
            row["consolidation"] = await _after(engine, fn, ok, args)
        return row
    finally:
        await engine.close()
        await gw.close()


async def _after(engine, fn, ok: list[Stream], args: argparse.Namespace) -> dict:
    """The consolidation's figures: the streams that moved off the group, and the same prompts again as fresh
    sessions on whole workers (the reference tokens, ``tpot_whole_ms``)."""
    moved = [s for s in ok if s.consolidated_at is not None]
    again = await asyncio.gather(*(run_stream(engine, s.prompt, s.seed, args.max_tokens) for s in moved))
    after = [_tpot_ms(s.token_at, s.consolidated_at) for s in moved]
    return {"streams": len(moved), "completed": sum(1 for s in moved if len(s.tokens) == args.max_tokens),
            "identical": sum(1 for s, r in zip(moved, again, strict=True) if s.tokens == r.tokens),
            "reprefills": sum(s.reprefills for s in ok), "migrated": engine.group_chains.migrations,
            "kv_bytes": engine.group_chains.kv_moved_bytes, "migration_ms": round(1000 * engine.group_chains.migration_s, 1),
            "tpot_after_ms": _pct([x for x in after if x is not None], 0.5),
            "tpot_whole_ms": _pct([_tpot_ms(s.token_at) for s in again], 0.5),
            "whole_workers_at_end": len(fn.ready)}


def measure(args: argparse.Namespace, cluster: PeerCluster, hosts: list[str], layer_bytes: list[int]) -> dict:
    """The rows, the consolidation of the largest P, the SLO run."""
    from quart_tools.bench.paraserve_calib import calibrate

    rows = []
    for parts in args.parts:
        fresh_keysmanagers(cluster, hosts, preloader=True)
        rows.append(asyncio.run(cold_start(cluster, hosts, parts, args)))
        print({k: v for k, v in rows[-1].items() if k not in ("workers", "ttft_ms")}, flush=True)
    single = next(r for r in rows if r["P"] == 1)
    cal = calibrate(rows, sum(layer_bytes))
    whole_tpot = single["tpot_p50_ms"]
    widest = max(rows, key=lambda r: r["P"])
    hop_ms = max(0.0, (widest["tpot_p50_ms"] - whole_tpot) / max(1, widest["P"] - 1))
    ttft_slo = args.ttft_slo_ms or round(0.5 * single["ttft_p50_ms"], 0)
    tpot_slo = args.tpot_slo_ms or round(2 * whole_tpot, 1)
    gen_config = {"paraserve_slo_ms": ttft_slo, "paraserve_tpot_slo_ms": tpot_slo,
                  "paraserve_decode_ms": whole_tpot, "paraserve_hop_ms": hop_ms, "paraserve_prefill_ms": 0.0,
                  "paraserve_fixed_s": cal.fixed_s, "paraserve_tail_s": cal.tail_s,
                  "paraserve_fetch_gbps": 8 * cal.fetch_bytes_s / 1e9}
    runs = []
    for _ in range(args.slo_runs):
        fresh_keysmanagers(cluster, hosts, preloader=True)
        runs.append(asyncio.run(cold_start(cluster, hosts, 0, args, gen_config)))
        print({k: v for k, v in runs[-1].items() if k not in ("workers", "ttft_ms")}, flush=True)
    ttfts = [t for r in runs for t in r["ttft_ms"]]
    tpots = [r.get("consolidation", {}) for r in runs]
    session_tpots = [r["tpot_p50_ms"] for r in runs]
    return {
        "single_host_cold_ttft_ms": single["ttft_p50_ms"],
        "rows": [{k: v for k, v in r.items() if k != "consolidation"} for r in rows],
        "consolidation": widest.get("consolidation"),
        "slo_run": {"chosen_P": sorted({r["P"] for r in runs}), "ttft_slo_ms": ttft_slo, "tpot_slo_ms": tpot_slo,
                    "ttft_attainment": round(sum(1 for t in ttfts if t <= ttft_slo) / len(ttfts), 3) if ttfts else None,
                    "tpot_attainment": _tpot_attainment(runs, tpot_slo),
                    "calibration": {**{k: round(v, 3) for k, v in gen_config.items() if isinstance(v, float)}},
                    "lost": sum(r["lost"] for r in runs), "wrong": sum(r["wrong"] for r in runs),
                    "runs": runs, "consolidations": tpots, "tpot_p50_ms": session_tpots},
    }


def _tpot_attainment(runs: list[dict], slo_ms: float) -> float | None:
    per_session = [t for r in runs for t in r.get("session_tpot_ms", [])]
    return round(sum(1 for t in per_session if t <= slo_ms) / len(per_session), 3) if per_session else None
