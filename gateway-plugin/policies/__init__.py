"""Scaling policies: QUART and the baselines, all pure objects ``decide(snapshot) -> Decision``.

``make_policy(name, **config)`` builds one by name; ``config`` keys are the fields of the policy's
config dataclass in ``gateway_plugin.config`` (nested ones accept dicts), plus for ``quart`` the
objects ``cv_model`` (a trained CVPropagationModel) and ``cpu_model`` (a fitted CPULatencyModel; left
out, the one fitted on the product's own profile, ``CPULatencyModel.default``; None: no compensation
model), and for ``infless`` the flag ``pipelined``.
"""

from __future__ import annotations

from typing import Any

from gateway_plugin.config import (
    CocktailConfig,
    InferLineConfig,
    INFlessConfig,
    KnativeKPAConfig,
    OpenFaaSCEConfig,
    QuartConfig,
    StaticConfig,
    build_config,
)
from gateway_plugin.snapshot import Policy

POLICY_NAMES = ("quart", "static", "openfaas-ce", "knative-kpa", "inferline", "infless", "cocktail")


def make_policy(name: str, **config: Any) -> Policy:
    """A fresh policy object named ``name`` with its settings overridden by ``config``."""
    from gateway_plugin.policies.cocktail import CocktailPolicy
    from gateway_plugin.policies.inferline import InferLinePolicy
    from gateway_plugin.policies.infless import INFlessPolicy
    from gateway_plugin.policies.knative_kpa import KnativeKPAPolicy
    from gateway_plugin.policies.openfaas_ce import OpenFaaSCEPolicy
    from gateway_plugin.policies.quart import QuartPolicy
    from gateway_plugin.policies.static import StaticPolicy

    if name == "quart":
        cv_model = config.pop("cv_model", None)
        from gateway_plugin.policies.cpu_model import default_cpu_model

        cpu_model = config.pop("cpu_model") if "cpu_model" in config else default_cpu_model()
        return QuartPolicy(build_config(QuartConfig, config), cv_model=cv_model, cpu_model=cpu_model)
    if name == "infless":
        pipelined = bool(config.pop("pipelined", False))
        return INFlessPolicy(build_config(INFlessConfig, config), pipelined=pipelined)
    simple = {
        "static": (StaticPolicy, StaticConfig),
        "openfaas-ce": (OpenFaaSCEPolicy, OpenFaaSCEConfig),
        "knative-kpa": (KnativeKPAPolicy, KnativeKPAConfig),
        "inferline": (InferLinePolicy, InferLineConfig),
        "cocktail": (CocktailPolicy, CocktailConfig),
    }
    if name not in simple:
        raise ValueError(f"unknown policy {name!r}; one of {', '.join(POLICY_NAMES)}")
    cls, cfg_cls = simple[name]
    return cls(build_config(cfg_cls, config))


__all__ = ["POLICY_NAMES", "make_policy"]
