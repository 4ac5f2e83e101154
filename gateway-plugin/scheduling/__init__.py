"""Replica placement (QUART §6.2). Pure placers shared by the embedded gateway and the simulator."""

from gateway_plugin.scheduling.types import HostView, Placement, Placer, ReplicaRequest, ScheduleResult

__all__ = ["HostView", "Placement", "Placer", "ReplicaRequest", "ScheduleResult"]
