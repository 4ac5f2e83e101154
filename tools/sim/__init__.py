"""Cluster-scale discrete-event simulator of QUART-FaaS (package ``quart_tools.sim``).

It runs the live system's policy (`gateway_plugin.policies`), placer (`quart_kernel.scheduling`)
and eviction rule (`keysmanager.eviction`) against simulated time; see docs/simulator.md.
"""
