"""Arrival schedules: when each request is sent and how big its input is.

Pure functions of their arguments (a seed makes them repeatable): Poisson and gamma arrivals with a
target rate and coefficient of variation (CV), and replay of the Azure LLM inference trace
(``../shared/traces/AzureLLMInferenceTrace_code.csv``) with time compression or rate scaling. The
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
