"""`quartctl bench paraserve [--out FILE]`: a cold stage fetched in P parts on P hosts at once (ParaServe, issue 17).

Hosts are network namespaces with tbf-limited NICs (``--nic-gbps``), a KeysManager on each (TCP, the cluster's
token, one replica slot); the model registry is in a namespace of its own behind a link of ``--registry-gbps``
(default: the largest P × one NIC), so each host's NIC, not the registry, is the limit (ParaServe's setting).
The registry (``--registry``) is ``files`` (``quart_tools.bench.s3files``: S3's GetObject with ``Range`` over
a folder, bytes by sendfile — an object store that serves a ranged read without reading the whole object) or
``moto`` (its S3 server reads the whole object for every GET: ~2 s per read of a 1 GB object, serialized in
one Python process, which made the last of four part workers 8 s late). The stage is the one stage of a model
built from a config (``--stage-mb`` of real safetensors, ``--blocks`` blocks, random weights) with *emulated*
compute (``--service-ms`` for the whole stage, scaled by the share of parameters run), as ``bench blitzscale``.

The embedded gateway (reconciler, placer, pipeline router) runs in this process. Each row is one cold start of
the stage (no host holds it; fresh KeysManagers) by the gateway, with requests arriving from that moment
(``--rate`` req/s for ``--burst-s`` s):

- P = 1: the ordinary cold start (the whole file from the registry, then the zygote, then the replica);
- P = 2, 4: ``paraserve`` with ``paraserve_parts = P``: part i on host i, served as a sub-pipeline at once,
  then each worker fetches the rest and becomes whole; the helpers drain (``desired`` is 1).

Row: ``first_served_ms`` (cold start → the first request answered), ``consolidated_ms`` (→ every worker whole;
P = 1: the replica ready), ``lost`` (requests not answered 200), ``wrong`` (answers whose tensors differ from
the whole stage's answer to the same input, asked of the one replica left at the end); ``started_ms`` /
``serving_ms`` / ``all_serving_ms``: → the first start answered / the first replica routable / every worker
routable; ``workers``: per host, ms from the cold start of its KeysManager's marks (requested, fetch_begin,
first_layer, part_held, zygote_built, forked, whole) and the gateway's (answered, routable, whole_routable),
and its ``part_bytes``. ``single_host_cold_ms`` is P = 1's first answer. The SLO run: ``--slo-runs`` more cold
starts with P chosen by the gateway (``plan_parallelism`` for ``paraserve_slo_ms = --slo-ms``), its planner
calibrated from this run's rows (``calibrate``: the slowest worker's part-fetch rate, the slowest worker's start
besides its fetch, and the largest tail to the first answer, so no row is predicted faster than it ran), and
the share whose first answer met the SLO. Every namespace, process and file is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import time

from quart_stage import cliargs
from quart_tools.bench import machine_info, paraserve_gen, wait_until, write_report
from quart_tools.bench.blitz import MODEL_URL, TOKEN, PeerCluster, fresh_keysmanagers, peer_cluster
from quart_tools.bench.blitzscale import build_stage
from quart_tools.bench.paraserve_calib import (  # noqa: F401 - Calibration, predictions: the tests' names
    FUNCTION,
    Calibration,
    calibrate,
    part_bytes,
    predictions,
    worker_timelines,
)

from keysmanager.registry import ModelRegistry, parse_model_url

MODEL = "blitzscale"  # the model name build_stage gives
INPUT = b'{"input_ids": [[1, 2, 3, 4]]}'


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
                     slo_ms: float = 0.0, cal: Calibration | None = None) -> dict:
    """One cold start of the stage with its burst; the gateway and its replicas are stopped at the end.
    ``parts`` 0: the gateway chooses P for ``slo_ms``."""
    from gateway_plugin.config import PluginConfig
    from gateway_plugin.plugin import GatewayView
    from gateway_plugin.router import Router
    from quart_kernel.scheduling import make_placer
    from quart_provider.config import GatewayConfig
    from quart_provider.gateway import EmbeddedGateway
    from quart_provider.keysmanager_host import KeysManagerHost

    from keysmanager.client import AsyncKeysManagerClient

    config = GatewayConfig(port=0, state_dir=cluster.work / f"gw-{parts}-{time.monotonic_ns()}",
                           reconcile_interval_s=0.05, host_timeout_s=3.0, host_down_after_s=30.0, peer_fetch=False,
                           ready_probe_s=0.002, nic_gbps=args.nic_gbps, registry_gbps=args.registry_gbps,
                           paraserve=parts != 1, paraserve_parts=max(0, parts), paraserve_slo_ms=slo_ms,
                           paraserve_max_parts=len(hosts), **({} if cal is None else {
                               "paraserve_fixed_s": cal.fixed_s, "paraserve_tail_s": cal.tail_s,
                               "paraserve_fetch_gbps": 8 * cal.fetch_bytes_s / 1e9}))
    km_hosts = [KeysManagerHost(h, AsyncKeysManagerClient(cluster.url(h), token=TOKEN, timeout=300), 1, 64 << 30)
                for h in hosts]
    gw = EmbeddedGateway(config, km_hosts, make_placer("first-fit"))
    await gw.start()
    router = Router(GatewayView(gw), gw.registry.pipelines, PluginConfig(request_timeout_s=300.0, attempt_timeout_s=120.0,
                                                                queue_cap=100_000))
    try:
        n = max(1, round(args.rate * args.burst_s))
        t0, t0_wall = time.monotonic(), time.time()
        await gw.registry.deploy(_deployment(config.namespace, args.service_ms))

        async def one(i: int) -> tuple[int, float, bytes]:
            await asyncio.sleep(max(0.0, t0 + i / args.rate - time.monotonic()))
            reply = await router.invoke(MODEL, INPUT, "application/json")
            return reply.status, time.monotonic() - t0, reply.body

        burst = asyncio.gather(*(one(i) for i in range(n)))
        fn = gw.functions[FUNCTION]
        paraserve = gw.reconciler.paraserve
        marks: dict[str, float] = {}
        seen: dict[str, dict[str, float]] = {}  # host → when its replica was answered / routable / whole (gateway)

        async def watch() -> None:  # when the first start answered, and the first replica served (part or whole)
            while True:
                ms = round(1000 * (time.monotonic() - t0), 1)
                if fn.replicas:
                    marks.setdefault("started_ms", ms)
                if fn.ready or fn.partial:
                    marks.setdefault("serving_ms", ms)
                for e in fn.replicas.values():
                    host = seen.setdefault(e.host, {})
                    host.setdefault("answered", ms)
                    if e.state == "ready":
                        host.setdefault("routable", ms)
                        if e.whole:
                            host.setdefault("whole_routable", ms)
                groups = paraserve.history
                if groups and len(fn.ready) + len(fn.partial) >= len(groups[0].hosts):  # every worker routable
                    marks.setdefault("all_serving_ms", ms)
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        paraserve = gw.reconciler.paraserve
        consolidated = await wait_until(lambda: not gw.reconciler.pending_starts(FUNCTION)
                                        and not paraserve.groups.get(FUNCTION)
                                        and len(fn.ready) >= 1 and not fn.partial, 900, "consolidation")
        results = await burst
        await wait_until(lambda: len(fn.replicas) == 1, 120, "the helpers to drain")
        watcher.cancel()
        reference = await router.invoke(MODEL, INPUT, "application/json")  # the whole stage's answer, one replica
        done = sorted(at for status, at, _ in results if status == 200)
        chosen = [p for f, p in paraserve.chosen if f == FUNCTION] or [1]
        workers = await worker_timelines(cluster, hosts, t0_wall, seen, part_bytes(paraserve))
        return {"P": chosen[0], "first_served_ms": round(1000 * done[0], 1) if done else None,
                "consolidated_ms": round(1000 * (consolidated - t0), 1), "lost": n - len(done), "sent": n,
                "wrong": count_wrong([body for status, _, body in results if status == 200], reference),
                "statuses": sorted({s for s, _, _ in results}), **marks, "workers": workers}
    finally:
        await router.close()
        await gw.close()


def count_wrong(bodies: list[bytes], reference) -> int:
    """Answers that differ from the whole stage's answer to the same input (its tensors: names, shapes, dtypes,
    values; with emulated compute the values are zeros, so a wrong layer range shows as a wrong shape)."""
    import torch
    from quart_stage.wire import decode

    if reference.status != 200:
        raise RuntimeError(f"the reference request failed: {reference.status} {reference.body[:200]!r}")
    want = decode(reference.body).tensors

    def same(body: bytes) -> bool:
        try:
            got = decode(body).tensors
        except Exception:  # noqa: BLE001 - not a tensor message: wrong
            return False
        return got.keys() == want.keys() and all(
            got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(got[k], want[k])
            for k in want)

    return sum(1 for body in bodies if not same(body))


def measure(args: argparse.Namespace) -> dict:
    hosts = [f"h{i}" for i in range(args.hosts)]
    args.registry_gbps = args.registry_gbps or args.nic_gbps * max(args.parts)
    os.environ["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(8 << 30)  # the registry process keeps objects in memory
    with peer_cluster(hosts, args.nic_gbps, f"bench-para-{os.getpid()}", args.registry_gbps,
                      files_registry=args.registry == "files") as cluster:
        cluster.preload, cluster.km_args = True, ("--gpus", "1")  # one replica slot a host
        model = build_stage(cluster.work, args.stage_mb, args.blocks, args.service_ms)
        stage_bytes = (model / "stage-0.safetensors").stat().st_size
        manifest = json.loads((model / "manifest.json").read_text())
        layer_bytes = [b - a for a, b in manifest["stages"][0]["layer_bytes"]]
        args.vocab = int(manifest["config"].get("vocab_size") or 32000)
        if args.registry == "files":
            bucket, prefix = parse_model_url(MODEL_URL)
            (cluster.registry_root / bucket).mkdir()
            shutil.move(model, cluster.registry_root / bucket / prefix)
        else:
            ModelRegistry(MODEL_URL, endpoint_url=cluster.endpoint).upload(model)
            shutil.rmtree(model)
        os.environ["QUART_REGISTRY_ENDPOINT"] = cluster.endpoint  # the gateway reads the manifest (the layout)
        if args.workload == "generation":  # quart_tools.bench.paraserve_gen: sessions, KV migration, both SLOs
            return {**paraserve_gen.measure(args, cluster, hosts, layer_bytes), "stage_bytes": stage_bytes,
                    "nic_gbps": args.nic_gbps, "registry_gbps": args.registry_gbps, "hosts": args.hosts,
                    "emulated": {"decode_ms": args.decode_ms, "prefill_ms_per_token": args.prefill_ms_per_token},
                    "sessions": args.sessions, "rate": args.rate, "prompt": args.prompt,
                    "max_tokens": args.max_tokens}
        rows = []
        for parts in args.parts:
            fresh_keysmanagers(cluster, hosts, preloader=True)
            rows.append(asyncio.run(cold_start(cluster, hosts, parts, args)))
            print(rows[-1], flush=True)
        single = next((r["first_served_ms"] for r in rows if r["P"] == 1), None)
        cal = calibrate(rows, stage_bytes)
        registry = args.registry_gbps * 1e9 / 8
        predicted = predictions(cal, layer_bytes, registry, args.hosts)
        slo_ms = args.slo_ms or round(0.5 * (single or rows[0]["first_served_ms"]), 0)
        runs = []
        for _ in range(args.slo_runs):
            fresh_keysmanagers(cluster, hosts, preloader=True)
            runs.append(asyncio.run(cold_start(cluster, hosts, 0, args, slo_ms, cal)))
            print(runs[-1], flush=True)
    met = sum(1 for r in runs if r["first_served_ms"] is not None and r["first_served_ms"] <= slo_ms)
    return {"nic_gbps": args.nic_gbps, "registry_gbps": args.registry_gbps, "registry": args.registry,
            "stage_bytes": stage_bytes,
            "single_host_cold_ms": single, "rows": rows,
            "slo_run": {"slo_ms": slo_ms, "chosen_P": sorted({r["P"] for r in runs}), "cold_starts": len(runs),
                        "attainment": round(met / len(runs), 3) if runs else None,
                        "calibration": {"fetch_gbps": round(8 * cal.fetch_bytes_s / 1e9, 3),
                                        "fixed_s": round(cal.fixed_s, 3), "tail_s": round(cal.tail_s, 3)},
                        "predicted_first_ms": predicted,
                        "first_served_ms": [r["first_served_ms"] for r in runs], "runs": runs,
                        "wrong": sum(r["wrong"] for r in runs),
                        "lost": sum(r["lost"] for r in runs)},
            "service_ms": args.service_ms, "rate": args.rate, "burst_s": args.burst_s, "hosts": args.hosts,
            "blocks": args.blocks}


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench paraserve", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON here (default stdout)")
    p.add_argument("--stage-mb", type=int, default=1024, help="stage size, MB (default 1024)")
    p.add_argument("--blocks", type=int, default=16, help="transformer blocks in the stage (default 16)")
    p.add_argument("--nic-gbps", type=float, default=1.0, help="each host's NIC limit (default 1)")
    p.add_argument("--registry-gbps", type=float, default=0.0,
                   help="the registry's own link, also what the planner assumes (default: largest P x --nic-gbps)")
    p.add_argument("--registry", choices=("files", "moto"), default="files",
                   help="the registry's server: files (quart_tools.bench.s3files: ranged reads by sendfile, the "
                        "default) or moto (reads the whole object for every ranged read)")
    p.add_argument("--hosts", type=int, default=4, help="hosts (default 4: the largest P)")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4], help="P of the rows (default 1 2 4)")
    p.add_argument("--service-ms", type=float, default=100.0, help="emulated service time of the whole stage")
    p.add_argument("--rate", type=float, default=8.0, help="arrival rate from the cold start, req/s (default 8)")
    p.add_argument("--burst-s", type=float, default=6.0, help="arrivals for this long, s (default 6)")
    p.add_argument("--slo-ms", type=float, default=0.0, help="first-answer SLO (default: 0.5 x single-host cold)")
    p.add_argument("--slo-runs", type=int, default=4, help="cold starts of the SLO run (default 4)")
    p.add_argument("--verbose", action="store_true", help="log the gateway's decisions")
    paraserve_gen.add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if max(args.parts) > args.hosts:
        p.error("--hosts must be at least the largest of --parts")
    load = round(os.getloadavg()[0], 2)
    doc = measure(args)
    doc["machine"] = machine_info(load_avg_1m_at_start=load, load_avg_1m_at_end=round(os.getloadavg()[0], 2),
                                  compute="emulated")
    doc["command"] = "quartctl bench paraserve " + " ".join(argv)
    write_report(doc, args.out)
    return 0
