"""`quartctl bench scheduler [--out FILE]`: cache-aware vs cache-blind first-fit placement, live.

Three KeysManager daemons (simulated hosts with their own GPU slots and memory limits, low enough
that caching every stage everywhere is impossible) run real stage replicas of a small partitioned
model (emulated compute). Each placer gets fresh daemons and the very same script: deploy one
replica per stage, then a seeded sequence of key-stage scale-ups and scale-downs
(:mod:`quart_tools.bench.scheduler_scenario`). Every scale-up asks the placer where its replicas go;
that host's KeysManager forks them from a cached zygote or cold-starts them. Measured: the cache hit
rate of key-stage scale-ups (replicas the KeysManager forked) and their replica-ready time.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from quart_kernel.scheduling import make_placer
from quart_kernel.scheduling.hosts import host_view_from_report
from quart_kernel.scheduling.types import HostView, Placer, ReplicaRequest
from quart_provider.scheduler_metrics import SchedulerMetrics
from quart_stage import cliargs
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.scheduler_scenario import Step, scripted_sequence
from tqdm import tqdm


@dataclass(frozen=True, slots=True)
class Started:
    """A replica as its host started it."""

    id: str
    function: str
    host: str
    source: str  # fork | cold (what the KeysManager actually did)
    ready_ms: float | None


class HostDriver(Protocol):
    """What the benchmark needs of one host (a KeysManager in the live run)."""

    name: str

    def view(self) -> HostView: ...

    def start(self, function: str) -> Started: ...

    def stop(self, replica_id: str) -> None: ...

    def pin(self, functions: list[str]) -> None: ...


@dataclass
class ScaleUpRecord:
    step: int
    function: str
    host: str
    planned: str  # source the placer expected
    source: str  # source the KeysManager reported
    ready_ms: float | None


@dataclass
class RunOutcome:
    placer: str
    records: list[ScaleUpRecord] = field(default_factory=list)
    deploy: list[ScaleUpRecord] = field(default_factory=list)
    unplaced: int = 0
    dispersed: int = 0
    wall_s: float = 0.0
    metrics: dict = field(default_factory=dict)

    def summary(self) -> dict:
        ups = self.records
        hits = sum(r.source == "fork" for r in ups)
        times = [r.ready_ms for r in ups if r.ready_ms is not None]
        by_source: dict[str, list[float]] = {}
        for r in ups:
            if r.ready_ms is not None:
                by_source.setdefault(r.source, []).append(r.ready_ms)
        return {
            "hit_rate": hits / len(ups) if ups else 0.0,
            "mean_ready_ms": sum(times) / len(times) if times else 0.0,
            "scale_ups": len(ups),
            "forks": hits,
            "colds": sum(r.source == "cold" for r in ups),
            "planned_forks": sum(r.planned == "fork" for r in ups),
            "mean_ready_ms_by_source": {s: sum(v) / len(v) for s, v in sorted(by_source.items())},
            "unplaced": self.unplaced,
            "dispersed_decisions": self.dispersed,
            "deploy_replicas": len(self.deploy),
            "wall_s": round(self.wall_s, 1),
            "metrics": self.metrics,
            "log": [[r.step, r.function, r.host, r.planned, r.source, r.ready_ms] for r in self.deploy + ups],
        }


def run_script(
    placer: Placer,
    drivers: list[HostDriver],
    stages: list[str],
    steps: list[Step],
    param_bytes: dict[str, int],
    progress: Callable[[], None] = lambda: None,
) -> RunOutcome:
    """Deploy one replica per stage, then play `steps`; every replica goes where `placer` says."""
    by_name = {d.name: d for d in drivers}
    outcome = RunOutcome(placer.name)
    metrics = SchedulerMetrics()
    history: dict[str, int] = {}
    scaled: dict[str, list[Started]] = {}  # live scale-up replicas per function (LIFO scale-down)
    t0 = time.perf_counter()

    def views() -> list[HostView]:
        hosts = [d.view() for d in drivers]
        metrics.record_hosts(hosts)
        return hosts

    def place(requests: list[ReplicaRequest], step: int) -> list[ScaleUpRecord]:
        result = placer.place(views(), requests, dict(history))
        metrics.record_schedule(result)
        for d in drivers:  # the zygotes the placer keeps (key stages) are pinned before anything starts
            d.pin(sorted(f for f, host in result.keep_cached if host == d.name))
        outcome.unplaced += sum(u.count for u in result.unplaced)
        outcome.dispersed += int(result.dispersed)
        done = []
        for p in result.placements:
            replica = by_name[p.host].start(p.function)
            done.append(ScaleUpRecord(step, p.function, p.host, p.source, replica.source, replica.ready_ms))
            if step >= 0:
                metrics.record_replica(p.function, p.host, replica.source, replica.ready_ms, key=True)
                scaled.setdefault(p.function, []).append(replica)
        return done

    outcome.deploy = place([ReplicaRequest(f, 1, param_bytes[f]) for f in stages], -1)
    progress()
    for i, step in enumerate(steps):
        if step.delta > 0:
            history[step.function] = history.get(step.function, 0) + 1
            outcome.records += place([ReplicaRequest(step.function, step.delta, param_bytes[step.function], True)], i)
        else:
            live = scaled.get(step.function, [])
            for _ in range(min(-step.delta, len(live))):
                replica = live.pop()
                by_name[replica.host].stop(replica.id)
        progress()
    outcome.wall_s = time.perf_counter() - t0
    outcome.metrics = metrics.snapshot().to_dict()
    return outcome


# -- the live hosts: KeysManager daemons -------------------------------------------------------------------


class KeysManagerDriver:
    """One live host: a KeysManager daemon reached through keysmanager.client."""

    def __init__(self, name: str, socket_path: str, env_of: Callable[[str], dict[str, str]]) -> None:
        from keysmanager.client import KeysManagerClient

        self.name = name
        self.client = KeysManagerClient(socket_path, timeout=300.0)
        self.env_of = env_of

    def view(self) -> HostView:
        return host_view_from_report(self.client.report(), self.client.replicas())

    def start(self, function: str) -> Started:
        from keysmanager.types import StageSpec

        spec = StageSpec(function=function, env=self.env_of(function), cpus=1.0)
        [info] = self.client.start(spec, 1, wait=True)
        if info.state != "ready":
            raise RuntimeError(f"replica of {function} on {self.name} did not become ready (state {info.state})")
        return Started(info.id, function, self.name, info.source, info.ready_ms)

    def stop(self, replica_id: str) -> None:
        self.client.stop(replica_id, drain=True)

    def pin(self, functions: list[str]) -> None:
        self.client.pin(functions)


@contextlib.contextmanager
def keysmanagers(
    workdir: Path, hosts: int, gpus: int, memory_limit: int
) -> Iterator[list[tuple[str, str]]]:
    """Start `hosts` KeysManager daemons (`quartctl keysmanager`); yield (name, socket); always stop them."""
    from keysmanager.client import KeysManagerClient

    procs: list[subprocess.Popen] = []
    daemons: list[tuple[str, str]] = []
    try:
        for i in range(hosts):
            name = f"bench-host-{i}"
            state = workdir / name
            state.mkdir(parents=True, exist_ok=True)
            sock = str(state / "km.sock")
            log = open(state / "daemon.log", "wb")  # noqa: SIM115 - closed with the process below
            cmd = [
                sys.executable, "-m", "quart_tools.cli", "keysmanager", "--name", name, "--socket", sock,
                "--state-dir", str(state), "--memory-limit", str(memory_limit), "--gpus", str(gpus),
            ]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
            daemons.append((name, sock))
        deadline = time.monotonic() + 60
        for (name, sock), proc in zip(daemons, procs, strict=True):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"KeysManager {name} exited with {proc.returncode}; see {workdir / name}/daemon.log")
                with contextlib.suppress(Exception):
                    KeysManagerClient(sock, timeout=2).health()
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"KeysManager {name} did not answer within 60 s")
                time.sleep(0.1)
        yield daemons
    finally:
        for (_, sock), proc in zip(daemons, procs, strict=False):
            if proc.poll() is None:
                with contextlib.suppress(Exception):
                    KeysManagerClient(sock, timeout=30).shutdown()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def build_model(workdir: Path, stage_mb: float, stages: int) -> Path:
    """Partition a model with random weights, about `stage_mb` MB per stage (`quartctl partition`)."""
    out = workdir / "model"
    cmd = [sys.executable, "-m", "quart_tools.cli", "partition", "--model", "sized", "--target-stage-mb",
           str(stage_mb), "--stages", str(stages), "--weights", "random", "--compute", "emulated",
           "--out", str(out)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"quartctl partition failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return out


def main(argv: list[str]) -> int:
    ap = cliargs.ArgumentParser(prog="quartctl bench scheduler", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--gpus-per-host", type=int, default=4)
    ap.add_argument("--stages", type=int, default=6, help="pipeline stages of the bench model")
    ap.add_argument("--key-stages", type=int, default=4, help="stages the script scales (the key stages)")
    ap.add_argument("--bursts", type=int, default=16, help="scale-ups in the script")
    ap.add_argument("--memory-stages", type=float, default=4.5,
                    help="memory limit of a host, in stage-parameter sizes: room for two cold base replicas "
                         "(private copies) and two zygotes, so cold scale-ups force eviction")
    ap.add_argument("--stage-mb", type=float, default=64.0, help="parameters per stage, MB (random weights)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--placers", default="cache-aware,first-fit")
    args = ap.parse_args(argv)

    from quart_stage.manifest import Manifest

    placers = [p.strip() for p in args.placers.split(",") if p.strip()]
    extra = args.hosts * args.gpus_per_host - args.stages
    if extra < 1:
        print("quartctl bench scheduler: the hosts have no slot left after one replica per stage", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="quart-bench-sched-") as tmp:
        work = Path(tmp)
        model_dir = build_model(work, args.stage_mb, args.stages)
        manifest = Manifest.load(str(model_dir))
        model = manifest.model
        stages = [f"{model}-stage-{s.index}" for s in manifest.stages]
        sizes = {f"{model}-stage-{s.index}": int(s.parameter_bytes) for s in manifest.stages}
        key = stages[1 : 1 + args.key_stages]
        steps = scripted_sequence(key, args.bursts, max_extra=min(extra - 1, 6), seed=args.seed)
        memory_limit = int(args.memory_stages * max(sizes.values()))

        def env_of(function: str) -> dict[str, str]:
            index = stages.index(function)
            return {"QUART_MODEL_DIR": str(model_dir), "QUART_STAGE_INDEX": str(index),
                    "QUART_NUM_STAGES": str(len(stages)), "QUART_COMPUTE": "emulated",
                    "QUART_EMULATED_MEAN_MS": "5"}

        bar = tqdm(total=len(placers) * (len(steps) + 1), desc="bench scheduler", file=sys.stderr,
                   disable=not sys.stderr.isatty())
        for name in placers:
            with keysmanagers(work / name, args.hosts, args.gpus_per_host, memory_limit) as daemons:
                drivers = [KeysManagerDriver(n, s, env_of) for n, s in daemons]
                outcome = run_script(make_placer(name), drivers, stages, steps, sizes, progress=lambda: bar.update())
            results[name.replace("-", "_")] = outcome.summary()
        bar.close()
    doc = {
        **results,
        "ready_time_ratio": _ratio(results, "mean_ready_ms"),
        "setup": {
            "hosts": args.hosts, "gpus_per_host": args.gpus_per_host, "stages": len(stages), "key_stages": key,
            "stage_param_bytes": sizes, "memory_limit_bytes": memory_limit, "script": [asdict(s) for s in steps],
            "seed": args.seed, "compute": "emulated", "stage_mb": args.stage_mb,
        },
        "machine": machine_info(),
    }
    write_report(doc, args.out)
    return 0


def _ratio(results: dict[str, dict], field_name: str) -> float | None:
    """first-fit / cache-aware of a figure (how many times shorter cache-aware is)."""
    ca, ff = results.get("cache_aware"), results.get("first_fit")
    if not ca or not ff or not ca[field_name]:
        return None
    return ff[field_name] / ca[field_name]
