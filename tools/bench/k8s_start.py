"""`quartctl bench k8s-start [--out FILE] [--size-gb 1] [--reps 3]`: a stage pod's time to ready on its node's
fork path, attached to its node's parameter cache, and cold, on one machine without Kubernetes.

Three start paths, each as a pod runs it: ``forward`` (``python -m quart_stage.forward``: the node's
KeysManager forks a replica, the pod forwards to it; the target of issue 13 is measured on this one,
``forward_ready_ms <= cold_ready_ms / 20``), ``attach`` (gunicorn, parameters mapped from the node's segment) and
``cold`` (gunicorn, the checkpoint read from the model folder).

What a stage pod runs is started as a fresh process, exactly as the image starts it after of-watchdog:
``gunicorn index:app --config gunicorn.conf.py`` in the folder ``faas-cli build --shrinkwrap`` lays out
(template + ``functions/decoder-lm`` handler; ``quart_stage`` from that folder, not from the repository),
with the environment stack.yml gives a stage (``QUART_MODEL_DIR``, ``QUART_STAGE_INDEX``, ...) and, for the
attach path, ``QUART_KEYSMANAGER_SOCKET`` (what the admission policy adds). Ready = the first 200 of
``GET /_/health`` (the readiness path), timed from the process start, polled every 5 ms; the health answer
must say where the parameters came from (``node-cache`` / ``memory``), and one inference is checked after.

Setup: a one-stage model of ``--size-gb`` (the partitioner's ``sized`` preset: ``quartctl partition --model
sized --target-stage-mb 1000 --stages 1``), a real KeysManager (``python -m keysmanager.daemon``, private
socket and state dir) that caches the stage once (``POST /v1/attach``, as the first pod of a node would).
Before every start the page cache is dropped (``echo 1 > /proc/sys/vm/drop_caches``, root only; the JSON says
whether it was) and the interpreter's libraries are read back by a throwaway ``import torch, transformers,
flask``: code is warm as on a node that ran the image before, the checkpoint is cold. tmpfs segments are
not page cache: dropping it leaves the node cache in place. Medians over ``--reps``; the attach and cold
starts alternate. ``*_params_ms``: the parameter step alone (``quart_stage.attach.load_stage`` after the
imports), measured in its own fresh process the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from quart_stage import cliargs
from quart_stage.attach import stage_spec
from quart_stage.config import StageConfig
from quart_tools.bench import machine_info, write_report
from quart_tools.bench.keysmanager import Daemon, make_stage, need_memory

from keysmanager.types import StageSpec

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "template" / "pipeline-stage"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
WARM_IMPORTS = "import torch, transformers, flask, werkzeug; import quart_stage.families, quart_stage.attach"
PARAMS_PROBE = """
import json, sys, time
import quart_stage.families, quart_stage.attach, transformers.models.llama.modeling_llama
from quart_stage.config import StageConfig
t = time.perf_counter()
rt = quart_stage.attach.load_stage(StageConfig.from_env())
print(json.dumps({"ms": (time.perf_counter() - t) * 1e3, "source": rt.parameter_source}))
"""


def shrinkwrap(dest: Path, handler: str = "decoder-lm") -> Path:
    """What ``faas-cli build --shrinkwrap`` lays out: the template, with ``functions/<handler>`` as function/."""
    shutil.copytree(TEMPLATE, dest, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(dest / "function")
    shutil.copytree(ROOT / "functions" / handler, dest / "function", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def pod_env(model: Path, socket_path: Path | None) -> dict[str, str]:
    """A stage pod's environment: stack.yml's stage settings, the image's ENV, quart_stage from the image."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QUART_", "PYTHONPATH"))}
    env.update({"QUART_MODEL_DIR": str(model), "QUART_STAGE_INDEX": "0", "QUART_NUM_STAGES": "1",
                "QUART_COMPUTE": "cpu", "QUART_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    if socket_path is not None:
        env["QUART_KEYSMANAGER_SOCKET"] = str(socket_path)
    return env


def drop_page_cache(build: Path) -> bool:
    """Drop the page cache (root only), then read the interpreter's libraries back; True when dropped."""
    dropped = False
    if os.geteuid() == 0:
        os.sync()
        try:
            DROP_CACHES.write_text("1\n")
            dropped = True
        except OSError:
            pass
    subprocess.run([sys.executable, "-c", WARM_IMPORTS], check=True, cwd=build, env=pod_env(Path("/"), None))
    return dropped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_health(session: requests.Session, url: str, proc: subprocess.Popen, log, t0: float, timeout_s: float,
                  what: str) -> tuple[requests.Response, float]:
    """Poll ``/_/health`` until it answers 200: (that answer, ms since ``t0``); raises with the log's tail when
    the process exits or ``timeout_s`` passes first."""
    while True:
        try:
            health = session.get(url + "/_/health", timeout=5)
            if health.status_code == 200:
                return health, (time.perf_counter() - t0) * 1e3
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
            log.seek(0)
            raise RuntimeError(f"{what} did not become ready:\n{log.read().decode()[-3000:]}")
        time.sleep(0.005)


def ready_ms(build: Path, env: dict[str, str], source: str, timeout_s: float = 600.0) -> float:
    """Start the stage as a pod does; ms from the process start to its first healthy answer."""
    bind = f"127.0.0.1:{_free_port()}"
    url = f"http://{bind}"
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "index:app", "--config", "gunicorn.conf.py"],
                                cwd=build, env={**env, "QUART_BIND": bind}, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True)
        try:
            with requests.Session() as session:
                health, elapsed = _first_health(session, url, proc, log, t0, timeout_s, "the stage")
                if health.json().get("parameters") != source:
                    raise RuntimeError(f"expected parameters from {source}, the stage says {health.json()}")
                answer = session.post(url, json={"input_ids": [[1, 2, 3]]}, timeout=120)
                if answer.status_code != 200:
                    raise RuntimeError(f"inference answered {answer.status_code}: {answer.text[:300]}")
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return elapsed


