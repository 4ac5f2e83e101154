"""What the KeysManager core refuses or fails to do: domain errors, no HTTP here.

The core (manager, zygotes, replicas) raises these; ``keysmanager.api`` answers each with an HTTP status
as a ``quart_stage.errors.QuartError``. ``field`` names the request field the error is about, if any.
(``keysmanager.client.KeysManagerError`` is the client's view of an error answer; not this.)
"""

from __future__ import annotations


class ManagerError(Exception):
    """Something the KeysManager cannot do for this request."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(ManagerError):
    """The request names a stage or a replica that does not exist."""


class InvalidSpec(ManagerError):
    """The stage's deployed environment cannot be read."""


class NoFreeSlot(ManagerError):
    """The host has too few free GPU slots for the replicas asked for."""


class NoRoom(ManagerError):
    """Host memory cannot hold the stage's parameters, even after evicting every zygote it may."""


class StartFailed(ManagerError):
    """A zygote did not load its parameters, or a fork from it failed."""


class RegistryUnavailable(ManagerError):
    """The model registry could not give the stage: unreachable, object missing, access denied, corrupt."""
