"""`quartctl report`: latency, SLO attainment, goodput, replica-seconds and queues from records.

The computation functions are pure (arrays in, numbers out) so the live policy benchmark and the
simulator build their reports with exactly the same math. One report entry per policy carries the
keys ``policy, mean_ms, p50_ms, p75_ms, p99_ms, slo_attainment {"1.0".."3.0"}, goodput_rps,
replica_seconds, queue_mean_by_stage`` (plus ``cv_by_stage`` and counts when known); generation records
add ``generation`` (TTFT/TPOT p50/p90/p99 and SLO attainment, :func:`generation_stats`).

Time series (replicas and queue per stage over time) are samples ``{t, stage, replicas, queue}``;
a sample holds until the next one of the same stage (a step function).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from quart_stage import cliargs
from quart_tools.genload import generation_stats, records_generation

SLO_MULTIPLIERS: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0)
GOODPUT_SLO_MULTIPLIER = 1.5  # goodput counts requests within 1.5× the profiled time by default


@dataclass(frozen=True, slots=True)
class StageSample:
    """State of one stage at one instant (a step-function sample)."""

    t: float
    stage: int
    replicas: float
    queue: float


def slo_key(multiplier: float) -> str:
    return f"{multiplier:.1f}"


def latency_stats(latencies_ms: Sequence[float] | np.ndarray) -> dict[str, float]:
    """mean/p50/p75/p99 of the latencies of completed requests (NaNs ignored); NaN when empty."""
    lat = np.asarray(latencies_ms, dtype=np.float64)
    lat = lat[~np.isnan(lat)]
    if len(lat) == 0:
        return {"mean_ms": math.nan, "p50_ms": math.nan, "p75_ms": math.nan, "p99_ms": math.nan}
    p50, p75, p99 = np.percentile(lat, [50, 75, 99])
    return {"mean_ms": float(lat.mean()), "p50_ms": float(p50), "p75_ms": float(p75), "p99_ms": float(p99)}


def slo_attainment(
    latencies_ms: Sequence[float] | np.ndarray,
    profiled_ms: float,
    multipliers: Iterable[float] = SLO_MULTIPLIERS,
    n_total: int | None = None,
) -> dict[str, float]:
    """Fraction of ALL requests answered within k × profiled_ms, per k.

    Failed requests (NaN latency, or the difference between ``n_total`` and the latencies given)
    count as misses.
    """
    if profiled_ms <= 0:
        raise ValueError(f"profiled_ms must be positive, got {profiled_ms}")
    lat = np.asarray(latencies_ms, dtype=np.float64)
    total = len(lat) if n_total is None else int(n_total)
    ok = np.sort(lat[~np.isnan(lat)])
    out: dict[str, float] = {}
    for k in multipliers:
        met = int(np.searchsorted(ok, k * profiled_ms, side="right"))
        out[slo_key(k)] = met / total if total else math.nan
    return out


def goodput_rps(
    latencies_ms: Sequence[float] | np.ndarray,
    profiled_ms: float,
    duration_s: float,
    multiplier: float = GOODPUT_SLO_MULTIPLIER,
) -> float:
    """Requests per second that met the SLO (k × profiled_ms) over a run of ``duration_s``."""
    if duration_s <= 0:
        return math.nan
    lat = np.asarray(latencies_ms, dtype=np.float64)
    return float(np.count_nonzero(lat <= multiplier * profiled_ms)) / duration_s


def _by_stage(samples: Iterable[StageSample | Mapping]) -> dict[int, list[StageSample]]:
    out: dict[int, list[StageSample]] = {}
    for s in samples:
        if not isinstance(s, StageSample):
            s = StageSample(float(s["t"]), int(s["stage"]), float(s["replicas"]), float(s["queue"]))
        out.setdefault(s.stage, []).append(s)
    for rows in out.values():
        rows.sort(key=lambda x: x.t)
    return out


def _step_integral(ts: np.ndarray, values: np.ndarray, start: float, end: float) -> float:
    """∫ of a right-continuous step function (value[k] on [ts[k], ts[k+1])) over [start, end]."""
    if len(ts) == 0 or end <= start:
        return 0.0
    edges = np.clip(np.append(ts, end), start, end)
    return float(np.sum(values * np.diff(edges)))


def replica_seconds(samples: Iterable[StageSample | Mapping], end_s: float | None = None) -> float:
    """Σ over stages of ∫ replicas dt, from each stage's first sample to ``end_s`` (or its last)."""
    total = 0.0
    for rows in _by_stage(samples).values():
        ts = np.array([r.t for r in rows])
        end = ts[-1] if end_s is None else end_s
        total += _step_integral(ts, np.array([r.replicas for r in rows]), ts[0], end)
    return total


