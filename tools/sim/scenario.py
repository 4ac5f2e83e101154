"""Build and run one simulated configuration: a paper model, a policy (or ablation), arrivals.

A *system* names a policy plus the deployment it runs on, as in the paper's comparison: QUART runs
with the KeysManager (fork from cached parameters) and the cache-aware placer; the baselines run as
published, without a parameter cache (every new replica is a cold start from disk) and with a
cache-blind first-fit placer; INFless serves the whole model as one function. Ablations:
``quart-no-km`` (QUART without the KeysManager) and ``<baseline>+km`` (a baseline given the
KeysManager and the cache-aware placer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from gateway_plugin.policies import POLICY_NAMES, make_policy
from quart_tools.arrivals import Arrivals
from quart_tools.report import build_report
from quart_tools.sim.calibration import PAPER_MODELS, PAPER_STAGES, Calibration, activation_bytes
from quart_tools.sim.engine import SimConfig, SimResult, Simulation, StageSpec

BASELINES = tuple(p for p in POLICY_NAMES if p != "quart")
SLO_FACTOR = 2.0  # the SLO the policies aim at: 2 × the profiled model time (PluginConfig default)


@dataclass(frozen=True)
class System:
    """A policy and the deployment it runs on."""

    name: str  # label in reports
    policy: str  # make_policy name
    keysmanager: bool
    placer: str
    whole_model: bool = False


def system(name: str) -> System:
    """``quart``, a baseline name, ``quart-no-km`` or ``<baseline>+km``."""
    km_variant = name.endswith("+km")
    base = name[:-3] if km_variant else name
    if base == "quart-no-km":
        return System(name, "quart", keysmanager=False, placer="cache-aware")
    if base not in POLICY_NAMES:
        known = ", ".join([*POLICY_NAMES, "quart-no-km", *(f"{b}+km" for b in BASELINES)])
        raise ValueError(f"unknown system {name!r}; one of {known}")
    if base == "quart":
        return System(name, "quart", keysmanager=True, placer="cache-aware")
    return System(
        name,
        base,
        keysmanager=km_variant,
        placer="cache-aware" if km_variant else "first-fit",
        whole_model=base == "infless",
    )


def model_stages(model: str, stages: int = PAPER_STAGES) -> tuple[StageSpec, ...]:
    """A paper model split evenly into ``stages`` stages (the paper's DeepSpeed split is balanced)."""
    if model not in PAPER_MODELS:
        raise ValueError(f"unknown model {model!r}; one of {', '.join(PAPER_MODELS)}")
    prof = PAPER_MODELS[model]
    per_bytes = int(prof.size_gb * 1e9 / stages)
    return tuple(
        StageSpec(f"{model}-stage-{i}", prof.exec_ms / 1000.0 / stages, per_bytes, activation_bytes(prof))
        for i in range(stages)
    )


def pipeline_capacity_rps(model: str, calibration: Calibration, stages: int = PAPER_STAGES) -> float:
    """Requests/s the whole cluster sustains when every GPU serves a stage of a balanced pipeline."""
    prof = PAPER_MODELS[model]
    slots = calibration.hosts * calibration.gpus_per_host
    return slots / stages * stages / (prof.exec_ms / 1000.0)


def sim_config(model: str, sys_: System, calibration: Calibration | None = None, **overrides) -> SimConfig:
    prof = PAPER_MODELS[model]
    cfg = SimConfig(
        model=model,
        stages=model_stages(model),
        slo_s=SLO_FACTOR * prof.exec_ms / 1000.0,
        calibration=calibration or Calibration(),
        keysmanager=sys_.keysmanager,
        placer=sys_.placer,
        whole_model=sys_.whole_model,
    )
    return replace(cfg, **overrides)


def make_system_policy(sys_: System, policy_config: dict | None = None, calibration: Calibration | None = None):
    """The system's policy; QUART's CPU regression is fitted on the simulated replicas (``Calibration.cpu_model``)."""
    config = dict(policy_config or {})
    if sys_.whole_model:
        config.setdefault("pipelined", False)
    if sys_.policy == "quart" and "cpu_model" not in config:
        config["cpu_model"] = (calibration or Calibration()).cpu_model()
    return make_policy(sys_.policy, **config)


def run(model: str, system_name: str, arrivals: Arrivals, calibration: Calibration | None = None,
        policy_config: dict | None = None, **overrides) -> tuple[dict, SimResult]:
    """Simulate one system on one model and arrival schedule; return (report entry, raw result)."""
    sys_ = system(system_name)
    cfg = sim_config(model, sys_, calibration, **overrides)
    policy = make_system_policy(sys_, policy_config, calibration)
    started = time.perf_counter()
    result = Simulation(cfg, policy, arrivals).run()
    wall = time.perf_counter() - started
    return entry_of(result, sys_.name, model, arrivals, wall), result


def entry_of(result: SimResult, name: str, model: str, arrivals: Arrivals, wall_s: float) -> dict:
    """Report keys (shared with the live benchmark) plus what only the simulator knows."""
    prof = PAPER_MODELS[model]
    entry = build_report(
        name,
        result.latencies_ms,
        profiled_ms=prof.exec_ms,
        duration_s=max(result.duration_s, 1e-9),
        n_total=len(result.latencies_ms),
        samples=result.samples,
        stage_arrivals=result.stage_arrivals,
        end_s=result.end_s,
    )
    ready = {k: (float(np.mean(v)) if v else None) for k, v in result.ready_s_by_source.items()}
    entry.update(
        model=model,
        arrivals=arrivals.kind,
        rate_rps=round(arrivals.rate(), 3),
        cv=round(arrivals.cv(), 3),
        gpu_seconds=result.gpu_seconds,
        cpu_seconds=result.cpu_seconds,
        rejected=result.rejected,
        starts_by_source=result.starts_by_source,
        mean_ready_s_by_source=ready,
        key_stage_counts={str(k): v for k, v in sorted(result.key_stage_counts.items())},
        evictions=result.evictions,
        events=result.events,
        kicks=result.kicks,
        wall_s=round(wall_s, 3),
    )
    return entry
