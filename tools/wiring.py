"""The composition root's typed wiring: the plugin attached to the embedded gateway through its ports.

``make lint`` type-checks this module with the plugin and the gateway, so the embedded gateway handed to the plugin
as its :class:`gateway_plugin.ports.PluginHost` is checked member by member here (the OpenFaaS view is checked where
the standalone plugin builds its ``GatewayView`` over it, a :class:`gateway_plugin.ports.Platform`)."""

from __future__ import annotations

from gateway_plugin.plugin import Plugin, attach
from gateway_plugin.ports import PluginHost
from quart_provider.gateway import EmbeddedGateway
from quart_provider.system import PluginAttach


def embedded_host(gateway: EmbeddedGateway) -> PluginHost:
    """The embedded gateway as the plugin's host: every member of the port, with its types."""
    return gateway


def plugin_attach() -> PluginAttach:
    """``gateway_plugin.plugin.attach`` as the embedded system calls it (``EmbeddedSystem(plugin=...)``)."""

    async def attach_embedded(gateway: EmbeddedGateway, app: object) -> Plugin:
        return await attach(embedded_host(gateway), app)

    return attach_embedded
