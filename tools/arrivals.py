"""Arrival schedules: when each request is sent and how big its input is.

Pure functions of their arguments (a seed makes them repeatable): Poisson and gamma arrivals with a
target rate and coefficient of variation (CV), and replay of the Azure LLM inference trace
(``../shared/traces/AzureLLMInferenceTrace_code.csv``): the whole trace compressed in time (``replay_trace``), or
a window of it at its own time scale with the rate matched by thinning or replicating (``trace_window``). The
load generator, the live policy benchmark and the simulator all draw their arrivals from here, so
live and simulated runs see the very same request sequence.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "AzureLLMInferenceTrace_code.csv"
DEFAULT_INPUT_BYTES = 1024  # body size of a synthetic (Poisson/gamma) request
DEFAULT_BYTES_PER_TOKEN = 4  # int32 token ids: what a stage-0 request carries per context token


@dataclass(frozen=True)
class Arrivals:
    """A request schedule: send times (seconds from the start, ascending) and input sizes."""

    times: np.ndarray  # float64 seconds, ascending, first ≥ 0
    sizes: np.ndarray  # int64 input bytes per request
    tokens: np.ndarray | None = None  # int64 context tokens per request (trace replay only)
    generated: np.ndarray | None = None  # int64 generated tokens per request (trace replay only)
    kind: str = ""  # "poisson" | "gamma" | "trace"

    def __len__(self) -> int:
        return len(self.times)

    @property
    def duration_s(self) -> float:
        return float(self.times[-1]) if len(self.times) else 0.0

    def rate(self) -> float:
        """Mean arrival rate over the schedule (requests/s)."""
        return (len(self.times) - 1) / self.duration_s if len(self.times) > 1 and self.duration_s > 0 else 0.0

    def cv(self) -> float:
        """Coefficient of variation of the inter-arrival times."""
        return interarrival_cv(self.times)


def interarrival_cv(times: np.ndarray) -> float:
    """std/mean of the gaps between consecutive times; 0.0 with fewer than three times."""
    gaps = np.diff(np.asarray(times, dtype=np.float64))
    if len(gaps) < 2 or gaps.mean() <= 0:
        return 0.0
    return float(gaps.std() / gaps.mean())


def _fixed_sizes(n: int, input_bytes: int) -> np.ndarray:
    return np.full(n, int(input_bytes), dtype=np.int64)


def gamma_arrivals(
    rate: float,
    cv: float,
    duration_s: float,
    seed: int = 0,
    input_bytes: int = DEFAULT_INPUT_BYTES,
) -> Arrivals:
    """Renewal process with gamma inter-arrival times of mean 1/rate and the given CV.

    Shape k = 1/CV², scale = 1/(rate·k); CV = 1 is Poisson. Times lie in [0, duration_s).
    """
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if cv <= 0:
        raise ValueError(f"cv must be positive, got {cv}")
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    expected = rate * duration_s
    chunks: list[np.ndarray] = []
    start = 0.0
    # Draw in chunks until past the horizon (high CV can need many more draws than the mean).
    chunk = int(expected + 10 * np.sqrt(expected) + 16)
    while start < duration_s:
        gaps = rng.gamma(shape, scale, size=chunk)
        times = start + np.cumsum(gaps)
        chunks.append(times)
        start = float(times[-1])
    times = np.concatenate(chunks)
    times = times - times[0]  # the schedule starts with a request at t = 0
    times = times[times < duration_s]
    return Arrivals(times=times, sizes=_fixed_sizes(len(times), input_bytes), kind="gamma")


def poisson_arrivals(
    rate: float, duration_s: float, seed: int = 0, input_bytes: int = DEFAULT_INPUT_BYTES
) -> Arrivals:
    """Poisson process (exponential inter-arrival times, CV 1) of the given rate."""
    arr = gamma_arrivals(rate, 1.0, duration_s, seed=seed, input_bytes=input_bytes)
    return Arrivals(times=arr.times, sizes=arr.sizes, kind="poisson")


@dataclass(frozen=True)
class Trace:
    """The raw trace: seconds since its first request, context and generated tokens."""

    offsets_s: np.ndarray
    context_tokens: np.ndarray
    generated_tokens: np.ndarray

    def rate(self) -> float:
        span = float(self.offsets_s[-1]) if len(self.offsets_s) else 0.0
        return (len(self.offsets_s) - 1) / span if span > 0 else 0.0


def _parse_timestamp(text: str) -> float:
    """'2023-11-16 18:17:03.9799600' → POSIX seconds (7-digit fractions are cut to microseconds)."""
    head, _, frac = text.strip().partition(".")
    stamp = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)


def load_trace(path: str | Path = DEFAULT_TRACE) -> Trace:
    """Read an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist; pass --trace PATH")
    stamps: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise ValueError(f"trace {path} must have columns {sorted(need)}, found {reader.fieldnames}")
        for line_no, row in enumerate(reader, start=2):
            try:
                stamps.append(_parse_timestamp(row["TIMESTAMP"]))
                ctx.append(int(row["ContextTokens"]))
                gen.append(int(row["GeneratedTokens"]))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"trace {path} line {line_no}: cannot parse {row!r}: {exc}") from exc
    if not stamps:
        raise ValueError(f"trace {path} holds no requests")
    order = np.argsort(np.asarray(stamps), kind="stable")
    t = np.asarray(stamps, dtype=np.float64)[order]
    return Trace(
        offsets_s=t - t[0],
        context_tokens=np.asarray(ctx, dtype=np.int64)[order],
        generated_tokens=np.asarray(gen, dtype=np.int64)[order],
    )


