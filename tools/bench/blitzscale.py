"""`quartctl bench blitzscale [--out FILE]`: one stage scaled up onto hosts that do not hold it (BlitzScale).

Hosts are network namespaces with tbf-limited NICs (``--nic-gbps``), a KeysManager on each (TCP, the
cluster's token), the model registry (moto's S3 server) in a namespace of its own behind a slower link
(``--registry-gbps``: storage slower than the fabric, as BlitzScale's SSDs and remote storage are). The stage is the one stage of a
model built from a config (``--stage-mb`` of real safetensors, ``--blocks`` transformer blocks, random
weights) with *emulated* compute: each request sleeps ``--service-ms`` for the whole stage, scaled by the
share of the stage's parameters in the layers run (so a replica running half the layers takes half).

The embedded gateway (the reconciler, the placer, the pipeline router) runs in this process; one replica
serves on ``h0``, which holds the stage. At t = 0 the stage is scaled up by one replica (four for
``multicast-4``) onto hosts without it, and the same burst starts (``--rate`` req/s for ``--burst-s`` s,
evenly spaced), in every mode:

- ``registry-cold``: the new host fetches the stage from the registry (peer fetch off);
- ``peer-fetch``: from ``h0`` over the network, then forks;
- ``multicast-4``: four hosts at once, in a chain from ``h0`` (ready = the last of the four);
- ``live``: peer fetch, and the new replica serves the layers that have arrived while the rest load
  (the router runs the rest of each request's layers on ``h0``'s replica);
- ``allcache``: the new host already holds the stage (a fork; the reference).

Row: ``ready_ms`` (scale-up to the new replica(s) serving the whole stage), ``first_served_ms`` (to the
first request a new replica starts), ``burst_mean_ms`` / ``burst_p99_ms`` (the burst's latencies),
``ok`` / ``sent``. Every namespace, process and file is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from quart_provider.config import DEFAULT_NAMESPACE
from quart_stage import cliargs
from quart_tools.bench import blitzscale_gen, machine_info, write_report
from quart_tools.bench.blitz import MODEL_URL, PeerCluster, fresh_keysmanagers, peer_cluster
from quart_tools.bench.blitzscale_gateway import deployment, percentile, scaled_gateway

from keysmanager.registry import ModelRegistry

MODES = ("registry-cold", "peer-fetch", "multicast-4", "live", "allcache")


def build_stage(work: Path, stage_mb: int, blocks: int, service_ms: float) -> Path:
    """A one-stage model of about ``stage_mb`` MB in ``work/model`` (manifest, stage file, stack.yml)."""
    from quart_tools.partition import partition, stage_size_config

    out = work / "model"
    config = stage_size_config(stage_mb, 1, "decoder", "float32", blocks_per_stage=blocks)
    partition(config, 1, str(out), weights="random", name="blitzscale", progress=False,
              stack={"compute": "emulated", "emulated_mean_ms": service_ms})
    return out


async def run_mode(cluster: PeerCluster, hosts: list[str], mode: str, args: argparse.Namespace) -> dict:
    """One scale-up with its burst of one-shot requests; the gateway and its replicas are stopped at the end."""
    from gateway_plugin.config import PluginConfig
    from gateway_plugin.router import Router

    async with scaled_gateway(cluster, hosts, mode, deployment(DEFAULT_NAMESPACE, args.service_ms, 1)) as g:
        router = Router(g.view, g.gw.registry.pipelines, PluginConfig(request_timeout_s=120.0, attempt_timeout_s=60.0,
                                                             queue_cap=100_000))
        try:
            for _ in range(3):  # warm the path
                reply = await router.invoke("blitzscale", b'{"input_ids": [[1, 2, 3, 4]]}', "application/json")
                assert reply.status == 200, reply.body[:300]
            n = max(1, round(args.rate * args.burst_s))
            cpu_before = cluster.cpu_s(hosts[1:])
            t0 = await g.scale_up()

            async def one(i: int) -> tuple[int, float]:
                await asyncio.sleep(max(0.0, t0 + i / args.rate - time.monotonic()))
                start = time.monotonic()
                reply = await router.invoke("blitzscale", b'{"input_ids": [[1, 2, 3, 4]]}', "application/json")
                return reply.status, 1000 * (time.monotonic() - start)

            burst = asyncio.gather(*(one(i) for i in range(n)))
            whole_at = await g.whole()
            cpu = receiver_cpu(cpu_before, cluster.cpu_s(hosts[1:]), args.stage_bytes)
            results = await burst
            latencies = sorted(ms for status, ms in results if status == 200)
            return {"mode": mode, "ready_ms": round(1000 * (whole_at - t0), 1), "first_served_ms": g.first_served_ms(),
                    "burst_mean_ms": round(statistics.fmean(latencies), 1) if latencies else None,
                    "burst_p99_ms": percentile(latencies, 0.99), "sent": n, "ok": len(latencies), **cpu,
                    **await g.row()}
        finally:
            await router.close()


def receiver_cpu(before: dict[str, float], after: dict[str, float], stage_bytes: int) -> dict:
    """The KeysManager CPU seconds of each host that received the stage (used > 0.2 s between scale-up and whole:
    the others idled), and per GB received: a receiver's transfer, hashing and, inside a chain, forwarding."""
    used = {h: round(after[h] - before[h], 2) for h in after if h in before and after[h] - before[h] > 0.2}
    per_gb = [v / (stage_bytes / 1e9) for v in used.values()]
    return {"receiver_cpu_s": used, "receiver_cpu_s_per_gb": round(statistics.fmean(per_gb), 2) if per_gb else None}


