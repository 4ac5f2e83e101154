"""`quartctl bench standalone`: one-shot through the standalone plugin in front of the embedded gateway vs the
embedded path: the p50 latency each adds per stage (issue 40).

Starts `quartctl up --process-hosts` with the QUART plugin (actuator ``none``) and ``--stages`` built-in
``quart/echo`` stage functions of one model (concurrency 64 per replica: no slot queueing), then
``python -m gateway_plugin.standalone`` in its own process in front of that gateway (policy static, actuator
``none``: nothing scales), as an operator runs it before a real OpenFaaS gateway. One request at a time, one
keep-alive connection per path, the paths interleaved (``bench pipeline``'s method): the stage-0 replica
directly, ``/function/<stage 0>`` (one gateway hop), ``/function/<model>`` on the embedded gateway and on the
standalone plugin. Added per stage = (pipeline − stages × direct) / stages for each front. Then the CPU time the
gateway (and the plugin) processes spend per request on each front, the load-proof part of the same cost. Target: standalone ≤ 2 × embedded (each of its stage
calls pays the gateway's ``/function/<stage>`` hop on top of the router).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quart_provider.system import stop_process
from quart_stage import cliargs
from quart_tools.bench import free_port, machine_info, wait_tcp, write_report
from quart_tools.bench.gateway import Connection, _start_gateway, deploy_echo
from quart_tools.bench.pipeline import MODEL, _stage_labels, interleaved_p50

TARGET_RATIO = 2.0


def _start_standalone(tmp: Path, gateway_url: str, auth: tuple[str, str]) -> tuple[subprocess.Popen, str]:
    """``python -m gateway_plugin.standalone`` in front of ``gateway_url``; once it serves the pipeline, its URL."""
    password = tmp / "gateway-password"
    password.write_text(auth[1])
    password.chmod(0o600)
    port = free_port()
    env = {**os.environ, "QUART_POLICY": "static", "QUART_ACTUATOR": "none", "QUART_REPLICA_REFRESH_S": "1"}
    log = open(tmp / "standalone.log", "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway_plugin.standalone", "--gateway", gateway_url, "--user", auth[0],
         "--password-file", str(password), "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    try:
        wait_tcp("127.0.0.1", port, 60)
    except RuntimeError:
        stop_process(process.pid, process)
        raise RuntimeError(f"standalone plugin did not start: {(tmp / 'standalone.log').read_text()[-2000:]}") \
            from None
    return process, f"http://127.0.0.1:{port}"


async def _cpu_ms_per_request(url: str, body: bytes, count: int, pids: list[int]) -> float:
    """CPU time (user + system) the processes ``pids`` spend per pipeline request on ``url``, ``count`` requests
    one at a time: what a path costs, which the shared machine's load does not inflate as it does wall time."""
    import psutil

    processes = [psutil.Process(pid) for pid in pids]
    conn = await Connection.open(url)
    raw = conn.request_bytes(f"/function/{MODEL}", body)

    def cpu() -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in processes))

    before = cpu()
    for _ in range(count):
        if (status := await conn.send(raw)) != 200:
            raise RuntimeError(f"{url} answered {status}")
    used = cpu() - before
    conn.close()
    return 1000 * used / count


async def _first_answer(url: str, timeout_s: float = 60) -> None:
    """Until the standalone plugin has read the stages' replicas and answers the pipeline with 200."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.post(f"{url}/function/{MODEL}", data=b"x") as resp:
                if resp.status == 200:
                    return
                text = await resp.text()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standalone plugin answers {resp.status}: {text[:300]}")
            await asyncio.sleep(0.2)


def run(stages: int, body_bytes: int, count: int, warmup: int) -> dict:
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="quart-bench-standalone-") as work:
        tmp = Path(work)
        gateway, url, auth = _start_gateway(tmp, plugin=True, env={"QUART_ACTUATOR": "none"})
        standalone = None
        try:
            replicas = [deploy_echo(url, auth, f"{MODEL}-s{i}", _stage_labels(i, stages)) for i in range(stages)]
            standalone, plugin_url = _start_standalone(tmp, url, auth)
            asyncio.run(_first_answer(plugin_url))
            body = os.urandom(body_bytes)
            paths = {"direct": (replicas[0], "/"), "single": (url, f"/function/{MODEL}-s0"),
                     "embedded": (url, f"/function/{MODEL}"), "standalone": (plugin_url, f"/function/{MODEL}")}
            latency = asyncio.run(interleaved_p50(paths, body, count, warmup))
            cpu = {"embedded": asyncio.run(_cpu_ms_per_request(url, body, count, [gateway.pid])),
                   "standalone": asyncio.run(_cpu_ms_per_request(plugin_url, body, count,
                                                                 [gateway.pid, standalone.pid]))}
        finally:
            if standalone is not None:
                stop_process(standalone.pid, standalone)
            stop_process(gateway.pid, gateway)
    direct = latency["p50_direct_ms"]
    added = {front: (latency[f"p50_{front}_ms"] - stages * direct) / stages for front in ("embedded", "standalone")}
    ratio = added["standalone"] / added["embedded"] if added["embedded"] > 0 else None
    return {
        "stages": stages, "body_bytes": body_bytes, "latency_rounds": count, "warmup": warmup,
        **{k: round(v, 4) for k, v in latency.items()},
        "p50_added_per_stage_embedded_ms": round(added["embedded"], 4),
        "p50_added_per_stage_standalone_ms": round(added["standalone"], 4),
        "ratio_standalone_vs_embedded": round(ratio, 3) if ratio is not None else None,
        "p50_added_single_ms": round(latency["p50_single_ms"] - direct, 4),  # one gateway hop, for comparison
        "cpu_ms_per_request": {front: round(v, 4) for front, v in cpu.items()},  # gateway (+ plugin), not replicas
        "cpu_ratio_standalone_vs_embedded": round(cpu["standalone"] / cpu["embedded"], 3) if cpu["embedded"] else None,
        "target_ratio": TARGET_RATIO, "meets_target": ratio is not None and ratio <= TARGET_RATIO,
        "load_start": [round(v, 2) for v in load_start], "load_end": [round(v, 2) for v in os.getloadavg()],
        "machine": machine_info(),
    }


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl bench standalone", description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--requests", type=int, default=1000, help="latency rounds measured (after warm-up)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--body-bytes", type=int, default=1024)
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    args = p.parse_args(argv)
    if args.stages < 1 or args.requests < 1:
        p.error("--stages and --requests must be at least 1")
    write_report(run(args.stages, args.body_bytes, args.requests, max(0, args.warmup)), args.out, always_print=True)
    return 0
