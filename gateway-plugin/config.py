"""Every setting of the gateway plugin (router, metrics, controller, policies) with its documented default.

Policy settings are plain dataclasses passed to ``make_policy(name, **overrides)``; the runtime
settings (router, metrics, controller, actuator) are read from the environment by
``PluginConfig.from_env`` (OpenFaaS convention: upper-case ``QUART_*`` variables).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

from quart_stage.settings import settings_from_env

# ---------------------------------------------------------------------------------------------
# Policies (pure; time comes from the snapshot)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CorrectConfig:
    """QUART §5.1: Erlang-C delay estimate + PID on e = T_i − T_target (positive e → more replicas)."""

    kp: float = 1.0  # replicas per unit of relative error e / T_target
    ki: float = 0.2  # replicas per (relative error × second)
    kd: float = 0.1  # replicas per (relative error / second), on the filtered derivative
    integral_limit: float = 8.0  # anti-windup clamp of ∫e dt (relative-error seconds)
    derivative_alpha: float = 0.5  # low-pass filter weight of the newest derivative sample
    error_cap: float = 8.0  # relative error used when T_i is infinite (ρ ≥ 1)
    scale_down_cooldown_s: float = 10.0  # no removal within this long after a stage scaled up
    max_step_down: int = 2  # replicas removed from one stage per decision at most
    default_target_factor: float = 2.0  # T_target = factor × service time when no SLO is known
    use_queue_feedback: bool = True  # T_i also from observed wait and the backlog (queue status)
    rho_max: float = 0.95  # when ρ ≥ 1: at least enough replicas for ρ ≤ rho_max
    replica_start_s: float = 1.0  # expected time until a new replica serves (learned from snapshots)
    start_time_alpha: float = 0.3  # EMA weight of a newly observed replica start time
    dead_time_gate: bool = True  # a backlog that drains before a new replica could start adds no replicas
    peak_rate: bool = False  # M/M/c at max(λ over the window, λ over the last second) instead of the window's λ
    # A stage waiting for replicas the cluster has no room for (pending > max(starved_after_s, 3 × its start
    # time)) lets idle stages (empty queue) skip their scale-down cooldown, down to what still meets their target.
    release_when_starved: bool = True
    starved_after_s: float = 1.0


@dataclass(frozen=True, slots=True)
class SmoothConfig:
    """QUART §5.2: CV-propagation model + Laplace smoothing of replica demand (Eq. 7)."""

    enabled: bool = True
    beta_cv_half: float = 1.0  # β(CV) = CV^p / (CV^p + half^p): β(half) = 0.5
    beta_power: float = 2.0
    min_window_requests: int = 20  # fewer arrivals in the window → observed CV is not trusted (β=1)


@dataclass(frozen=True, slots=True)
class CPUConfig:
    """QUART §5.3: CPU compensation by linear regression on profiling records."""

    enabled: bool = True
    cpu_max: float = 8.0  # CPU_max per replica
    cpu_step: float = 0.5  # granularity of the CPU search
    cpu_default: float = 1.0  # CPUs a replica gets when nothing needs compensating
    # AllocateCPU changes a stage's CPUs at most once per hold_s, and
    # CPUs go back to cpu_default only when the delay there is ≤ release_margin × the target (no flapping).
    hold_s: float = 30.0
    # AllocateCPU beyond Smooth's reclaims (stages over target that Correct cannot grow). Off by default (measured
    # when a CPU change was a rolling update: mixed; docs/policies.md).
    allocate: bool = False
    release_margin: float = 0.5
    # While a stage's new replicas start, its ready ones get the CPUs that carry the asked capacity, back to
    # cpu_default once they serve (gateway_plugin.policies.cpu_bridge; an in-place resize, no roll).
    bridge: bool = True


@dataclass(frozen=True, slots=True)
class ProvisionConfig:
    """QUART's provisioning corrector (``mode="provision"``, gateway_plugin.policies.provision)."""

    rate_window_s: float = 5.0  # λ is averaged over this long (the oracle's best schedule step)
    peak_window_s: float = 30.0  # ... and the largest such mean over this long sizes the stage
    feed_forward: bool = True  # every stage sized for at least the entry stage's peak rate
    backlog_starts: float = 2.0  # a queue that needs > this × a replica's start time to drain adds replicas
    propagate_backlog: bool = True  # ... and the stages after it are sized (ρ ≤ rho_max) for the rate it leaves at
    hold_min_s: float = 30.0  # scale down only after the demand stayed lower this long ...
    hold_starts: float = 10.0  # ... or this many replica start times, whichever is longer
    # Hold, then taper (policies.keepalive): the reserve (the count when the demand fell − the demand) is kept whole for
    # the hold, then released over (e − 1) × the hold as fractional ski rental (share (e^{s/T} − 1)/(e − 1) by s) at
    # the spend of one more hold. Off: all of it at once after the hold (the step rule).
    ski_rental_tail: bool = True
    # While a stage waits for replicas the cluster cannot place, no stage asks for more than its share of the
    # replicas held (Σ ready, split by service time): the pipeline runs at its slowest stage's capacity.
    fair_share: bool = True
    # Before a stage has seen peak_window_s of traffic, it is sized for at least the peak the full window is expected
    # to show (provision.expected_peak_rate: mean rate + z·σ of a window's mean from the observed CV).
    startup_estimate: bool = True
    # A stage after the entry is sized for the entry's peak, not its own (load_floor rule 8; issue 32). Opt-in: with
    # the kick better on BERT CV 4 / 8 and trace-busy, worse on WideResNet trace-quiet's worst seed (docs/benchmarks.md).
    entry_sizes_pipeline: bool = False
    # Each stage sized for at least mean + floor_z·σ of its 5 s mean rates over floor_horizon_s (load_floor rule 9;
    # issue 32): the peak rule's average level, so the count stays on two adjacent levels. 0 s: off (opt-in, as
    # above; with 300 s WideResNet CV 8 went 0.998 → 1.001 × the frontier on seeds 0–4).
    floor_horizon_s: float = 0.0
    floor_z: float = 1.75
    # Rule 10 (issue 32): the delay a count is sized by is the G/G/c wait (Allen–Cunneen: the M/M/c wait ×
    # (CV_a² + 1)/2), the arrivals' observed CV capped at this; 0: off (the M/M/c wait, Poisson arrivals). Opt-in:
    # 2 took BERT CV 4 to 1.001 × the frontier but CV 8 from 0.993 to 0.998 (docs/benchmarks.md, issue 32).
    arrival_cv_cap: float = 0.0


