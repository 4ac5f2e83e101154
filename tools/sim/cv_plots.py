"""Plots of the CV sweep (fig7) and the trace runs (fig6): each policy's p99 latency and SLO attainment."""

from __future__ import annotations

from pathlib import Path

from quart_tools.report import GOODPUT_SLO_MULTIPLIER, slo_key

SLO = slo_key(GOODPUT_SLO_MULTIPLIER)  # attainment within 1.5 x the profiled time, as goodput counts it


def plot_policy_sweep(entries: list[dict], out_dir: str | Path, experiment: str) -> list[Path]:
    """One PNG per model (``<experiment>-<model>.png``): p99 latency (log) and SLO attainment per policy,
    against the arrival CV when the entries have one (fig7), else one bar per policy (fig6). Returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for model in dict.fromkeys(e["model"] for e in entries):
        rows = [e for e in entries if e["model"] == model]
        policies = list(dict.fromkeys(e["policy"] for e in rows))
        fig, (lat_ax, slo_ax) = plt.subplots(1, 2, figsize=(11, 4))
        swept = all(e.get("target_cv") is not None for e in rows)
        for i, policy in enumerate(policies):
            mine = sorted((e for e in rows if e["policy"] == policy), key=lambda e: e.get("target_cv") or 0)
            if swept:
                cvs = [e["target_cv"] for e in mine]
                lat_ax.plot(cvs, [e["p99_ms"] for e in mine], marker="o", label=policy, color=f"C{i}")
                slo_ax.plot(cvs, [e["slo_attainment"][SLO] for e in mine], marker="o", label=policy, color=f"C{i}")
            else:
                lat_ax.bar(i, mine[0]["p99_ms"], color=f"C{i}", label=policy)
                slo_ax.bar(i, mine[0]["slo_attainment"][SLO], color=f"C{i}", label=policy)
        lat_ax.set_yscale("log")
        lat_ax.set_ylabel("p99 latency (ms)")
        slo_ax.set_ylabel(f"SLO attainment ({SLO})")
        slo_ax.set_ylim(0, 1.05)
        for ax in (lat_ax, slo_ax):
            ax.set_xlabel("arrival CV" if swept else "policy")
            if not swept:
                ax.set_xticks(range(len(policies)), policies, rotation=30, ha="right")
            ax.grid(alpha=0.3)
        lat_ax.legend(fontsize=8)
        fig.suptitle(f"{experiment}: {model}")
        fig.tight_layout()
        path = out / f"{experiment}-{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