def queue_mean_by_stage(samples: Iterable[StageSample | Mapping], end_s: float | None = None) -> dict[str, float]:
    """Time-weighted mean queue length per stage (keys are stage indices as strings)."""
    out: dict[str, float] = {}
    for stage, rows in sorted(_by_stage(samples).items()):
        ts = np.array([r.t for r in rows])
        end = ts[-1] if end_s is None else end_s
        q = np.array([r.queue for r in rows])
        span = end - ts[0]
        out[str(stage)] = _step_integral(ts, q, ts[0], end) / span if span > 0 else float(q.mean())
    return out


def cv_by_stage(arrival_times_by_stage: Mapping[int, Sequence[float] | np.ndarray]) -> dict[str, float]:
    """CV of inter-arrival times at each stage's queue."""
    from quart_tools.arrivals import interarrival_cv

    return {str(k): interarrival_cv(np.sort(np.asarray(v, dtype=np.float64)))
            for k, v in sorted(arrival_times_by_stage.items())}


def build_report(
    policy: str,
    latencies_ms: Sequence[float] | np.ndarray,
    profiled_ms: float,
    duration_s: float,
    n_total: int | None = None,
    samples: Iterable[StageSample | Mapping] | None = None,
    stage_arrivals: Mapping[int, Sequence[float]] | None = None,
    goodput_multiplier: float = GOODPUT_SLO_MULTIPLIER,
    end_s: float | None = None,
) -> dict:
    """One report entry (the keys the policy benchmark and the simulator share)."""
    lat = np.asarray(latencies_ms, dtype=np.float64)
    total = len(lat) if n_total is None else int(n_total)
    samples = list(samples or [])
    entry: dict = {"policy": policy}
    entry.update(latency_stats(lat))
    entry["slo_attainment"] = slo_attainment(lat, profiled_ms, n_total=total)
    entry["goodput_rps"] = goodput_rps(lat, profiled_ms, duration_s, goodput_multiplier)
    entry["replica_seconds"] = replica_seconds(samples, end_s) if samples else None
    entry["queue_mean_by_stage"] = queue_mean_by_stage(samples, end_s) if samples else {}
    if stage_arrivals:
        entry["cv_by_stage"] = cv_by_stage(stage_arrivals)
    entry["requests"] = total
    entry["completed"] = int(np.count_nonzero(~np.isnan(lat)))
    entry["profiled_ms"] = profiled_ms
    entry["goodput_slo_multiplier"] = goodput_multiplier
    return entry


