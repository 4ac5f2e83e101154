"""`quartctl bench paraserve [--out FILE]`: a cold stage fetched in P parts on P hosts at once (ParaServe, issue 17).

Hosts are network namespaces with tbf-limited NICs (``--nic-gbps``), a KeysManager on each (TCP, the cluster's
token, one replica slot); the model registry (moto's S3 server, its own process, objects kept in memory) is in
a namespace of its own behind a link of ``--registry-gbps`` (default: the largest P × one NIC), so each
host's NIC, not the registry's link, is the limit (ParaServe's setting). moto answers a ranged GET by reading
the whole object first: a cost per read that a real object store does not have, so a part start makes few
reads (``keysmanager.parts``). The stage is the one stage of a model built
from a config (``--stage-mb`` of real safetensors, ``--blocks`` blocks, random weights) with *emulated* compute
(``--service-ms`` for the whole stage, scaled by the share of parameters run), as ``bench blitzscale``.

The embedded gateway (reconciler, placer, pipeline router) runs in this process. Each row is one cold start of
the stage (no host holds it; fresh KeysManagers) by the gateway, with requests arriving from that moment
(``--rate`` req/s for ``--burst-s`` s):

- P = 1: the ordinary cold start (the whole file from the registry, then the zygote, then the replica);
- P = 2, 4: ``paraserve`` with ``paraserve_parts = P``: part i on host i, served as a sub-pipeline at once,
  then each worker fetches the rest and becomes whole; the helpers drain (``desired`` is 1).

Row: ``first_served_ms`` (cold start → the first request answered), ``consolidated_ms`` (→ every worker whole;
P = 1: the replica ready), ``lost`` (requests not answered 200); ``started_ms`` / ``serving_ms`` /
``all_serving_ms``: → the first start answered / the first replica routable / every worker routable. ``single_host_cold_ms`` is P = 1's first
answer. The SLO run: ``--slo-runs`` more cold starts with P chosen by the gateway
(``plan_parallelism``, ``paraserve_slo_ms = --slo-ms``, its fixed cost calibrated from the rows), and the share
whose first answer met the SLO. Every namespace, process and file is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import sys
import time

from quart_tools.bench import machine_info, wait_until, write_report
from quart_tools.bench.blitz import MODEL_URL, TOKEN, PeerCluster, fresh_keysmanagers, peer_cluster
from quart_tools.bench.blitzscale import build_stage

from keysmanager.registry import ModelRegistry

FUNCTION = "paraserve-stage-0"
MODEL = "blitzscale"  # the model name build_stage gives


def _deployment(namespace: str, service_ms: float):
    from quart_provider.deployment import FunctionDeployment

    return FunctionDeployment.from_json({
        "service": FUNCTION, "image": "quart/pipeline-stage",
        "envVars": {"QUART_MODEL_URL": MODEL_URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "emulated",
                    "QUART_EMULATED_MEAN_MS": str(service_ms), "QUART_EMULATED_CV": "0"},
        "labels": {"com.quart.model": MODEL, "com.quart.stage": "0", "com.quart.stages": "1",
                   "com.quart.concurrency": "1", "com.openfaas.scale.min": "1", "com.openfaas.scale.max": "1"}},
        namespace)


async def cold_start(cluster: PeerCluster, hosts: list[str], parts: int, args: argparse.Namespace,
                     slo_ms: float = 0.0, fixed_s: float = 1.0) -> dict:
    """One cold start of the stage with its burst; the gateway and its replicas are stopped at the end.
    ``parts`` 0: the gateway chooses P for ``slo_ms``."""
    from gateway_plugin.config import PluginConfig
    from gateway_plugin.plugin import GatewayView
    from gateway_plugin.router import Router
    from quart_provider.config import GatewayConfig
    from quart_provider.gateway import EmbeddedGateway
    from quart_provider.keysmanager_host import KeysManagerHost
    from quart_provider.scheduling import make_placer

    from keysmanager.client import AsyncKeysManagerClient

    config = GatewayConfig(port=0, state_dir=cluster.work / f"gw-{parts}-{time.monotonic_ns()}",
                           reconcile_interval_s=0.05, host_timeout_s=3.0, host_down_after_s=30.0, peer_fetch=False,
                           ready_probe_s=0.002, nic_gbps=args.nic_gbps, registry_gbps=args.registry_gbps,
                           paraserve=parts != 1, paraserve_parts=max(0, parts), paraserve_slo_ms=slo_ms,
                           paraserve_fixed_s=fixed_s, paraserve_max_parts=len(hosts))
    km_hosts = [KeysManagerHost(h, AsyncKeysManagerClient(cluster.url(h), token=TOKEN, timeout=300), 1, 64 << 30)
                for h in hosts]
    gw = EmbeddedGateway(config, km_hosts, make_placer("first-fit"))
    await gw.start()
    router = Router(GatewayView(gw), gw.pipelines, PluginConfig(request_timeout_s=300.0, attempt_timeout_s=120.0,
                                                                queue_cap=100_000))
    try:
        n = max(1, round(args.rate * args.burst_s))
        t0 = time.monotonic()
        await gw.deploy(_deployment(config.namespace, args.service_ms))

        async def one(i: int) -> tuple[int, float]:
            await asyncio.sleep(max(0.0, t0 + i / args.rate - time.monotonic()))
            reply = await router.invoke(MODEL, b'{"input_ids": [[1, 2, 3, 4]]}', "application/json")
            return reply.status, time.monotonic() - t0

        burst = asyncio.gather(*(one(i) for i in range(n)))
        fn = gw.functions[FUNCTION]
        paraserve = gw.reconciler.paraserve
        marks: dict[str, float] = {}

        async def watch() -> None:  # when the first start answered, and the first replica served (part or whole)
            while True:
                if fn.replicas:
                    marks.setdefault("started_ms", round(1000 * (time.monotonic() - t0), 1))
                if fn.ready or fn.partial:
                    marks.setdefault("serving_ms", round(1000 * (time.monotonic() - t0), 1))
                groups = paraserve.history
                if groups and len(fn.ready) + len(fn.partial) >= len(groups[0].hosts):  # every worker routable
                    marks.setdefault("all_serving_ms", round(1000 * (time.monotonic() - t0), 1))
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        paraserve = gw.reconciler.paraserve
        consolidated = await wait_until(lambda: not fn.pending_starts and not paraserve.groups.get(FUNCTION)
                                    and len(fn.ready) >= 1 and not fn.partial, 900, "consolidation")
        results = await burst
        await wait_until(lambda: len(fn.replicas) == 1, 120, "the helpers to drain")
        watcher.cancel()
        done = sorted(at for status, at in results if status == 200)
        chosen = [p for f, p in paraserve.chosen if f == FUNCTION] or [1]
        return {"P": chosen[0], "first_served_ms": round(1000 * done[0], 1) if done else None,
                "consolidated_ms": round(1000 * (consolidated - t0), 1), "lost": n - len(done), "sent": n,
                "statuses": sorted({s for s, _ in results}), **marks}
    finally:
        await router.close()
        await gw.close()


def calibrate_fixed_s(rows: list[dict], stage_bytes: int, nic_bytes_s: float) -> float:
    """The worker's fixed cost the planner adds to a part's fetch (``paraserve_fixed_s``, overlapped with the
    fetch): the largest (first answer − part fetch at the NIC rate) over the rows, so predictions are not
    optimistic."""
    return max(row["first_served_ms"] / 1000 - stage_bytes / row["P"] / nic_bytes_s for row in rows
               if row["first_served_ms"] is not None)


def measure(args: argparse.Namespace) -> dict:
    hosts = [f"h{i}" for i in range(args.hosts)]
    args.registry_gbps = args.registry_gbps or args.nic_gbps * max(args.parts)
    os.environ["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(8 << 30)  # the registry process keeps objects in memory
    with peer_cluster(hosts, args.nic_gbps, f"bench-para-{os.getpid()}", args.registry_gbps) as cluster:
        cluster.preload, cluster.km_args = True, ("--gpus", "1")  # one replica slot a host
        model = build_stage(cluster.work, args.stage_mb, args.blocks, args.service_ms)
        ModelRegistry(MODEL_URL, endpoint_url=cluster.endpoint).upload(model)
        stage_bytes = (model / "stage-0.safetensors").stat().st_size
        shutil.rmtree(model)
        os.environ["QUART_REGISTRY_ENDPOINT"] = cluster.endpoint  # the gateway reads the manifest (the layout)
        rows = []
        for parts in args.parts:
            fresh_keysmanagers(cluster, hosts, preloader=True)
            rows.append(asyncio.run(cold_start(cluster, hosts, parts, args)))
            print(rows[-1], flush=True)
        single = next((r["first_served_ms"] for r in rows if r["P"] == 1), None)
        nic = args.nic_gbps * 1e9 / 8
        fixed = calibrate_fixed_s(rows, stage_bytes, nic)
        slo_ms = args.slo_ms or round(0.5 * (single or rows[0]["first_served_ms"]), 0)
        runs = []
        for _ in range(args.slo_runs):
            fresh_keysmanagers(cluster, hosts, preloader=True)
            runs.append(asyncio.run(cold_start(cluster, hosts, 0, args, slo_ms, fixed)))
            print(runs[-1], flush=True)
    met = sum(1 for r in runs if r["first_served_ms"] is not None and r["first_served_ms"] <= slo_ms)
    return {"nic_gbps": args.nic_gbps, "registry_gbps": args.registry_gbps, "stage_bytes": stage_bytes,
            "single_host_cold_ms": single, "rows": rows,
            "slo_run": {"slo_ms": slo_ms, "chosen_P": sorted({r["P"] for r in runs}), "cold_starts": len(runs),
                        "attainment": round(met / len(runs), 3) if runs else None, "fixed_s": round(fixed, 3),
                        "first_served_ms": [r["first_served_ms"] for r in runs],
                        "lost": sum(r["lost"] for r in runs)},
            "service_ms": args.service_ms, "rate": args.rate, "burst_s": args.burst_s, "hosts": args.hosts,
            "blocks": args.blocks}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="quartctl bench paraserve", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON here (default stdout)")
    p.add_argument("--stage-mb", type=int, default=1024, help="stage size, MB (default 1024)")
    p.add_argument("--blocks", type=int, default=16, help="transformer blocks in the stage (default 16)")
    p.add_argument("--nic-gbps", type=float, default=1.0, help="each host's NIC limit (default 1)")
    p.add_argument("--registry-gbps", type=float, default=0.0,
                   help="the registry's own link, also what the planner assumes (default: largest P x --nic-gbps)")
    p.add_argument("--hosts", type=int, default=4, help="hosts (default 4: the largest P)")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4], help="P of the rows (default 1 2 4)")
    p.add_argument("--service-ms", type=float, default=100.0, help="emulated service time of the whole stage")
    p.add_argument("--rate", type=float, default=8.0, help="arrival rate from the cold start, req/s (default 8)")
    p.add_argument("--burst-s", type=float, default=6.0, help="arrivals for this long, s (default 6)")
    p.add_argument("--slo-ms", type=float, default=0.0, help="first-answer SLO (default: 0.5 x single-host cold)")
    p.add_argument("--slo-runs", type=int, default=4, help="cold starts of the SLO run (default 4)")
    p.add_argument("--verbose", action="store_true", help="log the gateway's decisions")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if max(args.parts) > args.hosts:
        p.error("--hosts must be at least the largest of --parts")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`, kill: still remove the namespaces
    doc = measure(args)
    doc["machine"] = machine_info(load_avg_1m_at_start=round(os.getloadavg()[0], 2), compute="emulated")
    doc["command"] = "quartctl bench paraserve " + " ".join(argv)
    write_report(doc, args.out)
    return 0
