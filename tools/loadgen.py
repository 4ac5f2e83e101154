"""`quartctl load`: an open-loop HTTP load generator.

Open loop: every request is sent at its scheduled time whatever happened to the earlier ones; the
next send never waits for a response. One aiohttp session with keep-alive and a connector sized for
the load, on uvloop. Each request yields a record (intended and actual send time, status, latency,
the per-stage timings the pipeline reports in ``X-Quart-*-Ms`` response headers) and every request
ends with a status or an explicit client-side error (timeout, connection error, run-time bound).
With ``--generate`` the requests are streamed generations (:mod:`quart_tools.genload`) and the records
also carry each stream's tokens, TTFT and TPOT.

Library use (the live policy benchmark): ``generate_load(url, arrivals, ...) -> LoadResult``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import uvloop
from quart_stage import cliargs
from quart_tools.arrivals import DEFAULT_BYTES_PER_TOKEN, Arrivals, make_arrivals
from quart_tools.genload import (
    GenerationWorkload,
    generation_stats,
    make_workload,
    read_stream,
    records_generation,
)
from tqdm import tqdm

STAGE_HEADER_PREFIX = "x-quart-"
STAGE_HEADER_SUFFIX = "-ms"
FD_RESERVE = 128  # file descriptors kept free for everything but client sockets
START_LEAD_S = 0.05  # the schedule starts this long after set-up, so the first sends are on time


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request. Times are seconds from the start of the schedule."""

    id: int
    intended_s: float  # when the schedule said to send it
    sent_s: float  # when its request headers were written (or the send was attempted)
    status: int  # HTTP status; 0 when no response came (see error)
    latency_ms: float  # response complete − sent; NaN without a response
    size_bytes: int
    error: str | None = None  # client-side failure, in words
    stages: dict[str, float] = field(default_factory=dict)  # X-Quart-*-Ms response headers
    # generation loads only (quart_tools.genload): asked-for lengths, tokens streamed, client-side times
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    tokens: int | None = None
    ttft_ms: float | None = None  # send → first token event
    tpot_ms: float | None = None  # mean time between the later tokens

    @property
    def send_error_ms(self) -> float:
        return (self.sent_s - self.intended_s) * 1000.0

    @property
    def ok(self) -> bool:
        """A 2xx answer, and for a stream no error event."""
        return 200 <= self.status < 300 and self.error is None


@dataclass
class LoadResult:
    records: list[RequestRecord]
    wall_s: float  # from the first scheduled send to the last completion

    def achieved_rps(self) -> float:
        """Requests actually sent per second over the span of the send times."""
        if len(self.records) < 2:
            return 0.0
        sent = [r.sent_s for r in self.records if not math.isnan(r.sent_s)]
        span = max(sent) - min(sent) if len(sent) > 1 else 0.0
        return (len(sent) - 1) / span if span > 0 else 0.0

    def send_error_ms(self) -> np.ndarray:
        return np.array([r.send_error_ms for r in self.records], dtype=np.float64)


def parse_stage_headers(headers) -> dict[str, float]:
    """``X-Quart-Stage-3-Wait-Ms: 1.5`` → ``{"stage-3-wait": 1.5}``; non-numbers are skipped."""
    out: dict[str, float] = {}
    for name, value in headers.items():
        low = name.lower()
        if low.startswith(STAGE_HEADER_PREFIX) and low.endswith(STAGE_HEADER_SUFFIX):
            try:
                out[low[len(STAGE_HEADER_PREFIX) : -len(STAGE_HEADER_SUFFIX)]] = float(value)
            except ValueError:
                continue
    return out