def replay_trace(
    trace: Trace,
    speedup: float | None = None,
    target_rate: float | None = None,
    duration_s: float | None = None,
    start_s: float = 0.0,
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN,
    loop: bool = False,
) -> Arrivals:
    """Replay the trace's timestamps, compressed in time.

    ``speedup`` divides every gap (2.0 = twice the rate); ``target_rate`` picks the speed-up that
    gives this mean rate (give at most one of the two; neither = real time). ``start_s`` skips into
    the trace (in trace seconds), ``duration_s`` cuts the replay (in replay seconds); with ``loop``
    the trace repeats until ``duration_s`` is filled. Sizes are context tokens × ``bytes_per_token``;
    ``tokens`` and ``generated`` carry the trace's ContextTokens and GeneratedTokens.
    """
    if speedup is not None and target_rate is not None:
        raise ValueError("give speedup or target_rate, not both")
    base_rate = trace.rate()
    if target_rate is not None:
        if target_rate <= 0 or base_rate <= 0:
            raise ValueError(f"target_rate must be positive and the trace must span time (rate {base_rate})")
        speedup = target_rate / base_rate
    speedup = 1.0 if speedup is None else float(speedup)
    if speedup <= 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    keep = trace.offsets_s >= start_s
    offsets = (trace.offsets_s[keep] - start_s) / speedup
    ctx = trace.context_tokens[keep]
    gen = trace.generated_tokens[keep]
    if len(offsets) == 0:
        raise ValueError(f"start_s={start_s} is past the end of the trace")
    if loop and duration_s is not None:
        span = float(offsets[-1]) + (1.0 / (base_rate * speedup) if base_rate > 0 else 0.0)
        reps = int(np.ceil(duration_s / span)) if span > 0 else 1
        offsets = np.concatenate([offsets + i * span for i in range(reps)])
        ctx, gen = np.tile(ctx, reps), np.tile(gen, reps)
    if duration_s is not None:
        cut = offsets < duration_s
        offsets, ctx, gen = offsets[cut], ctx[cut], gen[cut]
    return Arrivals(
        times=offsets.astype(np.float64),
        sizes=(ctx * int(bytes_per_token)).astype(np.int64),
        tokens=ctx.astype(np.int64),
        generated=gen.astype(np.int64),
        kind="trace",
    )


TRACE_WINDOWS = ("busy", "quiet", "step")  # the windows `trace_window` picks: most arrivals, fewest, largest rate step