def round_order(modes: list[str], run: int) -> list[str]:
    """The modes of round ``run``: in order on even rounds, reversed on odd ones (no mode always runs first, on
    the coldest hosts, or always right after another)."""
    ordered = [m for m in MODES if m in modes]
    return ordered if run % 2 == 0 else ordered[::-1]


def measure(args: argparse.Namespace) -> dict:
    hosts = [f"h{i}" for i in range(args.hosts)]
    with peer_cluster(hosts, args.nic_gbps, f"bench-bscale-{os.getpid()}", args.registry_gbps) as cluster:
        model = build_stage(cluster.work, args.stage_mb, args.blocks, args.service_ms)
        stage_bytes = args.stage_bytes = (model / "stage-0.safetensors").stat().st_size
        landing_mb = -(-stage_bytes >> 20) if args.landing_mb is None else args.landing_mb  # default: the stage
        # one replica slot a host; a landing reserve as large as the stage (keysmanager.landing)
        cluster.preload, cluster.km_args = True, ("--gpus", "1", "--landing-mb", str(landing_mb))
        ModelRegistry(MODEL_URL, endpoint_url=cluster.endpoint).upload(model)
        vocab = int(json.loads((model / "manifest.json").read_text())["config"]["vocab_size"])
        shutil.rmtree(model)  # the registry holds it now; keep host memory for the hosts' copies
        rows = []
        fresh_keysmanagers(cluster, hosts, warm=True)
        for run, mode in [(r, m) for r in range(args.runs) for m in round_order(args.modes, r)]:
            # h0 keeps the stage it cached in the first mode: every mode's source. Nothing held on the others, but
            # their preloaders warm (torch and the model code imported), as on hosts that have been up a while
            fresh_keysmanagers(cluster, hosts[1:], warm=True)
            if args.workload == "generation":
                rows.append(asyncio.run(blitzscale_gen.run_generation(cluster, hosts, mode, args, vocab)))
            else:
                rows.append(asyncio.run(run_mode(cluster, hosts, mode, args)))
            rows[-1]["run"] = run
            print({k: v for k, v in rows[-1].items() if k != "phases"}, flush=True)
    doc = {"nic_gbps": args.nic_gbps, "registry_gbps": args.registry_gbps, "stage_bytes": stage_bytes,
           "hosts": args.hosts, "blocks": args.blocks, "landing_mb": landing_mb}
    if args.workload == "generation":
        return doc | blitzscale_gen.report(rows, args)
    return doc | {"service_ms": args.service_ms, "rate": args.rate, "burst_s": args.burst_s, "rows": rows,
                  **runs_report(rows, args.runs)}


