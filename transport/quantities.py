"""Kubernetes-style resource quantities, as OpenFaaS's limits/requests carry them ("128Mi", "500m")."""

from __future__ import annotations

import math
import re

MAX_CPUS = 4096  # more than any host: a limit above is a typo (and nan/inf never start a replica)

_MEMORY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGTPE]i?|k|)\s*[Bb]?\s*$")
_UNITS = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


def parse_memory(text: str) -> int:
    """Bytes in a memory quantity: ``"128M"`` → 128·10⁶, ``"1Gi"`` → 2³⁰. Raises ValueError."""
    match = _MEMORY.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a memory quantity (examples: 128Mi, 1G, 536870912)")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(value) or value <= 0 or value > 2**63:
        raise ValueError(f"memory {text!r} must be positive and at most 8 EiB")
    return int(value)


def parse_cpu(text: str) -> float:
    """CPUs in a cpu quantity: ``"500m"`` → 0.5, ``"2"`` → 2.0. Raises ValueError."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 1000 if raw.endswith("m") else float(raw)
    except ValueError:
        raise ValueError(f"{text!r} is not a cpu quantity (examples: 500m, 0.5, 2)") from None
    if not math.isfinite(value) or value <= 0 or value > MAX_CPUS:
        raise ValueError(f"cpu {text!r} must be a positive, finite number of at most {MAX_CPUS} CPUs")
    return value
