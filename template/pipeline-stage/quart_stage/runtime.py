"""StageRuntime: one pipeline stage — its parameters, input validation, compute, and response.

Lifecycle (fork-safe by construction):
  1. `StageRuntime.load(cfg)` / `from_tensors(...)`: read the manifest and the stage's tensors into host
     memory and attach them to a meta-built module. No CUDA call, no tensor compute, no thread: a
     KeysManager zygote can `fork` right after.
  2. `prepare_device()` in the replica (after fork): buffers computed from the config (rotary tables,
     position ids), the device copy for cuda, torch thread count.
  3. `handle(body, headers)` per request -> `StageResponse` (never raises for bad input: 4xx JSON).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Mapping

import numpy as np
import torch

from quart_stage import jsonparse, wire
from quart_stage.batchwire import H_SESSION_BATCH
from quart_stage.config import ConfigError, StageConfig
from quart_stage.device_copy import move_module
from quart_stage.emulated import ServiceTime, StepTime, service_time_for, step_time_for
from quart_stage.errors import QuartError, invalid
from quart_stage.inputs import (
    ATTENTION_MASK,
    HIDDEN,
    INPUT_IDS,
    LOGITS,
    SEGMENT_LENGTHS,
    TOKEN_TYPE_IDS,
    check_json_size,
    check_text,
    dt,
    int_matrix,
    validate,
)
from quart_stage.kvcache import H_KV_TOKENS
from quart_stage.layers import (
    H_LAYERS,
    H_LAYERS_HELD,
    LiveProgress,
    Shape,
    fmt,
    manifest_shape,
    not_held,
    parse_layers,
    range_share,
)
from quart_stage.manifest import Manifest, StageEntry, stage_path
from quart_stage.presets import paper_profile
from quart_stage.response import (  # noqa: F401 - StageResponse and the header names are used from here too
    H_COMPUTE,
    H_DESER,
    H_MODE,
    H_MODEL,
    H_REQUEST_ID,
    H_SER,
    H_STAGE,
    JSON_TYPE,
    StageResponse,
    elapsed_ms,
)
from quart_stage.sessions import H_SESSION, Generation, parse_session

JSON_DATA_LIMIT = 1 << 16
_THREAD = threading.local()  # per thread: the torch thread count it set (StageRuntime.prepare_device)
"""JSON responses carry the output values only up to this many elements (always shape, dtype, argmax)."""


class StageRuntime:
    """One stage of one model; see the module docstring for the lifecycle."""

    def __init__(self, cfg: StageConfig, manifest: Manifest | None, tensors: Mapping[str, torch.Tensor] | None):
        self.cfg = cfg
        self.manifest = manifest
        self.module = None
        self.parameter_bytes = 0
        if manifest is not None:
            if cfg.num_stages is not None and cfg.num_stages != manifest.num_stages:
                raise ConfigError(
                    f"QUART_NUM_STAGES={cfg.num_stages} but {cfg.model_dir} holds {manifest.num_stages} stages")
            self.entry: StageEntry | None = manifest.stage(cfg.stage_index)
            self.num_stages = manifest.num_stages
        else:
            self.entry = None
            self.num_stages = cfg.num_stages or 1
        # the stage's layer range [S, E) and the model's layer count (None without a manifest: no layer list)
        self.stage_range: tuple[int, int] | None = (self.entry.start, self.entry.end) if manifest else None
        self.total_layers = len(manifest.layers) if manifest else 0
        self.progress: LiveProgress | None = None  # set on a live replica: the layers verified so far
        self._shapes: dict[tuple[int, int], Shape] = {}
        self.shape = self._shape()
        self.service_time: ServiceTime | None = None
        self.step_time: StepTime | None = None  # emulated generation steps (quart_stage.sessions)
        if cfg.compute == "emulated":
            stage_bytes = [s.parameter_bytes for s in manifest.stages] if manifest else [0] * self.num_stages
            profile = cfg.profile or (manifest.profile if manifest else None)
            try:
                self.service_time = service_time_for(
                    mean_ms=cfg.emulated_mean_ms, cv=cfg.emulated_cv, profile=profile,
                    stage_bytes=stage_bytes, index=cfg.stage_index)
                self.step_time = step_time_for(
                    decode_ms=cfg.emulated_decode_ms, prefill_ms_per_token=cfg.emulated_prefill_ms_per_token,
                    mean_ms=cfg.emulated_mean_ms, cv=cfg.emulated_cv, profile=profile,
                    stage_bytes=stage_bytes, index=cfg.stage_index)
            except (KeyError, ValueError) as exc:
                raise ConfigError(str(exc).strip('"')) from None
        if tensors is not None:
            from quart_stage.families import StageModule, make_config

            self.module = StageModule(make_config(manifest.config), self.entry.start, self.entry.end, tensors)
            self.parameter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        elif cfg.compute != "emulated":
            raise ConfigError(f"compute mode {cfg.compute!r} needs the stage's parameters")
        # where the parameters came from: "memory" (a file or someone's tensors), "node-cache" (quart_stage.attach)
        self.parameter_source = "memory" if tensors is not None else "none"
        self._tokenizer = None
        self._rng = random.Random(cfg.seed)
        self._device = torch.device("cpu")
        self._prepare_lock = threading.Lock()  # a lock object, not a thread: safe to fork while unlocked
        self.prepared = False
        self._cores_seen: int | None = None  # cores at its first request (bound_threads: a resize changes them)
        self.generation = Generation(self)  # generation sessions (KV caches); its sweeper starts with the first

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def load(cls, cfg: StageConfig) -> StageRuntime:
        """Load the stage named by `cfg` into host memory (fork-safe: no GPU, no threads, no compute)."""
        if cfg.model_dir is None:
            if cfg.model_url is not None:
                raise ConfigError(f"QUART_MODEL_URL={cfg.model_url}: a stage reaches the model registry only through "
                                  "its node's KeysManager (QUART_KEYSMANAGER_SOCKET), and that did not work; put the "
                                  "model in the image (QUART_MODEL_DIR) or run the stage where a KeysManager caches it")
            return cls(cfg, None, None)
        manifest = Manifest.load(cfg.model_dir)
        entry = manifest.stage(cfg.stage_index)
        if entry.file is None:
            if cfg.compute != "emulated":
                raise ConfigError(f"{cfg.model_dir} was partitioned without weights: only emulated compute runs it")
            return cls(cfg, manifest, None)
        return cls(cfg, manifest, read_stage_file(cfg.model_dir, entry, verify=cfg.verify_checksum))

    @classmethod
    def from_tensors(cls, cfg: StageConfig, manifest: Manifest, tensors: Mapping[str, torch.Tensor]) -> StageRuntime:
        """Build the stage around tensors someone else holds (attached by reference, never copied)."""
        return cls(cfg, manifest, tensors)

    def _shape(self) -> Shape:
        m, i = self.manifest, self.cfg.stage_index
        if m is not None:
            return self.shape_for(self.stage_range)
        if self.cfg.profile is None:
            raise ConfigError("a stage without QUART_MODEL_DIR needs QUART_PROFILE (emulated, parameter-free)")
        try:
            p = paper_profile(self.cfg.profile)
        except KeyError as exc:
            raise ConfigError(str(exc).strip('"')) from None
        return Shape(
            model=self.cfg.model or p.name, takes_ids=i == 0, gives_logits=False,
            dtype=wire.DTYPE_NAMES[p.dtype], in_width=None if i == 0 else p.hidden, out_width=p.hidden,
            vocab_size=None, type_vocab_size=None, max_seq=None,
        )

    def shape_for(self, span: tuple[int, int]) -> Shape:
        """The shape of layers ``span`` of this stage (input follows its start, output its end)."""
        shape = self._shapes.get(span)
        if shape is None:
            m = self.manifest
            shape = self._shapes[span] = manifest_shape(m.model, m.config, wire.DTYPE_NAMES[m.dtype], *span,
                                                        self.total_layers)
        return shape

    def held(self) -> tuple[int, int] | None:
        """The contiguous layers this replica can run now: the whole stage, or a live replica's verified prefix."""
        if self.stage_range is None:
            return None
        return self.stage_range if self.progress is None else self.progress.held()

    # -- after fork ------------------------------------------------------------------------------
    def prepare_device(self) -> None:
        """Bound this thread's torch threads; once: pick the device, build computed buffers, copy parameters for
        cuda."""
        self.bound_threads()
        if self.prepared:
            return
        with self._prepare_lock:  # gthread workers may race here on their first requests
            if self.prepared:
                return
            if self.cfg.seed is None:
                self._rng = random.Random()  # fresh entropy per replica: forked siblings must not draw alike
            if self.module is not None and self.cfg.compute != "emulated":
                if self.cfg.compute == "cuda":
                    if not torch.cuda.is_available():
                        raise ConfigError("QUART_COMPUTE=cuda but no CUDA device is visible")
                    self._device = torch.device(self.cfg.device or "cuda:0")
                    move_module(self.module, self._device, self.cfg.device_copy)
                self.module.materialize_buffers(self._device)
            if self.shape.takes_ids and self.manifest is not None and self.manifest.tokenizer:
                self._load_tokenizer(self.manifest.tokenizer)  # read while the model folder is readable
            self.prepared = True

    def bound_threads(self) -> None:
        """``torch.set_num_threads(QUART_THREADS)`` in this thread, once, before its first torch op.

        It bounds OpenMP in the calling thread only: a request thread (a gthread worker, the KeysManager's
        threaded server) that never called it computes with an OpenMP pool of every core (measured: threads set
        to 1 in the main thread, a new thread's matmuls spawned OpenMP workers and ran 3.6x slower on the loaded
        2-core machine). So every thread that serves a request sets it first (``handle``)."""
        threads = self.cfg.threads
        cores = len(os.sched_getaffinity(0))
        if self._cores_seen is None:
            self._cores_seen = cores
        elif cores != self._cores_seen:  # resized in place (quart_kernel.resize): the threads follow its cores
            threads = cores
        if getattr(_THREAD, "threads", None) != threads:
            torch.set_num_threads(max(1, threads))
            _THREAD.threads = threads

    def cpu_factor(self) -> float:
        """Emulated compute's time multiplier on this replica's cores c (its CPU affinity): 1 − f + f/c with f =
        ``QUART_EMULATED_CPU_FRACTION`` (1 at one core; the simulator's ``Calibration.cpu_factor``)."""
        f = self.cfg.emulated_cpu_fraction
        return 1.0 - f + f / len(os.sched_getaffinity(0)) if f > 0 else 1.0

    # -- properties ------------------------------------------------------------------------------
    @property
    def model(self) -> str:
        return self.shape.model

    @property
    def stage_index(self) -> int:
        return self.cfg.stage_index

    @property
    def compute(self) -> str:
        return self.cfg.compute

    # -- requests --------------------------------------------------------------------------------
    def handle(self, body: bytes | bytearray | memoryview, headers: Mapping[str, str]) -> StageResponse:
        """Run one request. Bad input -> 4xx JSON naming the field; a failure inside compute -> 500 JSON."""
        t0 = time.perf_counter()
        self.bound_threads()
        headers = {k.lower(): v for k, v in headers.items()}
        request_id = headers.get(H_REQUEST_ID.lower()) or uuid.uuid4().hex
        base = self.response_headers(request_id)
        session = None
        if H_SESSION_BATCH.lower() in headers:
            return self._batched_step(body, headers, base, t0)
        try:
            self._check_route(headers)
            session = parse_session(headers) if H_SESSION.lower() in headers else None
            span, shape = self._layers(headers.get(H_LAYERS.lower()), base)
            inputs, metadata = self._parse(body, headers, shape)
            self._check_route(metadata)
            validate(inputs, shape, self.cfg, self.stage_index)
            new = self.generation.check(session, inputs, span) if session else 0
        except QuartError as exc:
            base[H_DESER] = elapsed_ms(t0)
            if session is not None:
                base.update(self.generation.headers(session.id))
            return StageResponse.error(exc, {**base, **exc.headers})
        t1 = time.perf_counter()
        if session is not None:
            return self.generation.step(session, inputs, new, base, (t0, t1), span)
        try:
            self.prepare_device()
            output = self._compute(inputs, span)
        except Exception as exc:  # noqa: BLE001 - any compute failure is answered, the worker keeps serving
            return StageResponse.json(500, {"error": f"stage compute failed: {exc}", "field": "compute"},
                                      {**base, H_DESER: elapsed_ms(t0, t1), H_COMPUTE: elapsed_ms(t1)})
        t2 = time.perf_counter()
        name = LOGITS if shape.gives_logits else HIDDEN
        mask = inputs.get(ATTENTION_MASK)
        if JSON_TYPE in headers.get("accept", "") and wire.CONTENT_TYPE not in headers.get("accept", ""):
            chunks = [json.dumps(self._json_output(name, output, request_id, mask)).encode()]
            ctype = JSON_TYPE
        else:
            # the next hop: the next stage, or this stage again for the rest of its layers (a sub-range)
            more = span is not None and span[1] < self.stage_range[1]
            meta = self.next_hop_meta(request_id, more)
            outputs = {name: output}  # the mask or a packed row's segments, for the next stage
            outputs.update({k: inputs[k] for k in (ATTENTION_MASK, SEGMENT_LENGTHS) if k in inputs})
            chunks = wire.encode_chunks(outputs, meta)
            ctype = wire.CONTENT_TYPE
        t3 = time.perf_counter()
        if span is not None:
            base[H_LAYERS] = fmt(span)
        base.update({"Content-Type": ctype, H_DESER: elapsed_ms(t0, t1), H_COMPUTE: elapsed_ms(t1, t2),
                     H_SER: elapsed_ms(t2, t3)})
        return StageResponse(200, chunks, base)

    def _batched_step(self, body, headers: Mapping[str, str], base: dict[str, str], t0: float) -> StageResponse:
        """A batched decode step of several sessions (quart_stage.sessionbatch); 400 for the batch as a whole."""
        try:
            self._check_route(headers)
            entries, rows = self.generation.batched.parse(body, headers)
        except QuartError as exc:
            base.update({H_DESER: elapsed_ms(t0), H_KV_TOKENS: self.generation.table.occupancy()})
            return StageResponse.error(exc, {**base, **exc.headers})
        return self.generation.batched.step(entries, rows, base, t0)

    def next_hop_meta(self, request_id: str, more: bool) -> dict[str, str]:
        """The safetensors metadata of an output: the stage it goes to (this one again when ``more`` of its layers
        remain: a sub-range), who made it, and the request id."""
        return {"model": self.model, "stage": str(self.stage_index + (0 if more else 1)),
                "producer": str(self.stage_index), "request_id": request_id}

    def response_headers(self, request_id: str | None = None) -> dict[str, str]:
        """The X-Quart-* headers of every response; phases not reached report 0.000 ms; the layers held."""
        out = {H_REQUEST_ID: request_id or uuid.uuid4().hex, H_MODEL: self.model, H_STAGE: str(self.stage_index),
               H_MODE: self.cfg.compute, H_DESER: "0.000", H_COMPUTE: "0.000", H_SER: "0.000"}
        held = self.held()
        if held is not None:
            out[H_LAYERS_HELD] = fmt(held)
        return out

    def _layers(self, value: str | None, base: dict[str, str]) -> tuple[tuple[int, int] | None, Shape]:
        """The layer range a request asks for and its shape; 400 when malformed or outside the stage, 503 when
        this replica does not hold all of it (yet)."""
        if self.stage_range is None:
            if value is not None:
                raise invalid("layers", f"{H_LAYERS}: this stage has no manifest, so no layer list to pick from")
            return None, self.shape
        span = parse_layers(value, self.stage_range)
        held = self.held()
        base[H_LAYERS_HELD] = fmt(held)
        if not held[0] <= span[0] < span[1] <= held[1]:
            raise not_held(span, held)
        return span, self.shape_for(span)

    def _check_route(self, source: Mapping[str, str]) -> None:
        model = source.get(H_MODEL.lower(), source.get("model"))
        if model is not None and model != self.model:
            raise invalid("model", f"this is model {self.model!r}, the request is for {model!r}")
        stage = source.get(H_STAGE.lower(), source.get("stage"))
        if stage is not None and stage != str(self.stage_index):
            raise invalid("stage", f"this is stage {self.stage_index}, the request is for stage {stage!r}")

    def _parse(self, body, headers: Mapping[str, str], shape: Shape) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        ctype = headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == JSON_TYPE:
            if not shape.takes_ids:
                raise invalid(
                    "content-type", f"stage {self.stage_index} takes activations as {wire.CONTENT_TYPE} "
                    "(safetensors), not JSON", status=415)
            return self._parse_json(body), {}
        if ctype not in ("", wire.CONTENT_TYPE):
            raise invalid("content-type", f"unsupported Content-Type {ctype!r}; send {wire.CONTENT_TYPE}"
                                  + (" or application/json" if shape.takes_ids else ""), status=415)
        decoded = wire.decode(body)
        return decoded.tensors, {k: v for k, v in decoded.metadata.items() if k in ("model", "stage")}

    def _parse_json(self, body) -> dict[str, torch.Tensor]:
        check_json_size(len(body), self.cfg, self.shape.max_seq)  # 413 before parsing expands it
        doc = jsonparse.loads(body)  # NaN, deep nesting, huge integers: 400 naming the body
        if not isinstance(doc, dict):
            raise invalid("body", 'JSON input must be an object like {"input_ids": [[1, 2, 3]]}')
        unknown = set(doc) - {INPUT_IDS, TOKEN_TYPE_IDS, ATTENTION_MASK, "text"}
        if unknown:
            raise invalid(sorted(unknown)[0], "unknown field; expected input_ids, token_type_ids, "
                                                      "attention_mask or text")
        if "text" in doc:
            if INPUT_IDS in doc or ATTENTION_MASK in doc:
                raise invalid("text", "send either text or input_ids (and attention_mask), not both")
            return self._tokenize(doc["text"])
        if INPUT_IDS not in doc:
            raise invalid(INPUT_IDS, 'missing; send {"input_ids": [[...]]}')
        bound = (self.cfg.max_batch, self.shape.max_seq)  # checked before any tensor is allocated
        out = {INPUT_IDS: int_matrix(doc[INPUT_IDS], INPUT_IDS, *bound)}
        for name in (TOKEN_TYPE_IDS, ATTENTION_MASK):
            if name in doc:
                out[name] = int_matrix(doc[name], name, *bound)
        return out

    def _tokenize(self, text) -> dict[str, torch.Tensor]:
        """Token ids of one text or a batch; texts of different lengths are padded on the right and get an
        ``attention_mask`` (right padding keeps each text's positions, so its outputs equal an unpadded run)."""
        texts = check_text(text, self.cfg, self.shape.max_seq)  # bounded before the tokenizer expands it
        tok_file = self.manifest.tokenizer if self.manifest else None
        if not tok_file:
            raise invalid("text", f"model {self.model!r} has no tokenizer file; send input_ids")
        self._load_tokenizer(tok_file)
        ids = [self._tokenizer.encode(t).ids for t in texts]
        longest = max(len(x) for x in ids)
        if all(len(x) == longest for x in ids):
            return {INPUT_IDS: torch.tensor(ids, dtype=torch.int64)}
        pad = (self._tokenizer.padding or {}).get("pad_id", 0)
        return {INPUT_IDS: torch.tensor([x + [pad] * (longest - len(x)) for x in ids], dtype=torch.int64),
                ATTENTION_MASK: torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in ids], dtype=torch.int64)}

    def _load_tokenizer(self, tok_file: str) -> None:
        """Read the tokenizer once; :meth:`prepare_device` does it before a replica drops to its own uid."""
        if self._tokenizer is None:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no thread pool in a forked replica
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(os.path.join(self.cfg.model_dir, tok_file))

    def _compute(self, inputs: dict[str, torch.Tensor], span: tuple[int, int] | None) -> torch.Tensor:
        if self.cfg.compute == "emulated":
            return self._emulate(inputs, span)
        if self._device.type != "cpu":
            inputs = {k: v.to(self._device, non_blocking=True) for k, v in inputs.items()}
        out = self.module(inputs) if span in (None, self.stage_range) else self.module(inputs, *span)
        return out.cpu() if out.device.type != "cpu" else out

    def _emulate(self, inputs: dict[str, torch.Tensor], span: tuple[int, int] | None) -> torch.Tensor:
        """Zeros of the output's shape after a service-time draw, scaled by the range's share of the stage's
        parameters (a half-stage costs about half)."""
        first = inputs[INPUT_IDS] if INPUT_IDS in inputs else inputs[HIDDEN]
        batch, seq = int(first.shape[0]), int(first.shape[1])
        shape = self.shape if span is None else self.shape_for(span)
        width = shape.out_width
        itemsize = torch.empty((), dtype=shape.dtype).element_size()
        if self.cfg.emulated_activation_bytes:
            width = max(1, -(-self.cfg.emulated_activation_bytes // (batch * seq * itemsize)))
        out = torch.zeros((batch, seq, width), dtype=shape.dtype)
        share = 1.0
        if span is not None and span != self.stage_range:
            share = range_share(self.manifest.layer_parameter_counts, span, self.stage_range)
        time.sleep(self.service_time.sample_ms(self._rng) * share * self.cpu_factor() / 1000.0)
        return out

    def _json_output(self, name: str, output: torch.Tensor, request_id: str, mask: torch.Tensor | None) -> dict:
        if name == LOGITS and output.dim() == 2:  # a pooling head (MiniLM): one vector per input, no logits
            name = "embedding"
        doc = {"model": self.model, "stage": self.stage_index, "request_id": request_id, "output": name,
               "dtype": dt(output.dtype), "shape": list(output.shape)}
        if mask is not None:
            doc[ATTENTION_MASK] = mask.tolist()
        if name == LOGITS:
            doc["argmax"] = output.argmax(-1).tolist()
        if output.numel() <= JSON_DATA_LIMIT:
            doc["data"] = output.float().tolist()
        return doc


def read_stage_file(model_dir: str, entry: StageEntry, verify: bool = False) -> dict[str, torch.Tensor]:
    """Read a stage file into one host buffer; the tensors view it (no second copy).

    The size is always checked against the manifest; with `verify`, the sha256 too.
    """
    path = stage_path(model_dir, entry.file)  # confined to the model folder
    size = os.path.getsize(path)
    if entry.file_bytes is not None and size != entry.file_bytes:
        raise ConfigError(f"{path} has {size} bytes, the manifest says {entry.file_bytes}: re-partition the model")
    buf = np.empty(size, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        view, done = memoryview(buf), 0
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                raise ConfigError(f"{path} ended after {done} of {size} bytes")
            done += n
    if verify and entry.sha256:
        digest = hashlib.sha256(view).hexdigest()
        if digest != entry.sha256:
            raise ConfigError(f"{path} does not match its manifest sha256: the checkpoint changed")
    try:
        return wire.decode(view, field=entry.file).tensors
    except QuartError as exc:
        raise ConfigError(f"{path} is not a valid safetensors file: {exc}") from None
