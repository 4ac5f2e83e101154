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
import logging
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

from quart_stage import cliargs
from quart_tools.bench import machine_info, wait_until, write_report
from quart_tools.bench.blitz import MODEL_URL, TOKEN, PeerCluster, fresh_keysmanagers, peer_cluster
from quart_tools.bench.start_phases import StartPhases

from keysmanager.registry import ModelRegistry

MODES = ("registry-cold", "peer-fetch", "multicast-4", "live", "allcache")
FUNCTION = "blitzscale-stage-0"


def build_stage(work: Path, stage_mb: int, blocks: int, service_ms: float) -> Path:
    """A one-stage model of about ``stage_mb`` MB in ``work/model`` (manifest, stage file, stack.yml)."""
    from quart_tools.partition import partition, stage_size_config

    out = work / "model"
    config = stage_size_config(stage_mb, 1, "decoder", "float32", blocks_per_stage=blocks)
    partition(config, 1, str(out), weights="random", name="blitzscale", progress=False,
              stack={"compute": "emulated", "emulated_mean_ms": service_ms})
    return out


def _deployment(namespace: str, service_ms: float, replicas: int):
    from quart_provider.deployment import FunctionDeployment

    return FunctionDeployment.from_json({
        "service": FUNCTION, "image": "quart/pipeline-stage",
        "envVars": {"QUART_MODEL_URL": MODEL_URL, "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": "emulated",
                    "QUART_EMULATED_MEAN_MS": str(service_ms), "QUART_EMULATED_CV": "0"},
        "labels": {"com.quart.model": "blitzscale", "com.quart.stage": "0", "com.quart.stages": "1",
                   "com.quart.concurrency": "1", "com.openfaas.scale.min": str(replicas),
                   "com.openfaas.scale.max": "8"}}, namespace)


async def run_mode(cluster: PeerCluster, hosts: list[str], mode: str, args: argparse.Namespace) -> dict:
    """One scale-up with its burst; the gateway and its replicas are stopped at the end."""
    from gateway_plugin.config import PluginConfig
    from gateway_plugin.plugin import GatewayView
    from gateway_plugin.router import Router
    from quart_kernel.scheduling import make_placer
    from quart_provider.config import GatewayConfig
    from quart_provider.gateway import EmbeddedGateway
    from quart_provider.keysmanager_host import KeysManagerHost

    from keysmanager.client import AsyncKeysManagerClient
    from keysmanager.types import StageSpec

    new = 4 if mode == "multicast-4" else 1
    config = GatewayConfig(port=0, state_dir=cluster.work / f"gw-{mode}", reconcile_interval_s=0.05,
                           host_timeout_s=3.0, host_down_after_s=30.0, peer_fetch=mode != "registry-cold",
                           live_scaling=mode == "live", ready_probe_s=0.002)
    km_hosts = [KeysManagerHost(h, AsyncKeysManagerClient(cluster.url(h), token=TOKEN, timeout=120), 1, 64 << 30)
                for h in hosts]
    gw = EmbeddedGateway(config, km_hosts, make_placer("first-fit"))
    await gw.start()
    view = GatewayView(gw)
    router = Router(view, gw.registry.pipelines, PluginConfig(request_timeout_s=120.0, attempt_timeout_s=60.0,
                                                     queue_cap=100_000))
    taken: dict[str, float] = {}
    inner_take = view.take

    def take(function: str, replica) -> None:  # first request each replica starts
        taken.setdefault(replica.id, time.monotonic())
        inner_take(function, replica)

    view.take = take
    phases = StartPhases()
    phases.wrap(gw.reconciler, km_hosts)
    try:
        await gw.registry.deploy(_deployment(config.namespace, args.service_ms, 1))
        fn = gw.functions[FUNCTION]
        await wait_until(lambda: len(fn.ready) == 1, 300, "the first replica")
        [first] = [e.id for e in fn.ready]  # on h0, which now holds the stage: the peers' source
        if mode == "allcache":  # the receiver holds it too: its start is a fork
            stage = StageSpec(FUNCTION, env=dict(gw.reconciler._spec(fn).env))
            await km_hosts[1].client.ensure_cached(stage, [cluster.url("h0")])
        for _ in range(3):  # warm the path
            reply = await router.invoke("blitzscale", b'{"input_ids": [[1, 2, 3, 4]]}', "application/json")
            assert reply.status == 200, reply.body[:300]
        taken.clear()
        n = max(1, round(args.rate * args.burst_s))
        phases.start()
        t0 = phases.t0
        await gw.registry.scale(FUNCTION, 1 + new)

        async def one(i: int) -> tuple[int, float]:
            await asyncio.sleep(max(0.0, t0 + i / args.rate - time.monotonic()))
            start = time.monotonic()
            reply = await router.invoke("blitzscale", b'{"input_ids": [[1, 2, 3, 4]]}', "application/json")
            return reply.status, 1000 * (time.monotonic() - start)

        burst = asyncio.gather(*(one(i) for i in range(n)))
        whole_at = await wait_until(lambda: sum(e.id != first for e in fn.ready) >= new, 600, "the new replicas")
        results = await burst
        served = [at for rid, at in taken.items() if rid != first]
        latencies = sorted(ms for status, ms in results if status == 200)
        return {"mode": mode, "ready_ms": round(1000 * (whole_at - t0), 1),
                "first_served_ms": round(1000 * (min(served) - t0), 1) if served else None,
                "burst_mean_ms": round(statistics.fmean(latencies), 1) if latencies else None,
                "burst_p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1)
                if latencies else None,
                "sent": n, "ok": len(latencies),
                "sources": sorted({e.source for e in fn.replicas.values() if e.id != first}),
                "phases": {**phases.summary(), "hosts": await phases.rows(km_hosts, FUNCTION, {first})}}
    finally:
        await router.close()
        await gw.close()


