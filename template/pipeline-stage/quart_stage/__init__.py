"""quart_stage: the runtime of one pipeline stage of QUART-FaaS (see docs/stage-runtime.md).

Modules: config (StageConfig from QUART_* env), presets (model presets, paper profiles), families
(layer plans, StageModule), manifest (manifest.json), wire (safetensors activation format), emulated
(gamma service times), runtime (StageRuntime), app (flask app), handler (OpenFaaS handler contract),
serve (gunicorn on an ephemeral port), verify (the unpartitioned reference), attach (start from the node's
KeysManager cache), segment (the layout and mapping of a shared-memory parameter segment), unixhttp (HTTP
over a Unix socket), nodecache (the stage's spec and JSON calls to the node's KeysManager, no torch), forward
and proxy (a stage pod's fork path: a replica forked by the node's KeysManager, this pod forwarding to it, no
torch); settings, errors, labels:
the vocabulary every component shares (this package is the lowest layer: every stage image ships it).

Fork safety: numpy's OpenBLAS starts a thread pool when numpy is imported (torch imports numpy), and a
process that forks replicas must have no threads. Importing this package first sets
OPENBLAS_NUM_THREADS=1 (unless already set), so a zygote that imports quart_stage before torch or numpy
stays single-threaded until `StageRuntime.prepare_device()` runs in the forked replica.
"""

import os as _os

_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
_os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