def runs_report(rows: list[dict], runs: int) -> dict:
    """The ratios of each run (consecutive rounds of the modes) and how many met both one-shot targets."""
    per_run = [oneshot_ratios([r for r in rows if r["run"] == i]) for i in range(runs)]
    met = [x.get("multicast4_ready_over_peer_fetch", 0) <= 1.3 and x.get("live_burst_p99_over_peer_fetch", 0) <= 0.6
           for x in per_run]
    out = {"ratios": per_run[0] if runs == 1 else per_run}
    if runs > 1:
        out["runs_meeting_targets"] = f"{sum(met)} of {runs}"
    return out


def oneshot_ratios(rows: list[dict]) -> dict[str, float]:
    """The acceptance ratios of a one-shot run: multicast-4 ready and live burst p99 over peer-fetch's."""
    by = {r["mode"]: r for r in rows}
    peer = by.get("peer-fetch")
    out = {}
    if peer and "multicast-4" in by:
        out["multicast4_ready_over_peer_fetch"] = round(by["multicast-4"]["ready_ms"] / peer["ready_ms"], 3)
    if peer and "live" in by and peer["burst_p99_ms"]:
        out["live_burst_p99_over_peer_fetch"] = round(by["live"]["burst_p99_ms"] / peer["burst_p99_ms"], 3)
    if peer and "registry-cold" in by:
        out["peer_fetch_ready_over_registry_cold"] = round(peer["ready_ms"] / by["registry-cold"]["ready_ms"], 3)
    return out


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench blitzscale", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON here (default stdout)")
    p.add_argument("--workload", default="oneshot", choices=("oneshot", "generation"),
                   help="one-shot requests (default) or generation sessions (TTFT, TBT: blitzscale_gen)")
    p.add_argument("--stage-mb", type=int, default=1024, help="stage size, MB (default 1024)")
    p.add_argument("--blocks", type=int, default=16, help="transformer blocks in the stage (default 16)")
    p.add_argument("--nic-gbps", type=float, default=2.0, help="each host's NIC limit (default 2)")
    p.add_argument("--registry-gbps", type=float, default=0.5,
                   help="the registry's link (default 0.5: storage slower than the fabric; 0 = the bridge, unlimited)")
    p.add_argument("--hosts", type=int, default=5, help="hosts: h0 holds the stage, 4 receive (default 5)")
    p.add_argument("--service-ms", type=float, default=100.0, help="emulated service time of the whole stage")
    p.add_argument("--rate", type=float, default=16.0, help="burst arrival rate, req/s (default 16)")
    p.add_argument("--burst-s", type=float, default=6.0, help="burst length, s (default 6)")
    p.add_argument("--modes", nargs="+", default=[list(MODES)], type=_modes,
                   help=f"modes, space- or comma-separated (default all: {','.join(MODES)})")
    p.add_argument("--runs", type=int, default=1,
                   help="consecutive rounds of the modes on one cluster (one-shot: each round's ratios and how many "
                        "met multicast-4 <= 1.3 x and live burst p99 <= 0.6 x peer-fetch's)")
    p.add_argument("--landing-mb", type=int, default=None,
                   help="each KeysManager's landing reserve, MiB (default: the stage's size; 0 = none)")
    p.add_argument("--verbose", action="store_true", help="log the gateway's decisions")
    blitzscale_gen.add_arguments(p)
    args = p.parse_args(argv)
    args.modes = [m for group in args.modes for m in group]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the registry's access log
    if args.hosts < 5 and "multicast-4" in args.modes:
        p.error("multicast-4 needs --hosts 5 (a holder and four receivers)")
    load_at_start = round(os.getloadavg()[0], 2)
    doc = measure(args)
    doc["machine"] = machine_info(load_avg_1m_at_start=load_at_start, compute="emulated")
    doc["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    doc["command"] = "quartctl bench blitzscale " + " ".join(argv)
    print("ratios:", json.dumps(doc["ratios"]), doc.get("runs_meeting_targets", ""), f"(load {doc['machine']['load_avg_1m_at_start']} -> "
          f"{doc['machine']['load_avg_1m_at_end']})", file=sys.stderr, flush=True)
    write_report(doc, args.out)
    return 0


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(bad)}: choose from {', '.join(MODES)}")
    return modes
