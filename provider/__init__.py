"""The embedded OpenFaaS-compatible gateway: the OpenFaaS gateway REST API on one machine.

Functions are deployed, listed, scaled and invoked exactly as on an OpenFaaS gateway (faas-cli works
against it); replicas come from one KeysManager per simulated host instead of Kubernetes.
Entry points: `quartctl up/down/deploy` (:mod:`.cli`), the aiohttp app (:mod:`.routes`; handlers in
:mod:`.handlers_system` and :mod:`.handlers_invoke`) behind the fast ``/function`` front (:mod:`.front`), the core the plugin builds on
(:class:`.gateway.EmbeddedGateway`: :mod:`.registry`, :mod:`.reconciler`, :mod:`.balancer` over :mod:`.types`).
"""
