"""Plots of the equal-cost experiment: mean latency against replica-seconds, one panel per workload."""

from __future__ import annotations

import math
from pathlib import Path

from quart_tools.sim.frontier import frontier_points
from quart_tools.sim.scenario import BASELINES

COLOURS = {b: f"C{i}" for i, b in enumerate(BASELINES)}


def plot_frontier(entries: list[dict], out_dir: str | Path) -> list[Path]:
    """One PNG per model (``frontier-<model>.png``): per workload the static frontier as a line, one point per
    policy (filled: with the KeysManager, hollow: without), QUART and the oracle marked. Returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    models = dict.fromkeys(e["model"] for e in entries)
    for model in models:
        loads = list(dict.fromkeys(e["workload"] for e in entries if e["model"] == model))
        cols = min(3, len(loads))
        rows = math.ceil(len(loads) / cols)
        height = 4.0 * rows + 1.0  # an inch at the bottom for the legend
        fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, height), squeeze=False)
        for ax, load in zip(axes.flat, loads, strict=False):
            mine = [e for e in entries if e["workload"] == load and _finite(e["mean_ms"], e["replica_seconds"])]
            front = frontier_points([e for e in mine if e["table"] == "km"])
            ax.plot([c for c, _ in front], [m for _, m in front], "-", color="0.55", lw=1.5, label="static-k")
            for e in mine:
                x, y, p = e["replica_seconds"], e["mean_ms"], e["policy"]
                if p.startswith("static-"):
                    ax.plot(x, y, "o", color="0.55", ms=4)
                    ax.annotate(p.split("-")[1], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
                elif p == "quart":
                    ax.plot(x, y, "D", color="tab:red", ms=8, label="quart")
                elif p == "oracle":
                    ax.plot(x, y, "*", color="tab:green", ms=13, label="oracle")
                else:
                    km = e["table"] == "km"
                    ax.plot(x, y, "o", ms=6, color=COLOURS.get(p), mfc=None if km else "none",
                            label=p if km else f"{p} (no-km)")
            ax.set_yscale("log")
            ax.set_title(load, fontsize=10)
            ax.set_xlabel("replica-seconds")
            ax.set_ylabel("mean latency (ms)")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(loads):]:
            ax.axis("off")
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(7, len(labels)), fontsize=8)
        fig.tight_layout(rect=(0, 1.0 / height, 1, 1))
        path = out / f"frontier-{model}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def plot_seeds(rows: list[dict], path: str | Path) -> Path:
    """QUART over seeds (``over_seeds`` rows of one or more frontier documents): per workload QUART / static frontier
    and QUART / oracle on every seed (dots), their mean (bar) and issue 32's targets (dashed). Returns the file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [r["workload"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.1 * len(rows) + 3), 4.2))
    panels = (("quart_over_frontier", "QUART / static frontier", (1.0, 1.1)), ("quart_over_oracle", "QUART / oracle", (1.15,)))
    for ax, (key, title, targets) in zip(axes, panels, strict=True):
        for i, r in enumerate(rows):
            vals = [v for v in r[f"{key}_by_seed"].values() if _finite(v)]
            ax.bar(i, r[f"{key}_mean"] or 0.0, color="0.85", width=0.6)
            ax.plot([i] * len(vals), vals, "o", color="tab:red", ms=4)
        for t in targets:
            ax.axhline(t, ls="--", color="0.4", lw=1)
        lows = [v for r in rows for v in r[f"{key}_by_seed"].values() if _finite(v)]
        ax.set_ylim(min([0.9, *lows]) * 0.95, max([1.2, *lows]) * 1.03)
        ax.set_xticks(range(len(rows)), names, rotation=40, ha="right", fontsize=8)
        ax.set_title(f"{title} (bar: mean over seeds, dots: seeds)", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finite(*xs) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) for x in xs)
