"""The pure decision kernel: what to do, never how (no sockets, no processes, no clocks of its own).

Both the embedded gateway (``quart_provider``) and the gateway plugin (``gateway_plugin``) import it downward;
it imports neither. One module per rule:

- :mod:`.scheduling`: placement (QUART §6.2 cache-aware placer, first-fit baseline) and start planning — the
  source of each new replica (BlitzScale fork / peer fetch / multicast chain / live start; ParaServe's
  parallel fetch group, :mod:`.scheduling.paraserve`);
- :mod:`.convergence`: the platform's view → start / stop / drain / retire actions (the live reconciler and
  the simulator call the same function);
- :mod:`.replicaset`: bounds (:func:`.replicaset.within_bounds`), shortfall and surplus, start-time estimate;
- :mod:`.admission` and :mod:`.shedding`: admission by time, the client's deadline, Retry-After;
- :mod:`.picking`: the one pick rule for a request's replica;
- :mod:`.capacity`: why a function cannot run (deploy refusal, not-ready reason).
"""