@dataclass(frozen=True, slots=True)
class QuartConfig:
    # "provision": size for the windowed peak rate and hold (issue 15; gateway_plugin.policies.provision);
    # "pid": the paper's Correct (PID on the M/M/c delay error, gateway_plugin.policies.correct).
    mode: str = "provision"
    correct: CorrectConfig = field(default_factory=CorrectConfig)
    provision: ProvisionConfig = field(default_factory=ProvisionConfig)
    smooth: SmoothConfig = field(default_factory=SmoothConfig)
    cpu: CPUConfig = field(default_factory=CPUConfig)
    # Backlog propagation (ours, beyond the paper): requests queued upstream are the next arrivals of the stages
    # after it. While that backlog outlasts a stage's replica start, the stage gets the replicas to keep up with
    # the rate its upstream will release it at, in the same step, instead of one control period per stage later.
    # Off by default: on the live bench (gamma CV 8, 20 req/s) it did not lower latency (481 vs 457–487 ms) and
    # cost up to 1.6–2× the replica-seconds (docs/benchmarks.md, Policies).
    backlog_lookahead: bool = False


@dataclass(frozen=True, slots=True)
class StaticConfig:
    replicas: int = 2  # per stage (clamped to [r_min, r_max])


@dataclass(frozen=True, slots=True)
class OpenFaaSCEConfig:
    """OpenFaaS CE alert scaling (faas/gateway + prometheus alert.rules.yml + alertmanager.yml)."""

    rps_threshold: float = 5.0  # APIHighInvocationRate: rate(gateway_function_invocation_total[10s]) > 5
    fire_for_s: float = 5.0  # alert `for: 5s`
    repeat_s: float = 10.0  # alertmanager group_interval: a firing alert is re-sent this often
    scale_factor: float = 0.20  # com.openfaas.scale.factor: step = 20 % of max replicas


@dataclass(frozen=True, slots=True)
class KnativeKPAConfig:
    """Knative Serving KPA defaults (config-autoscaler ConfigMap)."""

    container_concurrency: float = 1.0  # containerConcurrency of the revision (hard limit)
    target_utilization: float = 0.7  # container-concurrency-target-percentage
    stable_window_s: float = 60.0
    panic_window_percentage: float = 10.0  # panic window = 10 % of stable = 6 s
    panic_threshold: float = 2.0  # panic-threshold-percentage 200 %
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    scale_down_delay_s: float = 0.0


