"""What both gateways speak over HTTP, below the embedded gateway (``quart_provider``) and the gateway plugin
(``gateway_plugin``), which import it downward; it holds no decision (that is ``quart_kernel``).

- :mod:`.upstream` (over :mod:`.http1`, :mod:`.headers`, :mod:`.dead_peer`): the lean HTTP/1.1 client every
  call to a replica goes through; :mod:`.upstream_aiohttp`: the same on aiohttp, and :mod:`.codec` the setting
  (``QUART_HTTP_CODEC``) that picks one; :mod:`.retry`: the one rule for which failed calls go to another replica;
- :mod:`.responses`: answers and the one ``{"error", "field"}`` error body of a ``QuartError``;
- :mod:`.tracing`: call ids and timing headers; :mod:`.exposition`: Prometheus ``/metrics`` rendering;
- :mod:`.auth`: Basic-auth credentials files; :mod:`.namespaces` and :mod:`.quantities`: the OpenFaaS API's
  ``name.namespace`` and CPU/memory quantity syntax.
"""