def forward_ready_ms(build: Path, env: dict[str, str], daemon: Daemon, timeout_s: float = 120.0) -> dict[str, float]:
    """Start the pod's fork path (``python -m quart_stage.forward``); ms from the process start to its first
    healthy answer, and the forwarder's own breakdown. After one forwarded inference, SIGTERM must stop the
    forked replica (the KeysManager lists it dead)."""
    bind = f"127.0.0.1:{_free_port()}"
    url = f"http://{bind}"
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "quart_stage.forward"], cwd=build,
                                env={**env, "QUART_BIND": bind}, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            with requests.Session() as session:
                health, elapsed = _first_health(session, url, proc, log, t0, timeout_s, "the forwarder")
                if health.json().get("start") != "fork":
                    raise RuntimeError(f"expected the fork path, the pod says {health.json()}")
                answer = session.post(url, json={"input_ids": [[1, 2, 3]]}, timeout=120)
                if answer.status_code != 200 or answer.headers.get("X-Quart-Start") != "fork":
                    raise RuntimeError(f"forwarded inference answered {answer.status_code}: {answer.text[:300]}")
            rid = health.json()["replica"]
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        if any(r.id == rid and r.state != "dead" for r in daemon.client.replicas(memory=False)):
            raise RuntimeError(f"SIGTERM of the forwarder left its replica {rid} running")
        log.seek(0)
        found = re.search(rb"cache ([\d.]+) ms, fork ([\d.]+) ms, ready ([\d.]+) ms", log.read())
    steps = dict(zip(("cache", "fork", "ready"), (float(x) for x in found.groups()), strict=True)) if found else {}
    return {"ready": elapsed, **{f"km_{k}": v for k, v in steps.items()}}


def forwarder_start_ms(build: Path) -> float:
    """A fresh interpreter importing ``quart_stage.forward`` and exiting: the lean process's own start cost."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import quart_stage.forward"], cwd=build, check=True,
                   env=pod_env(Path("/"), None))
    return (time.perf_counter() - t0) * 1e3


def params_ms(build: Path, env: dict[str, str], source: str) -> float:
    """The parameter step alone (load_stage after the imports), in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PARAMS_PROBE], cwd=build, env=env, check=True, capture_output=True,
                         text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["source"] != source:
        raise RuntimeError(f"expected parameters from {source}, got {result}")
    return result["ms"]


