"""M/M/c formulas used by the corrector and the CPU compensator (QUART Eq. 1, in its standard form).

Erlang C is computed from the Erlang B recurrence B(k) = a·B(k−1) / (k + a·B(k−1)), which never
forms factorials or powers, so it is stable for hundreds of servers.
"""

from __future__ import annotations

import math


def erlang_b(servers: int, offered_load: float) -> float:
    """Blocking probability of M/M/c/c with ``servers`` servers and offered load a = λ/μ."""
    if servers < 0 or offered_load < 0:
        raise ValueError(f"erlang_b needs servers ≥ 0 and load ≥ 0, got {servers}, {offered_load}")
    b = 1.0
    for k in range(1, servers + 1):
        b = offered_load * b / (k + offered_load * b)
    return b


def erlang_c(servers: int, offered_load: float) -> float:
    """Probability that an arrival waits in M/M/c; 1.0 when the queue is unstable (a ≥ c)."""
    if servers <= 0 or offered_load >= servers:
        return 1.0
    if offered_load <= 0:
        return 0.0
    b = erlang_b(servers, offered_load)
    return servers * b / (servers - offered_load * (1.0 - b))


def mmc_wait(arrival_rate: float, service_rate: float, servers: int) -> float:
    """Mean waiting time W_q = C(c, a) / (c·μ − λ); inf when ρ ≥ 1 or nothing serves."""
    if arrival_rate <= 0:
        return 0.0
    if service_rate <= 0 or servers <= 0 or arrival_rate >= servers * service_rate:
        return math.inf
    a = arrival_rate / service_rate
    return erlang_c(servers, a) / (servers * service_rate - arrival_rate)


def mmc_delay(arrival_rate: float, service_rate: float, servers: int) -> float:
    """Mean time in an M/M/c stage: waiting plus service, T = W_q + 1/μ (inf when ρ ≥ 1)."""
    if service_rate <= 0:
        return math.inf
    return mmc_wait(arrival_rate, service_rate, servers) + 1.0 / service_rate


def servers_for_utilisation(arrival_rate: float, service_rate: float, rho_max: float) -> int:
    """Fewest servers with ρ = λ / (c·μ) ≤ rho_max (and < 1)."""
    if arrival_rate <= 0:
        return 0
    if service_rate <= 0:
        raise ValueError("servers_for_utilisation needs a positive service rate")
    c = math.ceil(arrival_rate / (service_rate * rho_max) - 1e-9)
    while arrival_rate >= c * service_rate:
        c += 1
    return c


def servers_for_delay(arrival_rate: float, service_rate: float, target_s: float, limit: int = 10_000) -> int | None:
    """Fewest servers with T = mmc_delay ≤ target_s; None when no count ≤ limit reaches it."""
    if service_rate <= 0:
        return None
    if 1.0 / service_rate > target_s:
        return None
    c = max(1, servers_for_utilisation(arrival_rate, service_rate, 0.999999))
    while c <= limit:
        if mmc_delay(arrival_rate, service_rate, c) <= target_s:
            return c
        c += 1
    return None
