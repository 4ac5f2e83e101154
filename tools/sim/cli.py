"""`quartctl simulate`: one simulated run, or a paper experiment, written as JSON.

    quartctl simulate --model bert-21b --system quart --cv 4 --duration 600          # one run
    quartctl simulate --experiment fig7 --out fig7.json                             # CV sweep
    quartctl simulate --experiment fig6|fig2|ablations|all --out FILE [--plots DIR]
    quartctl simulate --experiment frontier --out FILE [--plots DIR] [--quick]    # equal cost (issue 15)
    quartctl simulate --experiment frontier --seeds 0,1,2,3,4 [--only-trace] ...  # mean and worst over seeds
    quartctl simulate --experiment ablation --out FILE [--reuse FRONTIER]         # QUART's parts one at a time
    quartctl simulate --experiment blitzscale --out FILE [--plots DIR]            # start modes (issues 16, 17)
    quartctl simulate --experiment blitzscale --workload generation --out FILE    # ... on TTFT / TBT (issue 29)
    quartctl simulate --experiment paraserve --out FILE [--plots DIR]             # ParaServe fabric, TTFT / TPOT
    quartctl simulate --experiment generation --out FILE [--plots DIR]            # TTFT/TPOT SLOs (issue 32)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from quart_stage import cliargs
from quart_tools.arrivals import DEFAULT_TRACE, gamma_arrivals, load_trace, replay_trace
from quart_tools.report import json_safe, plot_arrivals, plot_latency_cdf, plot_stage_series
from quart_tools.sim import experiments as ex
from quart_tools.sim.batching import DEFAULT_FIXED
from quart_tools.sim.batching import DEFAULT_MAX as DEFAULT_BATCH_MAX
from quart_tools.sim.calibration import PAPER_MODELS, Calibration

DEFAULT_LOAD = 0.4  # mean rate as a fraction of what the whole cluster sustains for the model
EXPERIMENTS = ("run", "fig2", "fig6", "fig7", "ablations", "frontier", "quart-ablation", "ablation", "blitzscale",
               "paraserve", "generation", "all")
OWN_MODELS = ("blitzscale", "paraserve", "generation")  # experiments whose --models default is their own


def _parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(prog="quartctl simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment", choices=EXPERIMENTS, default="run")
    p.add_argument("--model", default="bert-21b", choices=sorted(PAPER_MODELS), help="model of a single run")
    p.add_argument("--models", default=None,
                   help="models of an experiment (comma list; default: the paper's, blitzscale: Llama-2/3)")
    p.add_argument("--system", default="quart",
                   help="policy of a single run: a policy name, quart-no-km or <baseline>+km")
    p.add_argument("--systems", default=None, help="systems of an experiment (comma list; default all policies)")
    p.add_argument("--arrivals", choices=("gamma", "trace"), default="gamma", help="single run: arrival process")
    p.add_argument("--cv", type=float, default=1.0, help="single run: gamma inter-arrival CV")
    p.add_argument("--cvs", default=",".join(str(c) for c in ex.FIG7_CVS), help="fig7: CVs (comma list)")
    p.add_argument("--rate", type=float, default=None, help="mean requests/s (default: --load × capacity)")
    p.add_argument("--load", type=float, default=DEFAULT_LOAD, help="mean rate / cluster capacity for the model")
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals per run")
    p.add_argument("--quick", action="store_true", help="frontier: 30 simulated seconds per run (tests, smoke runs)")
    p.add_argument("--no-trace", action="store_true", help="frontier: gamma workloads only")
    p.add_argument("--reuse", default=None,
                   help="frontier: earlier output of the same configuration; its baseline and static-k entries are "
                        "kept, only QUART and the oracle run again")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="trace CSV for fig6 / --arrivals trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None,
                   help="frontier, quart-ablation: seeds (comma list, e.g. 0,1,2,3,4); entries carry their seed and "
                        "the summary gives mean and worst per workload (default: --seed)")
    p.add_argument("--only-trace", action="store_true", help="frontier, quart-ablation: the trace workloads alone")
    p.add_argument("--quart-config", default="",
                   help="JSON settings for QUART's make_policy (diagnostics, e.g. a shorter cooldown)")
    p.add_argument("--max-replicas", type=int, default=0,
                   help="per-stage replica cap (com.openfaas.scale.max) of every system; 0 = 2 × GPUs / stages")
    p.add_argument("--batching", action="store_true",
                   help="replicas serve batches of what waits (the router's dynamic batching, docs/simulator.md)")
    p.add_argument("--batch-max", type=int, default=DEFAULT_BATCH_MAX, help="with --batching: requests per call")
    p.add_argument("--batch-fixed", type=float, default=DEFAULT_FIXED,
                   help="with --batching: F / S(1) of the profile S(b) = S(1)·(f + (1 − f)·b), in [0, 1)")
    p.add_argument("--nic-gbit", type=float, default=None,
                   help="blitzscale: network Gbit/s per host (default the paper's 100)")
    p.add_argument("--workload", choices=("oneshot", "generation"), default="oneshot",
                   help="blitzscale: one-shot requests or generation sessions (TTFT / TBT)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    p.add_argument("--calibration", default=None, help="calibration JSON (Calibration.to_json format)")
    p.add_argument("--keysmanager-bench", default=None,
                   help="`quartctl bench keysmanager` JSON: fork/cold fixed costs from live measurements")
    p.add_argument("--write-calibration", default=None, help="write the calibration in use (with sources) here")
    p.add_argument("--out", default=None, help="JSON output (default stdout)")
    p.add_argument("--series-out", default=None, help="single run: per-stage samples as JSONL")
    p.add_argument("--plots", default=None, help="folder for PNG plots")
    return p


def _calibration(args) -> Calibration:
    cal = Calibration.load(args.calibration) if args.calibration else Calibration()
    if args.keysmanager_bench:
        cal = cal.with_keysmanager_bench(args.keysmanager_bench)
    if args.write_calibration:
        Path(args.write_calibration).write_text(json.dumps(cal.to_json(), indent=2, ensure_ascii=False) + "\n")
    return cal


def _single(args, cal: Calibration) -> dict:
    from quart_tools.sim.scenario import run

    rate = args.rate if args.rate else ex.rate_for(args.model, args.load, cal)
    if args.arrivals == "gamma":
        arrivals = gamma_arrivals(rate, args.cv, args.duration, seed=args.seed)
    else:
        arrivals = replay_trace(load_trace(args.trace), target_rate=rate, duration_s=args.duration, loop=True)
    config = json.loads(args.quart_config) if args.quart_config and args.system.startswith("quart") else None
    entry, result = run(args.model, args.system, arrivals, cal, policy_config=config, seed=args.seed,
                        **dict(_overrides(args)))
    if args.series_out:
        with open(args.series_out, "w") as fh:
            for s in result.samples:
                fh.write(json.dumps({"t": s.t, "stage": s.stage, "replicas": s.replicas, "queue": s.queue}) + "\n")
    if args.plots:
        out = Path(args.plots)
        out.mkdir(parents=True, exist_ok=True)
        plot_latency_cdf({entry["policy"]: result.latencies_ms}, out / "latency-cdf.png",
                         PAPER_MODELS[args.model].exec_ms)
        plot_arrivals(arrivals.times, out / "arrivals.png")
        plot_stage_series(result.samples, out / "stages.png", title=f"{args.system} on {args.model}")
    return entry


def _overrides(args) -> tuple[tuple[str, object], ...]:
    """SimConfig fields set from the command line (only those given)."""
    out = (("max_replicas", args.max_replicas),) if args.max_replicas else ()
    if args.batching:  # quart_tools.sim.batching
        out += (("batch_max", args.batch_max), ("batch_fixed", args.batch_fixed))
    return out


def _batching(args) -> dict:
    """The batching of a run, for its config record ({} without --batching)."""
    return {"batching": {"max": args.batch_max, "fixed": args.batch_fixed}} if args.batching else {}


def _systems(args, default) -> list[str]:
    return [s.strip() for s in args.systems.split(",")] if args.systems else list(default)


def _fig7(args, cal: Calibration) -> dict:
    models = [m.strip() for m in args.models.split(",")]
    cvs = _floats(args.cvs)
    specs = ex.fig7_specs(models, cvs, _systems(args, ex.FIG7_SYSTEMS), args.duration, args.load, cal, args.seed,
                          args.quart_config, _overrides(args))
    entries = ex.run_many(specs, args.workers, "fig7")
    return {
        "experiment": "fig7",
        "config": {"models": models, "cvs": cvs, "duration_s": args.duration, "load": args.load, "seed": args.seed,
                   "quart_config": args.quart_config, "max_replicas": args.max_replicas},
        "entries": entries,
        "summary": ex.compare(entries, ("model", "target_cv")),
        "fig8": ex.fig8(entries),
        "paper": {k: v for k, v in ex.PAPER_REPORTED.items() if k.startswith("cv") or k.startswith("infless")},
    }


def _fig6(args, cal: Calibration) -> dict:
    models = [m.strip() for m in args.models.split(",")]
    specs = ex.fig6_specs(models, _systems(args, ex.FIG7_SYSTEMS), args.duration, args.load, cal, args.trace,
                          args.seed, args.quart_config, _overrides(args))
    entries = ex.run_many(specs, args.workers, "fig6")
    return {
        "experiment": "fig6",
        "config": {"models": models, "duration_s": args.duration, "load": args.load, "trace": args.trace},
        "entries": entries,
        "summary": ex.compare(entries, ("model",)),
        "paper": {k: v for k, v in ex.PAPER_REPORTED.items() if k.startswith("trace")},
    }


def _ablations(args, cal: Calibration) -> dict:
    models = [m.strip() for m in args.models.split(",")]
    specs = ex.fig6_specs(models, _systems(args, ex.ABLATIONS), args.duration, args.load, cal, args.trace,
                          args.seed)
    specs += ex.fig7_specs(models, [4.0], _systems(args, ex.ABLATIONS), args.duration, args.load, cal, args.seed)
    entries = ex.run_many(specs, args.workers, "ablations")
    trace = [e for e in entries if e["tag"] == "fig6"]
    cv4 = [e for e in entries if e["tag"] == "fig7"]
    return {"experiment": "ablations", "config": {"models": models, "duration_s": args.duration, "load": args.load},
            "entries": entries, "table": {"trace": ex.ablation_table(trace), "cv4": ex.ablation_table(cv4)}}


def _floats(text: str) -> list[float]:
    """A comma list of numbers; "" is the empty list."""
    try:
        return [float(c) for c in text.split(",") if c.strip()]
    except ValueError as exc:
        raise ValueError(f"expected a comma list of numbers, got {text!r}") from exc


def _seeds(args) -> list[int]:
    if args.seeds is None:
        return [args.seed]
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as exc:
        raise ValueError(f"--seeds: expected a comma list of integers, got {args.seeds!r}") from exc
    if not seeds:
        raise ValueError("--seeds: give at least one seed")
    return seeds


def _workload_args(args) -> tuple[list[str], list[float], str | None]:
    """Models, gamma CVs and the trace path (None: no trace workload) of frontier / quart-ablation."""
    models = [m.strip() for m in args.models.split(",")]
    cvs = [] if args.only_trace else _floats(args.cvs)
    if args.only_trace and args.no_trace:
        raise ValueError("--only-trace and --no-trace exclude each other")
    trace = None if args.no_trace else args.trace
    if not cvs and trace is None:
        raise ValueError("no workload: give --cvs or a trace")
    return models, cvs, trace


def _frontier(args, cal: Calibration) -> dict:
    from quart_tools.sim.frontier import QUICK_DURATION_S, run_frontier

    models, cvs, trace = _workload_args(args)
    seeds = _seeds(args)
    duration = QUICK_DURATION_S if args.quick else args.duration
    config = {"models": models, "cvs": cvs, "trace": trace, "duration_s": duration, "load": args.load,
              "seeds": seeds, "max_replicas": args.max_replicas, **_batching(args)}
    reuse = None
    if args.reuse:
        with open(args.reuse, encoding="utf-8") as f:
            earlier = json.load(f)
        if earlier.get("config") != config:
            raise ValueError(f"--reuse {args.reuse}: its config {earlier.get('config')} is not this run's {config}")
        reuse = earlier["entries"]
    doc = run_frontier(models, cvs, duration, args.load, cal, trace, seeds, args.workers, _overrides(args), reuse)
    if args.plots:
        from quart_tools.sim.frontier_plots import plot_frontier, plot_seeds

        plot_frontier(doc["entries"], args.plots)
        if len(seeds) > 1:
            plot_seeds(doc["over_seeds"], Path(args.plots) / "frontier-seeds.png")
    return {"experiment": "frontier", "config": config, **doc}


def _quart_ablation(args, cal: Calibration) -> dict:
    from quart_tools.sim.frontier import QUICK_DURATION_S
    from quart_tools.sim.quart_ablation import run_ablation

    models, cvs, trace = _workload_args(args)
    seeds = _seeds(args)
    duration = QUICK_DURATION_S if args.quick else args.duration
    frontier = None
    if args.reuse:  # a frontier document: the rows read the static frontier at each variant's cost
        with open(args.reuse, encoding="utf-8") as f:
            frontier = json.load(f)["entries"]
    doc = run_ablation(models, cvs, duration, args.load, cal, trace, seeds, args.workers, frontier,
                       _overrides(args))
    return {"experiment": "quart-ablation", "config": {"models": models, "cvs": cvs, "trace": trace,
                                                       "duration_s": duration, "load": args.load, "seeds": seeds},
            **doc}


def _blitzscale(args, cal: Calibration) -> dict:
    from quart_tools.sim.blitzscale import MODELS, plot_blitzscale, run_blitzscale

    models = [m.strip() for m in args.models.split(",")] if args.models else list(MODELS)
    fabric = {"nic_gbit_s": args.nic_gbit} if args.nic_gbit else None
    doc = {"experiment": "blitzscale", **run_blitzscale(models, cal, seed=args.seed, fabric=fabric,
                                                        workload=args.workload, trace_path=args.trace)}
    if args.plots:
        doc["plots"] = [str(p) for p in plot_blitzscale(doc, args.plots)]
    return doc


def _paraserve(args, cal: Calibration) -> dict:
    from quart_tools.sim.blitzscale import plot_blitzscale
    from quart_tools.sim.paraserve import MODELS, run_paraserve

    models = [m.strip() for m in args.models.split(",")] if args.models else list(MODELS)
    doc = {"experiment": "paraserve", "workload": "generation", **run_paraserve(models, cal, args.trace, args.seed)}
    if args.plots:
        doc["plots"] = [str(p) for p in plot_blitzscale(doc, args.plots, "ParaServe")]
    return doc


def _generation(args, cal: Calibration) -> dict:
    from quart_tools.sim.genexp import GEN_CVS, plot_generation, run_generation
    from quart_tools.sim.genmodels import GEN_MODELS

    models = [m.strip() for m in args.models.split(",")] if args.models else list(GEN_MODELS)
    cvs = list(GEN_CVS) if args.cvs == _parser().get_default("cvs") else _floats(args.cvs)
    doc = run_generation(models, cvs, not args.no_trace, args.duration, args.load, cal, args.trace, _seeds(args),
                         args.workers)
    if args.plots:
        doc["plots"] = [str(p) for p in plot_generation(doc, args.plots)]
    return doc


def _cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.models is None and args.experiment not in OWN_MODELS:
        args.models = ",".join(PAPER_MODELS)
    if args.plots and args.experiment in ("fig2", "quart-ablation"):
        return cliargs.usage_error("quartctl simulate", f"--plots: the {args.experiment} experiment has no plots "
                                   "(run, fig6, fig7, ablations, frontier, blitzscale and all have)")
    if args.batch_max < 1 or not 0 <= args.batch_fixed < 1:
        return cliargs.usage_error("quartctl simulate", f"--batch-max must be ≥ 1 (got {args.batch_max}) and "
                                   f"--batch-fixed in [0, 1) (got {args.batch_fixed})")
    started = time.perf_counter()
    try:
        cal = _calibration(args)
        experiments = {"run": _single, "fig6": _fig6, "fig7": _fig7, "ablations": _ablations, "frontier": _frontier,
                       "quart-ablation": _quart_ablation, "ablation": _quart_ablation, "blitzscale": _blitzscale,
                       "paraserve": _paraserve, "generation": _generation}
        if args.experiment in experiments:
            doc = experiments[args.experiment](args, cal)
        elif args.experiment == "fig2":
            doc = {"experiment": "fig2", **ex.fig2(cal, args.duration, seed=args.seed)}
        else:
            doc = {"experiment": "all", "fig2": ex.fig2(cal, args.duration, seed=args.seed), "fig6": _fig6(args, cal),
                   "fig7": _fig7(args, cal), "ablations": _ablations(args, cal)}
        if args.plots and args.experiment in ("fig6", "fig7", "ablations", "all"):
            from quart_tools.sim.cv_plots import plot_policy_sweep

            parts = [doc] if args.experiment != "all" else [doc["fig6"], doc["fig7"], doc["ablations"]]
            runs = [(e, part["experiment"]) for part in parts if part["experiment"] != "ablations"
                    for e in [part["entries"]]]
            runs += [([e for e in part["entries"] if e["tag"] == tag], f"ablations-{tag}") for part in parts
                     if part["experiment"] == "ablations" for tag in ("fig6", "fig7")]
            doc["plots"] = [str(path) for entries, name in runs if entries
                            for path in plot_policy_sweep(entries, args.plots, name)]
            print(f"wrote {len(doc['plots'])} plot(s) to {args.plots}", file=sys.stderr)
        if args.experiment != "run":
            doc["calibration"] = cal.to_json()
            doc["wall_s"] = round(time.perf_counter() - started, 2)
            doc["cpu_s"] = round(_cpu_seconds(), 2)  # this process + its workers: load-independent cost
            doc["machine_note"] = "simulated cluster; wall_s measured on the machine that ran it"
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"quartctl simulate: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(json_safe(doc), indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    else:
        print(text)
    return 0