def body_maker(kind: str, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN, max_tokens: int = 4096):
    """Return ``size → (body bytes, content type)``, memoised per size.

    ``bytes``: that many zero bytes (octet-stream). ``input-ids``: the pipeline's JSON input,
    ``{"input_ids": [[...]]}`` with size/bytes_per_token token ids (capped at max_tokens).
    """
    cache: dict[int, tuple[bytes, str]] = {}

    def make(size: int) -> tuple[bytes, str]:
        hit = cache.get(size)
        if hit is not None:
            return hit
        if kind == "bytes":
            made = (bytes(size), "application/octet-stream")
        elif kind == "input-ids":
            n = max(1, min(max_tokens, size // max(1, bytes_per_token)))
            ids = [(7 * i + 1) % 1000 for i in range(n)]
            made = (json.dumps({"input_ids": [ids]}).encode(), "application/json")
        else:
            raise ValueError(f"unknown body kind {kind!r}; one of bytes, input-ids")
        cache[size] = made
        return made

    return make


def auto_connections() -> int:
    """Connector size: as many sockets as the process may open (less a reserve).

    Open loop means a request never waits for a free connection: with a slow server every
    outstanding request holds its own keep-alive connection. The soft file limit is raised to the
    hard one first.
    """
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
            soft = max(soft, target)
        return max(64, int(soft) - FD_RESERVE)
    except (ImportError, ValueError, OSError):
        return 1000


async def run_load(
    url: str,
    arrivals: Arrivals,
    *,
    timeout_s: float = 60.0,
    max_run_s: float | None = None,
    connections: int | None = None,
    body: Callable[[int], tuple[bytes, str]] | None = None,
    headers: dict[str, str] | None = None,
    progress: bool | None = None,
    generation: GenerationWorkload | None = None,
) -> LoadResult:
    """Send ``arrivals`` to ``url`` open loop and return one record per request.

    ``timeout_s`` bounds each request (a whole stream included); ``max_run_s`` bounds the whole run
    (default: schedule span + timeout_s): requests still open then are cancelled and recorded with an
    error. With ``generation`` each request is that workload's streamed body and its record carries the
    stream's tokens, TTFT and TPOT.
    """
    if generation is not None and len(generation) != len(arrivals):
        raise ValueError(f"the workload has {len(generation)} requests, the arrivals {len(arrivals)}")
    body = body or body_maker("bytes")
    extra_headers = dict(headers or {})
    n = len(arrivals)
    times = arrivals.times.tolist()
    sizes = arrivals.sizes.tolist()
    records: list[RequestRecord | None] = [None] * n
    sent_at: list[float] = [math.nan] * n
    bodies = [body(s) for s in sorted(set(sizes))]  # build every body before the clock starts
    del bodies
    max_run_s = (arrivals.duration_s + timeout_s + 1.0) if max_run_s is None else max_run_s

    trace_cfg = aiohttp.TraceConfig()

    async def _headers_sent(_session, ctx, _params) -> None:
        idx = ctx.trace_request_ctx
        if idx is not None and math.isnan(sent_at[idx]):
            sent_at[idx] = time.perf_counter()

    trace_cfg.on_request_headers_sent.append(_headers_sent)

    limit = connections or auto_connections()
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60.0)
    session = aiohttp.ClientSession(
        connector=connector,
        trace_configs=[trace_cfg],
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        skip_auto_headers=("User-Agent",),
    )
    bar = tqdm(total=n, desc="requests", unit="req", file=sys.stderr,
               disable=(not sys.stderr.isatty()) if progress is None else not progress, mininterval=0.5)

    # The cyclic GC's pauses (milliseconds with many live records) would show up as late sends:
    # collect now, then keep it off for the run (records hold no cycles) and restore it after.
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    t0 = time.perf_counter() + START_LEAD_S

    async def one(i: int) -> None:
        data, ctype = body(sizes[i]) if generation is None else generation.request(i)
        hdrs = {"Content-Type": ctype, **extra_headers}
        attempt = time.perf_counter()
        status, error, stages, done, timing = 0, None, {}, math.nan, None
        try:
            async with session.post(url, data=data, headers=hdrs, trace_request_ctx=i) as resp:
                if generation is not None and resp.status == 200:
                    sent = sent_at[i] if not math.isnan(sent_at[i]) else attempt
                    timing = await read_stream(resp.content, generation.door, sent)
                    error = timing.error
                else:
                    await resp.read()
                done = time.perf_counter()
                status = resp.status
                stages = parse_stage_headers(resp.headers)
        except asyncio.CancelledError:
            error = f"cancelled: the run reached its bound of {max_run_s:.1f} s"
        except TimeoutError:
            error = f"timeout: no complete response within {timeout_s:.1f} s"
        except aiohttp.ClientError as exc:
            error = f"client error: {type(exc).__name__}: {exc}"
        sent = sent_at[i] if not math.isnan(sent_at[i]) else attempt
        records[i] = RequestRecord(
            id=i,
            intended_s=times[i],
            sent_s=sent - t0,
            status=status,
            latency_ms=(done - sent) * 1000.0 if status else math.nan,
            size_bytes=sizes[i],
            error=error,
            stages=stages,
        )
        if generation is not None:
            rec = records[i]
            rec.prompt_tokens, rec.max_tokens = int(generation.prompt_tokens[i]), int(generation.max_tokens[i])
            if timing is not None:
                rec.tokens, rec.ttft_ms, rec.tpot_ms = timing.tokens, timing.ttft_ms, timing.tpot_ms
        bar.update(1)

    tasks: set[asyncio.Task] = set()
    try:
        i = 0
        while i < n:
            now = time.perf_counter() - t0
            if now >= max_run_s:
                break
            while i < n and times[i] <= now:
                task = asyncio.ensure_future(one(i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
            if i < n:
                delay = min(times[i], max_run_s) - (time.perf_counter() - t0)
                # uvloop timers have 1 ms resolution: sleep just short, then yield until due.
                await asyncio.sleep(delay - 0.001 if delay > 0.0015 else 0)
        for j in range(i, n):  # never sent: the run bound came first
            records[j] = RequestRecord(j, times[j], math.nan, 0, math.nan, sizes[j],
                                       error=f"not sent: the run reached its bound of {max_run_s:.1f} s")
        remaining = max_run_s - (time.perf_counter() - t0)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=max(0.0, remaining))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
    finally:
        bar.close()
        await session.close()
        if gc_was_enabled:
            gc.enable()
    wall = time.perf_counter() - t0
    return LoadResult(records=[r for r in records if r is not None], wall_s=wall)


def generate_load(url: str, arrivals: Arrivals, **kwargs) -> LoadResult:
    """Synchronous wrapper of :func:`run_load` on a fresh uvloop event loop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run_load(url, arrivals, **kwargs))


def write_records(records: list[RequestRecord], path: str | Path) -> None:
    """One JSON object per line; NaN becomes null."""
    with open(path, "w") as fh:
        for rec in records:
            row = asdict(rec)
            for key in ("sent_s", "latency_ms", "ttft_ms", "tpot_ms"):
                if isinstance(row[key], float) and math.isnan(row[key]):
                    row[key] = None
            fh.write(json.dumps(row, separators=(",", ":")) + "\n")


def read_records(path: str | Path) -> list[RequestRecord]:
    """Inverse of :func:`write_records`."""
    out: list[RequestRecord] = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            for key in ("sent_s", "latency_ms"):
                if row.get(key) is None:
                    row[key] = math.nan
            out.append(RequestRecord(**row))
    return out


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl load", description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="where to POST, e.g. http://127.0.0.1:8080/function/bert-21b")
    p.add_argument("--arrivals", choices=("poisson", "gamma", "trace"), default="poisson")
    p.add_argument("--rate", type=float, default=10.0, help="mean requests/s (trace: rescale to it; 0 = real time)")
    p.add_argument("--cv", type=float, default=1.0, help="inter-arrival CV for gamma arrivals")
    p.add_argument("--duration", type=float, default=30.0, help="schedule length in seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, help="trace CSV (default ../shared/traces/AzureLLMInferenceTrace_code.csv)")
    p.add_argument("--speedup", type=float, default=None, help="trace time compression factor (instead of --rate)")
    p.add_argument("--input-bytes", type=int, default=1024, help="body size for poisson/gamma")
    p.add_argument("--body", choices=("bytes", "input-ids"), default="bytes", help="body format")
    p.add_argument("--bytes-per-token", type=int, default=DEFAULT_BYTES_PER_TOKEN)
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    p.add_argument("--max-run", type=float, default=None, help="bound on the whole run, seconds")
    p.add_argument("--connections", type=int, default=None, help="connector size (default: the file-descriptor limit; open loop never waits for a socket)")
    p.add_argument("--header", action="append", default=[], help="extra header NAME:VALUE (repeatable)")
    p.add_argument("--out", default="records.jsonl", help="JSONL file of per-request records")
    p.add_argument("--max-failed", type=float, default=0.0, metavar="FRACTION",
                   help="exit 1 when more than this fraction of requests failed (default 0: any failure; 1: never)")
    g = p.add_argument_group("generation (streamed /v1/completions or /function/<model> bodies; docs/loadgen.md)")
    g.add_argument("--generate", action="store_true", help="send streamed generation requests, record TTFT/TPOT")
    g.add_argument("--model", default="", help="model name for /v1/completions (default for /function: from the URL)")
    g.add_argument("--token-scale", type=float, default=1.0, help="multiply the trace's token counts by this")
    g.add_argument("--output-scale", type=float, default=None, help="multiply its output counts by this instead")
    g.add_argument("--max-context", type=int, default=2048, help="cap on prompt + output tokens")
    g.add_argument("--max-new-tokens", type=int, default=256, help="cap on output tokens")
    g.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for poisson/gamma arrivals")
    g.add_argument("--new-tokens", type=int, default=32, help="output length for poisson/gamma arrivals")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    headers: dict[str, str] = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep:
            print(f"quartctl load: --header {h!r} must be NAME:VALUE", file=sys.stderr)
            return 2
        headers[name.strip()] = value.strip()
    try:
        arrivals = make_arrivals(args.arrivals, args.rate, args.duration, cv=args.cv, seed=args.seed,
                                 input_bytes=args.input_bytes, trace_path=args.trace, speedup=args.speedup,
                                 bytes_per_token=args.bytes_per_token)
        workload = None if not args.generate else make_workload(
            args.url, arrivals, model=args.model, scale=args.token_scale, output_scale=args.output_scale, max_context=args.max_context,
            max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
            temperature=args.temperature)
    except (ValueError, FileNotFoundError) as exc:
        print(f"quartctl load: {exc}", file=sys.stderr)
        return 2
    result = generate_load(args.url, arrivals, timeout_s=args.timeout, max_run_s=args.max_run,
                           connections=args.connections, headers=headers,
                           body=body_maker(args.body, args.bytes_per_token), generation=workload)
    write_records(result.records, args.out)
    ok = sum(r.ok for r in result.records)
    err = result.send_error_ms()
    err = err[~np.isnan(err)]
    p99 = float(np.percentile(err, 99)) if len(err) else math.nan
    failed = Counter(str(r.status or r.error or "error") for r in result.records if not r.ok)
    summary = {"requests": len(result.records), "ok": ok, "failed": dict(failed), "rps": round(result.achieved_rps(), 1),
               "send_error_p99_ms": round(p99, 3), "records": str(args.out)}
    if workload is not None:
        stats = generation_stats(*records_generation(result.records))
        summary.update({k: None if math.isnan(stats[k]) else round(stats[k], 3)
                        for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")})
    print(json.dumps(summary))
    unanswered = [r for r in result.records if r.status == 0]
    if result.records and len(unanswered) == len(result.records):  # nothing listens there: say so, fail
        print(f"quartctl load: no request got an answer from {args.url}: {unanswered[0].error}", file=sys.stderr)
        return 1
    if result.records and len(result.records) - ok > args.max_failed * len(result.records):
        print(f"quartctl load: {len(result.records) - ok} of {len(result.records)} requests failed "
              f"({', '.join(f'{n} × {k}' for k, n in failed.most_common())}); --max-failed {args.max_failed}",
              file=sys.stderr)
        return 1
    return 0