@dataclass(frozen=True, slots=True)
class InferLineConfig:
    """InferLine (Crankshaw et al., SoCC'20) planner + high-frequency tuner, per stage."""

    window_sizes_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)  # traffic-envelope windows
    utilisation: float = 0.8  # fraction of profiled throughput the planner provisions for
    scale_down_delay_s: float = 15.0  # tuner waits this long below the envelope before removing
    scale_down_window_s: float = 30.0  # ... and only down to the envelope over this window


@dataclass(frozen=True, slots=True)
class INFlessConfig:
    """INFless (Yang et al., ASPLOS'22) as the paper ran it: the whole model as one function."""

    utilisation: float = 0.8  # RPS per instance provisioned at this fraction of its throughput
    keep_alive_s: float = 60.0  # idle instances kept this long before removal


@dataclass(frozen=True, slots=True)
class CocktailConfig:
    """Cocktail (Gunasekaran et al., NSDI'22): predictive, model-granular scaling."""

    alpha: float = 0.5  # Holt level smoothing
    beta: float = 0.3  # Holt trend smoothing
    horizon_s: float = 10.0  # forecast this far ahead (the scaling interval of the paper)
    headroom: float = 1.2  # over-provisioning on the forecast
    cooldown_s: float = 30.0  # minimum time between scale-downs


def build_config(cls: type, overrides: Mapping[str, Any]):
    """``cls()`` with the given overrides; nested config dataclasses accept dicts. Unknown keys → ValueError."""
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ValueError(f"{cls.__name__} has no setting(s) {', '.join(unknown)}; known: {', '.join(names)}")
    base = cls()
    values: dict[str, Any] = {}
    for key, value in overrides.items():
        current = getattr(base, key)
        if is_dataclass(current) and isinstance(value, Mapping):
            value = build_config(type(current), value)
        values[key] = value
    return replace(base, **values)