def pick_window(trace: Trace, kind: str, duration_s: float, step_s: float = 60.0, min_requests: int = 100) -> float:
    """Start (trace seconds) of the ``duration_s`` window of the trace that is ``kind``: ``busy`` (most arrivals),
    ``quiet`` (fewest, among windows with ≥ ``min_requests``), ``step`` (largest change of rate between its halves,
    relative to its mean). Windows start on a ``step_s`` grid and lie inside the trace."""
    if kind not in TRACE_WINDOWS:
        raise ValueError(f"unknown trace window {kind!r}; one of {', '.join(TRACE_WINDOWS)}")
    span = float(trace.offsets_s[-1]) if len(trace.offsets_s) else 0.0
    if duration_s <= 0 or duration_s > span:
        raise ValueError(f"window of {duration_s} s does not fit in the trace ({span:.0f} s)")
    starts = np.arange(0.0, span - duration_s + 1e-9, step_s)
    o = trace.offsets_s
    count = np.searchsorted(o, starts + duration_s) - np.searchsorted(o, starts)
    if kind == "busy":
        return float(starts[int(np.argmax(count))])
    ok = count >= min_requests
    if not ok.any():
        raise ValueError(f"no {duration_s} s window of the trace holds {min_requests} requests")
    if kind == "quiet":
        return float(starts[ok][int(np.argmin(count[ok]))])
    half = np.searchsorted(o, starts + duration_s / 2) - np.searchsorted(o, starts)
    jump = np.where(ok, np.abs((count - half) - half) / np.maximum(count, 1), -1.0)
    return float(starts[int(np.argmax(jump))])


def trace_window(trace: Trace, start_s: float, duration_s: float, target_rate: float, seed: int = 0,
                 peak_rate: float | None = None, peak_window_s: float = 60.0,
                 bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN) -> Arrivals:
    """The trace from ``start_s`` for ``duration_s`` seconds at its own time scale (no compression, no loop), its
    mean rate matched to ``target_rate`` — or lower, so that no ``peak_window_s`` of it exceeds ``peak_rate`` (a
    window whose requests come in a few bursts would otherwise ask more than the cluster serves) — by thinning (keep each request with probability scale < 1) or replicating
    (⌊scale⌋ copies of each, one more with the fractional probability; copies spread uniformly over the gap to the
    next request, so the local rate is multiplied, not stacked at one instant). Seeded: repeatable."""
    if target_rate <= 0:
        raise ValueError(f"target_rate must be positive, got {target_rate}")
    o = trace.offsets_s
    keep = (o >= start_s) & (o < start_s + duration_s)
    t, ctx, gen = o[keep] - start_s, trace.context_tokens[keep], trace.generated_tokens[keep]
    if len(t) < 2:
        raise ValueError(f"the trace holds {len(t)} request(s) in [{start_s}, {start_s + duration_s}) s")
    scale = target_rate * duration_s / len(t)
    if peak_rate is not None:
        peak = np.bincount((t // peak_window_s).astype(np.int64)).max() / peak_window_s
        scale = min(scale, peak_rate / peak)
    rng = np.random.default_rng(seed)
    copies = np.floor(scale).astype(np.int64) + (rng.random(len(t)) < scale - np.floor(scale))
    gaps = np.diff(np.append(t, duration_s))
    idx = np.repeat(np.arange(len(t)), copies)
    first = np.concatenate([[0], np.cumsum(copies)[:-1]])
    is_copy = np.arange(len(idx)) != np.repeat(first, copies)  # the first copy keeps the trace's time
    times = t[idx] + np.where(is_copy, rng.random(len(idx)) * gaps[idx], 0.0)
    order = np.argsort(times, kind="stable")
    times, tokens, generated = times[order], ctx[idx][order], gen[idx][order]
    return Arrivals(times=times.astype(np.float64), sizes=(tokens * int(bytes_per_token)).astype(np.int64),
                    tokens=tokens.astype(np.int64), generated=generated.astype(np.int64), kind="trace")


def make_arrivals(
    kind: str,
    rate: float,
    duration_s: float,
    cv: float = 1.0,
    seed: int = 0,
    input_bytes: int = DEFAULT_INPUT_BYTES,
    trace_path: str | Path | None = None,
    speedup: float | None = None,
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN,
) -> Arrivals:
    """One entry point for the CLIs: ``kind`` is ``poisson``, ``gamma`` or ``trace``.

    For ``trace``, ``rate`` > 0 rescales the trace to that mean rate unless ``speedup`` is given;
    the replay loops to fill ``duration_s``.
    """
    if kind == "poisson":
        return poisson_arrivals(rate, duration_s, seed=seed, input_bytes=input_bytes)
    if kind == "gamma":
        return gamma_arrivals(rate, cv, duration_s, seed=seed, input_bytes=input_bytes)
    if kind == "trace":
        trace = load_trace(trace_path or DEFAULT_TRACE)
        return replay_trace(
            trace,
            speedup=speedup,
            target_rate=None if speedup is not None or rate <= 0 else rate,
            duration_s=duration_s,
            bytes_per_token=bytes_per_token,
            loop=True,
        )
    raise ValueError(f"unknown arrival kind {kind!r}; one of poisson, gamma, trace")
