"""How long a stage keeps its burst reserve: the replicas above its demand once a burst has passed (issue 32).

Once the demand of a stage has fallen below its count, the difference is a reserve against the burst coming
back. Keeping it costs replica-seconds while the burst stays away; releasing it costs a burst that returns
before new replicas are ready: it queues for a detection and a start, and a burst the cluster cannot serve
keeps that backlog until it ends. That is ski rental. The step rule (hold all of it for ``hold_s``, then
release all of it) is 2-competitive against one return time and loses the whole reserve to a burst that
returns just after the hold.

**Hold, then taper**: the whole reserve is kept for ``hold_s`` (the step rule's break-even, unchanged), then
released over a tail as fractional ski rental. The reserve is divisible, so the randomized strategy (Karlin,
Manasse, McGeoch, Owicki 1994: release at a time drawn with density e^{s/T} / (T·(e − 1)) on [0, T],
e/(e − 1)-competitive) is played without randomness, over the replicas: ``s`` seconds into the tail the stage
keeps the share 1 − F(s), F(s) = (e^{s/T} − 1) / (e − 1). The tail's replica-seconds are Δ·∫(1 − F) =
Δ·T / (e − 1), so T = (e − 1)·hold_s costs one more hold: at most twice the step rule's reserve, never fewer
replicas than it keeps at any time, and part of the reserve kept up to (e − 1) × hold_s after the hold.

Pure: the caller keeps when the demand fell and the count it fell from.
"""

from __future__ import annotations

import math

E_MINUS_1 = math.e - 1.0


def release_horizon_s(hold_s: float) -> float:
    """T: the tail's length, over which the reserve is released at the spend of holding it ``hold_s`` more."""
    return E_MINUS_1 * max(0.0, hold_s)


def released_share(idle_s: float, hold_s: float) -> float:
    """F(s): the share of the reserve released ``idle_s`` seconds into the tail (0 → 1 over the horizon)."""
    horizon = release_horizon_s(hold_s)
    if idle_s >= horizon:  # also no hold at all: nothing kept
        return 1.0
    if idle_s <= 0:
        return 0.0
    return (math.exp(idle_s / horizon) - 1.0) / E_MINUS_1


def replicas_kept(top: int, demand: int, idle_s: float, hold_s: float) -> int:
    """Replicas a stage keeps ``idle_s`` seconds after its demand fell below ``top`` (its count then): all of them
    for ``hold_s``, then the demand plus the unreleased share of the reserve over the tail, rounded to the nearest
    replica."""
    reserve = max(0, top - demand)
    if idle_s < hold_s:
        return max(top, demand)
    kept = reserve * (1.0 - released_share(idle_s - hold_s, hold_s))
    return demand + min(reserve, math.floor(kept + 0.5))

