"""CPU compensation while a stage's new replicas start (issue 32): QUART §5.3 where the product's QUART needs it.

The paper compensates with CPUs the replicas Smooth reclaims: fewer replicas carry the stage, so each gets the
CPUs the regression says keep its delay. With the provisioning corrector (``mode=provision``, the default)
Smooth has nothing to reclaim on a balanced pipeline, but the same gap opens every time Correct scales a stage
up: until the new replicas serve (a fork's second, a cold start's tens of seconds, or as long as a full
cluster has no slot), the stage runs on fewer replicas than Correct asked for. The bridge gives its ready
replicas the CPUs that carry the asked capacity meanwhile: the fewest ``cpu_step`` above ``cpu_default`` whose
predicted service ratio t(c)/t(cpu_default) ≤ ready / asked (the ready replicas then serve what the asked
count would), or — when even ``cpu_max`` does not — the largest step that still helps (≥ ``MIN_GAIN`` shorter
service). Once the stage has what it asked for, its CPUs go back to ``cpu_default``. A CPU change is an
in-place resize (`quart_kernel.resize`), so bridging costs CPU-seconds, never a restart. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gateway_plugin.config import CPUConfig

MIN_GAIN = 0.05  # CPUs are granted only where the regression predicts at least this much shorter service

Ratio = Callable[[float, float], float]  # (cpus_from, cpus_to) → t(cpus_to) / t(cpus_from)


def cpu_steps(cfg: CPUConfig, above: float) -> list[float]:
    """CPU counts above ``above``, in ``cpu_step`` steps up to CPU_max."""
    steps = int(math.floor((cfg.cpu_max - above) / cfg.cpu_step + 1e-9))
    return [round(above + k * cfg.cpu_step, 6) for k in range(1, steps + 1)]


def bridge_cpus(ready: int, asked: int, cfg: CPUConfig, ratio: Ratio) -> float:
    """CPUs per ready replica while ``asked`` − ``ready`` replicas start (``cpu_default`` when none start, none is
    ready, or no CPU count helps)."""
    base = cfg.cpu_default
    if ready <= 0 or asked <= ready:
        return base
    helps = [c for c in cpu_steps(cfg, base) if ratio(base, c) < 1.0 - MIN_GAIN]
    if not helps:
        return base
    need = ready / asked
    return next((c for c in helps if ratio(base, c) <= need), helps[-1])
