"""`quartctl bench keysmanager [--out FILE]`: replica-ready time, fork vs cold, and memory of fork modes.

For each stage size (default 100 MB, 1 GB, 4 GB; one stage at a time, random weights made with the
partitioner in a temp dir) it measures, in the same run and against the same KeysManager:

- cold: start request -> a fresh interpreter loads the stage from disk -> first successful inference;
- fork: start request -> fork of the zygote holding the stage in shared memory -> first successful inference.

Ready time runs from the start request to the first 200 answer of ``POST /`` (the start call does not wait
for health: the inference request waits in the replica's listen backlog). The size rows use the stage
runtime's EMULATED compute (1 ms service time) with the parameters really loaded and resident, because a
real CPU forward over 4 GB takes longer than the target on its own; one extra row runs real ``cpu``
compute at the smallest size. Memory: 8 copy-on-write replicas of the 1 GB stage, each after one real
``cpu`` inference (so every replica has touched every weight), PSS summed over them relative to 8 x the
stage; and isolated replicas (private copy) for comparison. Medians over ``--reps`` repetitions.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests
from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from tqdm import tqdm

from keysmanager.client import KeysManagerClient, KeysManagerError
from keysmanager.types import StageSpec, StartOrder

IDS = {"input_ids": [[1, 2, 3, 4, 5, 6, 7, 8]]}
MB = 1_000_000


class Daemon:
    """A KeysManager subprocess for the benchmark, in a temp dir."""

    def __init__(self, root: Path, extra: tuple[str, ...] = ()) -> None:
        self.socket = root / "km.sock"
        log = open(root / "km.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen([sys.executable, "-m", "keysmanager.daemon", "--name", "bench",
                                      "--socket", str(self.socket), "--state-dir", str(root / "state"), *extra],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self.client = KeysManagerClient(str(self.socket), timeout=900)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.health()
                return
            except KeysManagerError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the KeysManager did not start; see {root / 'km.log'}") from None
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _spec(function: str, model_dir: Path, compute: str) -> StageSpec:
    env = {"QUART_MODEL_DIR": str(model_dir), "QUART_STAGE_INDEX": "0", "QUART_COMPUTE": compute}
    if compute == "emulated":
        env.update({"QUART_EMULATED_MEAN_MS": "1", "QUART_EMULATED_CV": "0"})
    return StageSpec(function, env=env, cpus=1.0)


def _ready_ms(km: KeysManagerClient, spec: StageSpec, order: StartOrder, timeout_s: float = 600.0
              ) -> tuple[float, str]:
    """Start one replica as the gateway does (one planned start, ``POST /v1/starts``), send inference until the
    first 200; (ms from the start request, replica id). The start must take the plan's path."""
    t0 = time.perf_counter()
    report = km.start_planned(spec, order)
    if report.path != order.mode:
        raise RuntimeError(f"{spec.function}: planned {order.mode}, started {report.path}: {report.fallback}")
    [rep] = report.replicas
    deadline = t0 + timeout_s
    with requests.Session() as session:
        while True:
            try:
                resp = session.post(rep.url, json=IDS, timeout=max(1.0, deadline - time.perf_counter()))
                if resp.status_code == 200:
                    return (time.perf_counter() - t0) * 1e3, rep.id
                if resp.status_code < 500:
                    raise RuntimeError(f"{spec.function}: inference answered {resp.status_code}: {resp.text[:300]}")
            except requests.ConnectionError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{spec.function}: no successful inference within {timeout_s} s")
            time.sleep(0.002)


def make_stage(root: Path, mb: int) -> tuple[Path, int]:
    from quart_tools.partition import partition, stage_size_config

    out = root / f"stage-{mb}mb"
    manifest = partition(stage_size_config(mb, stages=1), 1, str(out), weights="random", progress=sys.stderr.isatty(),
                         name=f"bench-{mb}mb")
    return out, int(manifest.stages[0].parameter_bytes)


def need_memory(nbytes: int, what: str) -> None:
    available = psutil.virtual_memory().available
    shm_free = shutil.disk_usage("/dev/shm").free
    if available < nbytes or shm_free < nbytes // 2:
        raise MemoryError(f"{what} needs about {nbytes / 1e9:.1f} GB; {available / 1e9:.1f} GB of memory and "
                          f"{shm_free / 1e9:.1f} GB of /dev/shm are free")


def _size_row(km: KeysManagerClient, model: Path, mb: int, nbytes: int, compute: str, reps: int,
              bar: tqdm) -> dict:
    cold_spec = _spec(f"b{mb}-{compute}-cold-stage-0", model, compute)
    fork_spec = _spec(f"b{mb}-{compute}-stage-0", model, compute)
    cold, fork = [], []
    for _ in range(reps):
        ms, rid = _ready_ms(km, cold_spec, StartOrder("cold", cache=False))  # loads on its own, caches nothing
        cold.append(ms)
        km.stop(rid)
        bar.update()
    zygote = km.ensure_cached(fork_spec)
    for _ in range(reps):
        ms, rid = _ready_ms(km, fork_spec, StartOrder("fork"))
        fork.append(ms)
        km.stop(rid)
        bar.update()
    km.invalidate(fork_spec.function)
    fork_ms, cold_ms = statistics.median(fork), statistics.median(cold)
    return {"stage_mb": mb, "param_bytes": nbytes, "compute": compute, "fork_ready_ms": round(fork_ms, 2),
            "cold_ready_ms": round(cold_ms, 2), "cold_over_fork": round(cold_ms / fork_ms, 1),
            "fork_runs_ms": [round(x, 2) for x in fork], "cold_runs_ms": [round(x, 2) for x in cold],
            "zygote_load_ms": round(zygote["load_ms"], 1)}