# ---------------------------------------------------------------------------------------------
# Runtime (router, metrics, controller, actuator)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PluginConfig:
    """Runtime settings of router, metrics and controller. Environment names in brackets."""

    queue_cap: int = 1024  # [QUART_QUEUE_CAP] waiting requests per stage before 429
    retry_after_s: int = 1  # [QUART_RETRY_AFTER_S] Retry-After on 429
    request_timeout_s: float = 60.0  # [QUART_REQUEST_TIMEOUT_S] deadline of one pipeline request
    min_deadline_ms: float = 5.0  # [QUART_MIN_DEADLINE_MS] a shorter X-Quart-Timeout-Ms is refused 400
    admission_safety: float = 1.5  # [QUART_ADMISSION_SAFETY] a deadline admits / keeps a call whose expected time × this fits
    attempt_timeout_s: float = 30.0  # [QUART_ATTEMPT_TIMEOUT_S] one stage call before retrying elsewhere
    max_attempts: int = 3  # [QUART_MAX_ATTEMPTS] tries of one stage call on distinct replicas
    replica_refresh_s: float = 0.5  # [QUART_REPLICA_REFRESH_S] how often ready replicas are re-listed
    default_concurrency: int = 1  # [QUART_CONCURRENCY] slots per replica when no label says
    batch_max: int = 1  # [QUART_BATCH_MAX] requests per stage call when no com.quart.batch.max label says (1 = off)
    batch_wait_ms: float = 0.0  # [QUART_BATCH_WAIT_MS] a short batch waits this long for more (com.quart.batch.wait-ms)
    window_s: float = 10.0  # [QUART_WINDOW_S] metrics sliding window
    records_path: str = ""  # [QUART_RECORDS] JSONL of per-request records ("" = keep none)
    control_period_s: float = 1.0  # [QUART_CONTROL_PERIOD_S]
    # The traffic kick (gateway_plugin.kick): an arrival that takes a stage's recent rate to kick_surge × what its
    # last decision asked for (or saw) runs a decision at once, for every policy; at most one per kick_min_interval_s.
    kick: bool = True  # [QUART_KICK]
    kick_surge: float = 2.0  # [QUART_KICK_SURGE]
    kick_min_interval_s: float = 0.25  # [QUART_KICK_MIN_INTERVAL_S]
    kick_min_arrivals: int = 8  # [QUART_KICK_MIN_ARRIVALS]
    kick_min_span_s: float = 0.5  # [QUART_KICK_MIN_SPAN_S]
    policy: str = "quart"  # [QUART_POLICY]
    slo_factor: float = 2.0  # [QUART_SLO_FACTOR] SLO = factor × profiled pipeline time
    # the cores the CPU stages' replicas share (policies.compute_budget): -1 = auto (the embedded gateway: this
    # machine's cores, where its replicas run; the standalone plugin: not bounded, the cluster places pods), 0 = off
    compute_cores: float = -1.0  # [QUART_COMPUTE_CORES]
    tpot_slo_ms: float = 0.0  # [QUART_TPOT_SLO_MS] generation's time per output token target: sizes decode stages (0 = KV room only)
    actuator: str = "gateway"  # [QUART_ACTUATOR] gateway (in-process) | rest | faas-cli | none
    control_log_path: str = ""  # [QUART_CONTROL_LOG] JSONL of snapshots + decisions ("" = none)
    cv_model_path: str = ""  # [QUART_CV_MODEL] trained CV-propagation model (safetensors)
    cv_online: bool = True  # [QUART_CV_ONLINE] without QUART_CV_MODEL: train the CV model online, in the background
    cpu_profile_path: str = ""  # [QUART_CPU_PROFILE] JSONL profiling records for the CPU regression
    gateway_url: str = ""  # [QUART_GATEWAY_URL] OpenFaaS gateway (rest / faas-cli actuators, standalone)
    gateway_user: str = "admin"  # [QUART_GATEWAY_USER]
    gateway_password_file: str = ""  # [QUART_GATEWAY_PASSWORD_FILE] file with the password (mode 0600)
    # The standalone plugin's platform: "openfaas" calls a stage through the gateway's /function/<stage>;
    # "kubernetes" reads each stage's pods from the EndpointSlices of its Service and calls them directly.
    platform: str = "openfaas"  # [QUART_PLATFORM] openfaas | kubernetes
    kubernetes_api_url: str = "https://kubernetes.default.svc"  # [QUART_KUBERNETES_API_URL]
    # the service account's token and ca.crt (QUART_PLATFORM=kubernetes)
    kubernetes_credentials_dir: str = "/var/run/secrets/kubernetes.io/serviceaccount"  # [QUART_KUBERNETES_CREDENTIALS_DIR]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig:
        """Defaults, then the ``QUART_*`` variables named beside each field (``quart_stage.settings`` rules)."""
        names = {
            "queue_cap": "QUART_QUEUE_CAP",
            "retry_after_s": "QUART_RETRY_AFTER_S",
            "request_timeout_s": "QUART_REQUEST_TIMEOUT_S",
            "min_deadline_ms": "QUART_MIN_DEADLINE_MS",
            "admission_safety": "QUART_ADMISSION_SAFETY",
            "attempt_timeout_s": "QUART_ATTEMPT_TIMEOUT_S",
            "max_attempts": "QUART_MAX_ATTEMPTS",
            "replica_refresh_s": "QUART_REPLICA_REFRESH_S",
            "default_concurrency": "QUART_CONCURRENCY",
            "batch_max": "QUART_BATCH_MAX",
            "batch_wait_ms": "QUART_BATCH_WAIT_MS",
            "window_s": "QUART_WINDOW_S",
            "records_path": "QUART_RECORDS",
            "control_period_s": "QUART_CONTROL_PERIOD_S",
            "kick": "QUART_KICK",
            "kick_surge": "QUART_KICK_SURGE",
            "kick_min_interval_s": "QUART_KICK_MIN_INTERVAL_S",
            "kick_min_arrivals": "QUART_KICK_MIN_ARRIVALS",
            "kick_min_span_s": "QUART_KICK_MIN_SPAN_S",
            "policy": "QUART_POLICY",
            "slo_factor": "QUART_SLO_FACTOR",
            "tpot_slo_ms": "QUART_TPOT_SLO_MS",
            "compute_cores": "QUART_COMPUTE_CORES",
            "actuator": "QUART_ACTUATOR",
            "control_log_path": "QUART_CONTROL_LOG",
            "cv_model_path": "QUART_CV_MODEL",
            "cv_online": "QUART_CV_ONLINE",
            "cpu_profile_path": "QUART_CPU_PROFILE",
            "gateway_url": "QUART_GATEWAY_URL",
            "gateway_user": "QUART_GATEWAY_USER",
            "gateway_password_file": "QUART_GATEWAY_PASSWORD_FILE",
            "platform": "QUART_PLATFORM",
            "kubernetes_api_url": "QUART_KUBERNETES_API_URL",
            "kubernetes_credentials_dir": "QUART_KUBERNETES_CREDENTIALS_DIR",
        }
        return settings_from_env(cls, "QUART_", env, names=names)
