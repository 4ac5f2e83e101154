"""Token generation through a pipeline: sessions pinned per stage, prefill once then one position per step,
failover by replay, and the OpenAI-compatible API over it (docs/generation.md, "The gateway side").

- :mod:`.config`: the settings (``QUART_GEN_*``);
- :mod:`.params`: a generation request's parameters, checked before anything is tokenized;
- :mod:`.tokens`: the pipeline's tokenizer, chat template and incremental text with stop strings;
- :mod:`.kvbook`: KV-cache occupancy per replica, the entry admission;
- :mod:`.session`: one session in flight, and what the engine's helpers may ask of it;
- :mod:`.sessions`: the session engine (affinity, steps, replay), holding
  :mod:`.cooperative` (sessions split with a live replica) and :mod:`.groupsessions` (on a ParaServe group);
- :mod:`.openai_api`: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and generation on
  ``POST /function/<model>``.
"""