def main(argv: list[str]) -> int:
    parser = cliargs.ArgumentParser(prog="quartctl bench k8s-start", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON here (default stdout)")
    parser.add_argument("--size-gb", type=float, default=1.0, help="stage size in GB (default 1)")
    parser.add_argument("--reps", type=int, default=3, help="starts per path; medians (default 3)")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.size_gb <= 0:
        parser.error("--reps must be >= 1 and --size-gb > 0")
    mb = int(args.size_gb * 1000)
    need_memory(int(2.3 * mb * 1_000_000), f"the {mb} MB stage")
    root = Path(tempfile.mkdtemp(prefix="k8s-start-", dir="/tmp"))  # short: Unix socket paths are limited
    load_before = os.getloadavg()
    daemon = None
    try:
        model, nbytes = make_stage(root, mb)
        build = shrinkwrap(root / "build")
        daemon = Daemon(root)
        attach_env, cold_env = pod_env(model, daemon.socket), pod_env(model, None)
        t0 = time.perf_counter()
        daemon.client.attach(StageSpec.from_dict(stage_spec(StageConfig.from_env(attach_env))))
        cache_ms = (time.perf_counter() - t0) * 1e3
        runs: dict[str, list[float]] = {"forward": [], "attach": [], "cold": [], "attach_params": [], "cold_params": [],
                                        "forward_km_cache": [], "forward_km_fork": [], "forward_km_ready": [],
                                        "forwarder_process": []}
        dropped = []
        for _ in range(args.reps):
            dropped.append(drop_page_cache(build))
            for key, value in forward_ready_ms(build, attach_env, daemon).items():
                runs[f"forward_{key}" if key != "ready" else "forward"].append(value)
            runs["forwarder_process"].append(forwarder_start_ms(build))
            print(f"forward: ready {runs['forward'][-1]:.0f} ms", file=sys.stderr)
            for path, env, source in (("attach", attach_env, "node-cache"), ("cold", cold_env, "memory")):
                dropped.append(drop_page_cache(build))
                runs[path].append(ready_ms(build, env, source))
                dropped.append(drop_page_cache(build))
                runs[f"{path}_params"].append(params_ms(build, env, source))
                print(f"{path}: ready {runs[path][-1]:.0f} ms, parameters {runs[path + '_params'][-1]:.0f} ms",
                      file=sys.stderr)
    finally:
        if daemon is not None:
            daemon.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: round(statistics.median(v), 1) if v else None for k, v in runs.items()}
    doc = {
        "benchmark": "k8s-start",
        "target": "forward_ready_ms <= cold_ready_ms / 20 (the fork path; attach is kept beside it)",
        "forward_ready_ms": med["forward"], "attach_ready_ms": med["attach"], "cold_ready_ms": med["cold"],
        "size_bytes": nbytes,
        "repeats": args.reps, "page_cache_dropped": all(dropped),
        "attach_params_ms": med["attach_params"], "cold_params_ms": med["cold_params"],
        "all_ms": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "node_cache_fill_ms": round(cache_ms, 1),
        "forward_steps_ms": {"km_cache": med["forward_km_cache"], "km_fork": med["forward_km_fork"],
                             "replica_ready": med["forward_km_ready"], "forwarder_process": med["forwarder_process"]},
        "ready_ratio_cold_over_forward": round(med["cold"] / med["forward"], 1),
        "ready_ratio_cold_over_attach": round(med["cold"] / med["attach"], 2),
        "params_ratio_cold_over_attach": round(med["cold_params"] / med["attach_params"], 1),
        "target_forward_at_most_cold_over_20": med["forward"] * 20 <= med["cold"],
        "target_attach_at_most_cold_over_20": med["attach"] * 20 <= med["cold"],
        "ready": "the pod's start command in the shrinkwrapped template started as a fresh process (forward: "
                 "python -m quart_stage.forward; attach, cold: gunicorn index:app) -> first 200 of GET /_/health "
                 "(of-watchdog, container start, scheduling not included)",
        "forwarder_process": "python -c 'import quart_stage.forward' in a fresh interpreter, start to exit",
        "machine": machine_info(load_before=[round(x, 2) for x in load_before],
                                load_after=[round(x, 2) for x in os.getloadavg()]),
    }
    write_report(doc, args.out)
    return 0