def measure(args: argparse.Namespace) -> dict:
    hosts = [f"h{i}" for i in range(args.hosts)]
    with peer_cluster(hosts, args.nic_gbps, f"bench-bscale-{os.getpid()}", args.registry_gbps) as cluster:
        cluster.preload, cluster.km_args = True, ("--gpus", "1")  # one replica slot a host
        model = build_stage(cluster.work, args.stage_mb, args.blocks, args.service_ms)
        ModelRegistry(MODEL_URL, endpoint_url=cluster.endpoint).upload(model)
        stage_bytes = (model / "stage-0.safetensors").stat().st_size
        shutil.rmtree(model)  # the registry holds it now; keep host memory for the hosts' copies
        rows = []
        fresh_keysmanagers(cluster, hosts, warm=True)
        for mode in [m for m in MODES if m in args.modes]:
            # h0 keeps the stage it cached in the first mode: every mode's source. Nothing held on the others, but
            # their preloaders warm (torch and the model code imported), as on hosts that have been up a while
            fresh_keysmanagers(cluster, hosts[1:], warm=True)
            rows.append(asyncio.run(run_mode(cluster, hosts, mode, args)))
            print(rows[-1], flush=True)
    return {"nic_gbps": args.nic_gbps, "registry_gbps": args.registry_gbps, "stage_bytes": stage_bytes, "service_ms": args.service_ms,
            "rate": args.rate, "burst_s": args.burst_s, "hosts": args.hosts, "blocks": args.blocks, "rows": rows}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench blitzscale", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON here (default stdout)")
    p.add_argument("--stage-mb", type=int, default=1024, help="stage size, MB (default 1024)")
    p.add_argument("--blocks", type=int, default=16, help="transformer blocks in the stage (default 16)")
    p.add_argument("--nic-gbps", type=float, default=2.0, help="each host's NIC limit (default 2)")
    p.add_argument("--registry-gbps", type=float, default=0.5,
                   help="the registry's link (default 0.5: storage slower than the fabric; 0 = the bridge, unlimited)")
    p.add_argument("--hosts", type=int, default=5, help="hosts: h0 holds the stage, 4 receive (default 5)")
    p.add_argument("--service-ms", type=float, default=100.0, help="emulated service time of the whole stage")
    p.add_argument("--rate", type=float, default=16.0, help="burst arrival rate, req/s (default 16)")
    p.add_argument("--burst-s", type=float, default=6.0, help="burst length, s (default 6)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--verbose", action="store_true", help="log the gateway's decisions")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the registry's access log
    if args.hosts < 5 and "multicast-4" in args.modes:
        p.error("multicast-4 needs --hosts 5 (a holder and four receivers)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`, kill: still remove the namespaces
    doc = measure(args)
    doc["machine"] = machine_info(load_avg_1m_at_start=round(os.getloadavg()[0], 2), compute="emulated")
    doc["command"] = "quartctl bench blitzscale " + " ".join(argv)
    write_report(doc, args.out)
    return 0
