"""quart_stage: the runtime of one pipeline stage of QUART-FaaS (see docs/stage-runtime.md).

Modules: config (StageConfig from QUART_* env), presets (model presets, paper profiles), families
(layer plans, StageModule), manifest (manifest.json), wire (safetensors activation format), emulated
(gamma service times), runtime (StageRuntime), app (flask app), handler (OpenFaaS handler contract),
bench_serialization (`quartctl bench serialization`).
"""