def json_safe(value):
    """NaN/inf → None, recursively, so the report is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def records_latencies(records) -> tuple[np.ndarray, np.ndarray, int]:
    """(latency_ms with NaN for failures and non-2xx, intended send times, count) from loadgen records."""
    lat = np.array([r.latency_ms if r.ok else math.nan for r in records], dtype=np.float64)
    sent = np.array([r.intended_s for r in records], dtype=np.float64)
    return lat, sent, len(records)


def load_samples(path: str | Path) -> list[StageSample]:
    """Time series JSONL: one ``{"t", "stage", "replicas", "queue"}`` object per line."""
    out = []
    with open(path) as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                out.append(StageSample(float(row["t"]), int(row["stage"]), float(row["replicas"]), float(row["queue"])))
            except KeyError as exc:
                raise ValueError(f"{path} line {line_no}: a sample needs t, stage, replicas, queue; missing {exc}") from exc
    return out


# ----------------------------------------------------------------------------------------- plots


def plot_latency_cdf(latencies_by_policy: Mapping[str, np.ndarray], path: str | Path, profiled_ms: float | None = None,
                     title: str = "Latency CDF") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, lat in latencies_by_policy.items():
        lat = np.sort(np.asarray(lat, dtype=np.float64)[~np.isnan(lat)])
        if len(lat):
            ax.plot(lat, np.arange(1, len(lat) + 1) / len(lat), label=name)
    if profiled_ms:
        for k in (1.0, 1.5, 3.0):
            ax.axvline(k * profiled_ms, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_generation_cdf(by_policy: Mapping[str, tuple[np.ndarray, np.ndarray]], path: str | Path,
                        ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> None:
    """Two panels: the CDF of TTFT and of TPOT per policy, SLOs as vertical lines."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for idx, (label, slo) in enumerate((("TTFT", ttft_slo_ms), ("TPOT", tpot_slo_ms))):
        ax = axes[idx]
        for name, pair in by_policy.items():
            vals = np.sort(pair[idx][~np.isnan(pair[idx])])
            if len(vals):
                ax.plot(vals, np.arange(1, len(vals) + 1) / len(vals), label=name)
        if slo:
            ax.axvline(slo, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of streams")
        ax.set_title(f"{label} CDF")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_arrivals(times_s: np.ndarray, path: str | Path, bin_s: float = 1.0, title: str = "Arrivals") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times_s = np.asarray(times_s, dtype=np.float64)
    fig, ax = plt.subplots(figsize=(7, 3))
    if len(times_s):
        bins = np.arange(0.0, times_s.max() + bin_s, bin_s)
        counts, edges = np.histogram(times_s, bins=bins)
        ax.step(edges[:-1], counts / bin_s, where="post")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"requests/s ({bin_s:g} s bins)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stage_series(samples: Iterable[StageSample | Mapping], path: str | Path, title: str = "Stages") -> None:
    """Two panels: replicas per stage and queue length per stage over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_q) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for stage, rows in sorted(_by_stage(samples).items()):
        ts = [r.t for r in rows]
        ax_r.step(ts, [r.replicas for r in rows], where="post", label=f"stage {stage}", lw=0.9)
        ax_q.step(ts, [r.queue for r in rows], where="post", lw=0.9)
    ax_r.set_ylabel("replicas")
    ax_q.set_ylabel("queue length")
    ax_q.set_xlabel("time (s)")
    ax_r.set_title(title)
    ax_r.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- CLI


def _profiled_ms(args) -> float:
    if args.profiled_ms:
        return float(args.profiled_ms)
    from quart_tools.sim.calibration import PAPER_MODELS

    if args.model not in PAPER_MODELS:
        raise ValueError(f"unknown model {args.model!r}; give --profiled-ms or one of {', '.join(PAPER_MODELS)}")
    return PAPER_MODELS[args.model].exec_ms


def main(argv: list[str]) -> int:
    if argv[:1] == ["benchmarks"]:  # `quartctl report benchmarks`: docs/benchmarks.md's tables from docs/data
        from quart_tools.report_benchmarks import main as benchmarks

        return benchmarks(argv[1:])
    p = cliargs.ArgumentParser(prog="quartctl report", description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="loadgen JSONL records, as PATH or POLICY=PATH")
    p.add_argument("--profiled-ms", type=float, default=None, help="the model's profiled time (SLO 1.0×)")
    p.add_argument("--model", default="bert-21b", help="paper model whose Table 1 time is the SLO base")
    p.add_argument("--timeseries", action="append", default=[],
                   help="stage samples JSONL as PATH or POLICY=PATH (t, stage, replicas, queue)")
    p.add_argument("--goodput-slo", type=float, default=GOODPUT_SLO_MULTIPLIER, help="SLO multiple for goodput")
    p.add_argument("--out", default=None, help="report JSON (default stdout)")
    p.add_argument("--plots", default=None, help="folder for PNG plots")
    p.add_argument("--ttft-slo-ms", type=float, default=None, help="generation records: TTFT SLO (ms)")
    p.add_argument("--tpot-slo-ms", type=float, default=None, help="generation records: TPOT SLO (ms)")
    args = p.parse_args(argv)

    from quart_tools.loadgen import read_records

    try:
        profiled = _profiled_ms(args)
        series = {}
        for item in args.timeseries:
            name, sep, path = item.rpartition("=")
            series[name if sep else ""] = load_samples(path)
        entries, lat_by_policy, gen_by_policy = [], {}, {}
        for item in args.records:
            name, sep, path = item.rpartition("=")
            name = name if sep else Path(path).stem
            records = read_records(path)
            if not records:
                raise ValueError(f"{path} holds no records")
            lat, sent, total = records_latencies(records)
            duration = float(np.nanmax(sent)) if len(sent) else 0.0
            samples = series.get(name) or series.get("") or []
            entries.append(build_report(name, lat, profiled, duration, n_total=total, samples=samples,
                                        goodput_multiplier=args.goodput_slo))
            lat_by_policy[name] = lat
            gen = records_generation(records)
            if gen is not None:
                entries[-1]["generation"] = generation_stats(*gen, args.ttft_slo_ms, args.tpot_slo_ms)
                gen_by_policy[name] = (np.where(gen[2], gen[0], math.nan), np.where(gen[2], gen[1], math.nan))
            if args.plots:
                Path(args.plots).mkdir(parents=True, exist_ok=True)
                plot_arrivals(sent, Path(args.plots) / f"arrivals-{name}.png", title=f"Arrivals ({name})")
                if samples:
                    plot_stage_series(samples, Path(args.plots) / f"stages-{name}.png", title=name)
        if args.plots:
            plot_latency_cdf(lat_by_policy, Path(args.plots) / "latency-cdf.png", profiled)
            if gen_by_policy:
                plot_generation_cdf(gen_by_policy, Path(args.plots) / "ttft-tpot-cdf.png", args.ttft_slo_ms,
                                    args.tpot_slo_ms)
    except (ValueError, FileNotFoundError, json.JSONDecodeError) as exc:
        print(f"quartctl report: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(json_safe(entries), indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0
