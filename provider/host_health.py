"""Which hosts answer: a host that missed ``down_polls`` polls in a row and has not answered for ``down_after_s``
is down until it answers again.

Both, as a Kubernetes node is NotReady only after its grace period: one missed poll is no outage (a
KeysManager busy with a burst of starts answers a poll late now and then, and the silence measured includes
the gateway's own pass, which a loaded machine stretches), while a host that stays silent is down after
``down_polls`` polls (about ``down_polls`` × (``host_timeout_s`` + ``reconcile_interval_s``)).

The reconciler polls every host each pass (each poll bounded by ``GatewayConfig.host_timeout_s``) and
tells this record the outcome. The transitions it reports are what the reconciler acts on: *down* (mark
the host's replicas dead, cancel starts on it, place replacements elsewhere) and *back* (stop what still
runs there, since its replicas were replaced, and place on it again). Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class HostHealth:
    down_after_s: float
    down_polls: int = 1  # failed polls in a row a host needs to be down
    last_ok: dict[str, float] = field(default_factory=dict)  # host → when it last answered
    first_failed: dict[str, float] = field(default_factory=dict)  # host → first failed poll since then
    missed: dict[str, int] = field(default_factory=dict)  # host → failed polls since its last answer
    down: set[str] = field(default_factory=set)

    def answered(self, host: str, now: float) -> bool:
        """A poll of ``host`` succeeded at ``now``; True when it was down (it is back)."""
        self.last_ok[host] = now
        self.first_failed.pop(host, None)
        self.missed.pop(host, None)
        if host in self.down:
            self.down.discard(host)
            return True
        return False

    def failed(self, host: str, now: float) -> bool:
        """A poll of ``host`` failed at ``now``; True when this makes it down (once per outage).

        Silence counts from its last answer, or from its first failure when it never answered."""
        since = self.last_ok.get(host, self.first_failed.setdefault(host, now))
        self.missed[host] = self.missed.get(host, 0) + 1
        if host not in self.down and now - since >= self.down_after_s and self.missed[host] >= self.down_polls:
            self.down.add(host)
            return True
        return False

    def silent_for(self, host: str, now: float) -> float:
        """Seconds since ``host`` last answered (since its first failure if it never did)."""
        return now - self.last_ok.get(host, self.first_failed.get(host, now))

    def is_up(self, host: str) -> bool:
        return host not in self.down