def _memory_point(km: KeysManagerClient, model: Path, nbytes: int, replicas: int, isolated: int,
                  bar: tqdm) -> dict:
    spec = _spec("pss-stage-0", model, "cpu")
    zygote = km.ensure_cached(spec)
    result: dict = {"stage_bytes": nbytes, "compute": "cpu (one real inference per replica first)"}
    for mode, count in (("cow", replicas), ("isolated", isolated)):
        if count == 0:
            continue
        need_memory(nbytes * (count if mode == "isolated" else 1) + (1 << 30), f"{count} {mode} replicas")
        z_before = {z.function: z for z in km.zygotes()}["pss-stage-0"].pss_bytes
        started = km.start(spec, count, mode=mode)
        with requests.Session() as session:
            for rep in started:
                resp = session.post(rep.url, json=IDS, timeout=600)
                if resp.status_code != 200:
                    raise RuntimeError(f"inference on {rep.id} answered {resp.status_code}: {resp.text[:300]}")
                bar.update()
        listed = {r.id: r for r in km.replicas("pss-stage-0")}
        pss = sum(listed[r.id].pss_bytes for r in started)
        rss = sum(listed[r.id].rss_bytes for r in started)
        z_after = {z.function: z for z in km.zygotes()}["pss-stage-0"].pss_bytes
        added = pss + (z_after - z_before)  # the zygote's PSS falls as replicas share its pages
        result[mode] = {"replicas": count, "pss_sum_bytes": pss, "rss_sum_bytes": rss,
                        "zygote_pss_delta_bytes": z_after - z_before,
                        "pss_added_fraction": round(added / (count * nbytes), 4)}
        for rep in started:
            km.stop(rep.id)
    km.invalidate(spec.function)
    result["zygote_load_ms"] = round(zygote["load_ms"], 1)
    return result


def main(argv: list[str]) -> int:
    parser = cliargs.ArgumentParser(prog="quartctl bench keysmanager", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here (default stdout)")
    parser.add_argument("--sizes", default="100,1000,4000", help="stage sizes in MB (default 100,1000,4000)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per measurement; medians (default 3)")
    parser.add_argument("--pss-replicas", type=int, default=8, help="copy-on-write replicas for PSS (default 8)")
    parser.add_argument("--isolated-replicas", type=int, default=2, help="isolated replicas to show the copy")
    parser.add_argument("--pss-size-mb", type=int, default=1000, help="stage size of the memory point (1000)")
    parser.add_argument("--workdir", help="where stage checkpoints go (default a temp dir; removed after)")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    if not sizes or args.reps < 1:
        parser.error("--sizes needs at least one size and --reps must be >= 1")
    root = Path(tempfile.mkdtemp(prefix="km-bench-", dir=args.workdir or None))
    load_before = os.getloadavg()
    rows: list[dict] = []
    cpu_row: dict | None = None
    memory: dict | None = None
    steps = len(sizes) * 2 * args.reps + 2 * args.reps + args.pss_replicas + args.isolated_replicas
    daemon = Daemon(root)
    try:
        with tqdm(total=steps, desc="keysmanager bench", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
            for mb in sizes:
                need_memory(int(2.3 * mb * MB), f"the {mb} MB stage")
                model, nbytes = make_stage(root, mb)
                rows.append(_size_row(daemon.client, model, mb, nbytes, "emulated", args.reps, bar))
                if mb == sizes[0]:
                    cpu_row = _size_row(daemon.client, model, mb, nbytes, "cpu", args.reps, bar)
                if mb == args.pss_size_mb:
                    memory = _memory_point(daemon.client, model, nbytes, args.pss_replicas,
                                           args.isolated_replicas, bar)
                shutil.rmtree(model, ignore_errors=True)
            if memory is None and args.pss_replicas:
                model, nbytes = make_stage(root, args.pss_size_mb)
                memory = _memory_point(daemon.client, model, nbytes, args.pss_replicas, args.isolated_replicas, bar)
                shutil.rmtree(model, ignore_errors=True)
    finally:
        daemon.close()
        shutil.rmtree(root, ignore_errors=True)
    largest = rows[-1]
    doc = {
        "benchmark": "keysmanager",
        "compute": "emulated for the size rows: the stage's parameters are loaded (cold: from disk; fork: held "
                   "in /dev/shm by the zygote) and resident, the service time is emulated (1 ms); cpu_row runs "
                   "a real CPU forward",
        "ready_time": "from the start request to the first successful POST / answered over HTTP",
        "rows": [{k: r[k] for k in ("stage_mb", "fork_ready_ms", "cold_ready_ms")} for r in rows],
        "details": rows,
        "cpu_row": cpu_row,
        "pss_added_fraction": memory["cow"]["pss_added_fraction"] if memory and "cow" in memory else None,
        "isolated_pss_added_fraction": (memory["isolated"]["pss_added_fraction"]
                                        if memory and "isolated" in memory else None),
        "memory": memory,
        "targets": {
            "fork_at_most_1_20_of_cold_every_size": all(r["fork_ready_ms"] * 20 <= r["cold_ready_ms"] for r in rows),
            "fork_at_most_150_ms_at_largest": largest["fork_ready_ms"] <= 150.0,
            "largest_stage_mb": largest["stage_mb"],
            "pss_added_at_most_0_25": bool(memory and memory.get("cow", {}).get("pss_added_fraction", 1) <= 0.25),
        },
        "machine": machine_info(memory_bytes=psutil.virtual_memory().total,
                                loadavg_before=[round(x, 2) for x in load_before],
                                loadavg_after=[round(x, 2) for x in os.getloadavg()], gpu="none"),
        "reps": args.reps,
    }
    write_report(doc, args.out)
    return 0
