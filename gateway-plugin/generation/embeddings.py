"""OpenAI's ``POST /v1/embeddings`` for the pooled encoder pipelines (sentence embeddings: MiniLM's mean pooling).

The request is OpenAI's: ``model``, ``input`` (a string, a list of strings, a list of token ids or a list of
such lists; at most :data:`MAX_INPUTS`), ``encoding_format`` (``float`` or ``base64``: little-endian float32
bytes, what the ``openai`` client asks for by default), ``dimensions`` (honoured only as the model's own width:
a pooled BERT is no Matryoshka model, so any other value is refused by name), ``user`` (an end-user id; it
changes nothing). Any other field is refused by name. Everything is bounded before it is tokenized: the body
(``QUART_GEN_MAX_BODY_BYTES``), the number of inputs, the characters (``QUART_GEN_MAX_PROMPT_CHARS``).

A text is tokenized here with the model folder's ``tokenizer.json`` exactly as stage 0 tokenizes a ``text``
body (the ``tokenizers`` library, special tokens and the file's truncation), so each vector is the one
``POST /function/<model>`` answers for that text. Each input then goes as its own one-shot request (safetensors
``input_ids`` of one row) through the router's path (:meth:`gateway_plugin.router.Router.answer`): its stage
queues, its dynamic batching (the inputs of one request and of concurrent requests are packed into shared stage
calls, :mod:`gateway_plugin.batching`), its retries, its 429 + Retry-After when full. At most
:data:`IN_FLIGHT` inputs of one request wait in the queues at a time. A decoder pipeline, or an encoder with
no pooling head, is a 400 naming ``model``; an input longer than the model's positions is a context overflow
worded as OpenAI words it (code ``context_length_exceeded``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.tokens import ModelCatalog, context_exceeded, context_of
from gateway_plugin.metrics import MetricsCollector
from quart_stage.errors import QuartError, invalid
from quart_stage.manifest import Manifest
from quart_transport.responses import Answer

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
IN_FLIGHT = 64  # inputs of one request in the router's queues at a time (the rest wait their turn here)
FIELDS = ("model", "input", "encoding_format", "dimensions", "user")
FORMATS = ("float", "base64")
MAX_TOKEN_ID = 2**31 - 1
SAFETENSORS = "application/octet-stream"
TIMEOUT_HEADER = "X-Quart-Timeout-Ms"


class OneShot(Protocol):
    """The router's one-shot path: ``(model, method, tail, headers, body)`` -> its answer."""

    def __call__(self, model: str, method: str, tail: str, headers: Mapping[str, str],
                 body: bytes) -> Awaitable[Answer]: ...


class EmbeddingsAPI:
    """``/v1/embeddings`` over ``one_shot``; ``pipelines()`` and ``model_dir(model)`` as the generation API's."""

    def __init__(self, one_shot: OneShot, pipelines: Callable[[], dict[str, list[str]]],
                 model_dir: Callable[[str], str | None], config: GenerationConfig, catalog: ModelCatalog,
                 collector: MetricsCollector | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.one_shot = one_shot
        self.pipelines = pipelines
        self.model_dir = model_dir
        self.config = config
        self.catalog = catalog
        self.collector = collector
        self.clock = clock
        self._models: dict[str, tuple[float, Manifest, Tokenizer | None]] = {}  # folder -> (mtime, manifest, tok)

    @staticmethod
    def pooled(manifest: Manifest) -> bool:
        """Whether a partitioned model answers one pooled vector per input (its head is a pooling layer)."""
        from quart_stage.families import plan_for

        try:
            return manifest.family == "encoder" and "pooling" in plan_for(manifest.config).head_prefixes
        except (ValueError, KeyError, TypeError):
            return False

    async def embed(self, doc: Any, headers: Mapping[str, str]) -> dict[str, Any]:
        """OpenAI's embeddings answer to the request ``doc`` (a :class:`QuartError` for anything wrong)."""
        arrival = self.clock()
        model, inputs, encoding, dimensions = self._parse(doc)
        if not self.pipelines().get(model):
            raise QuartError(404, f"no pipeline named {model!r} is deployed (GET /v1/models lists them)", "model")
        manifest, tokenizer = await self._model(model)
        width = int(manifest.config.get("hidden_size") or 0)
        if dimensions is not None and dimensions != width:
            raise invalid("dimensions", f"dimensions {dimensions} is not supported by pipeline {model!r}: its "
                                        f"embeddings have {width} dimensions and cannot be shortened")
        ids = await asyncio.to_thread(self._ids, inputs, manifest, tokenizer) if any(
            isinstance(x, str) for x in inputs) else self._ids(inputs, manifest, tokenizer)
        serving = self.collector.serving if self.collector is not None else None
        if serving is not None:
            serving.running.labels(model).inc()
        try:
            vectors = await self._run(model, ids, headers)
        finally:
            if serving is not None:
                serving.running.labels(model).dec()
        tokens = sum(len(x) for x in ids)
        if serving is not None:
            serving.finished(model, self.clock() - arrival, tokens)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    # ------------------------------------------------------------------ the request

    def _parse(self, doc: Any) -> tuple[str, list[str | list[int]], str, int | None]:
        if not isinstance(doc, dict):
            raise invalid("body", "the request body must be a JSON object")
        for key in doc:
            if key not in FIELDS:
                raise invalid(key, f"{key} is not supported by /v1/embeddings (it takes {', '.join(FIELDS)})")
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise invalid("model", "model must name a deployed pipeline (GET /v1/models lists them)")
        encoding = doc.get("encoding_format") or "float"
        if encoding not in FORMATS:
            raise invalid("encoding_format", f"encoding_format must be float or base64, got {encoding!r}")
        dimensions = doc.get("dimensions")
        if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
            raise invalid("dimensions", f"dimensions must be a positive integer, got {dimensions!r}")
        user = doc.get("user")
        if user is not None and not isinstance(user, str):
            raise invalid("user", "user must be a string")
        return model, self._inputs(doc.get("input")), encoding, dimensions

    def _inputs(self, value: Any) -> list[str | list[int]]:
        """``input`` as a list of texts and token-id lists, bounded (count, characters) before anything else."""
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(i) for i in value)):
            items: list[Any] = [value]
        elif isinstance(value, list) and value:
            items = value
        else:
            raise invalid("input", "input must be a non-empty string, a list of strings, a list of token ids or "
                                   "a list of such lists")
        if len(items) > MAX_INPUTS:
            raise invalid("input", f"{len(items)} inputs; at most {MAX_INPUTS} in one request")
        chars = 0
        for i, item in enumerate(items):
            where = f"input[{i}]"
            if isinstance(item, str):
                if not item:
                    raise invalid("input", f"{where} is an empty string")
                chars += len(item)
                if chars > self.config.max_prompt_chars:
                    raise invalid("input", f"the inputs hold more than {self.config.max_prompt_chars} characters "
                                           "(QUART_GEN_MAX_PROMPT_CHARS)", 413)
            elif not (isinstance(item, list) and item and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in item)):
                raise invalid("input", f"{where} must be a non-empty string or a non-empty list of token ids")
        return items

    def _ids(self, inputs: list[str | list[int]], manifest: Manifest, tokenizer: Tokenizer | None) -> list[list[int]]:
        """Each input's token ids (a text as stage 0 tokenizes it), checked against the vocabulary and context."""
        vocab, context = int(manifest.config.get("vocab_size") or 0), context_of(manifest)
        out = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                if tokenizer is None:
                    raise invalid("input", f"pipeline {manifest.model!r} has no tokenizer: send token ids")
                ids = tokenizer.encode(item).ids
            else:
                ids = item
                bad = next((t for t in ids if t >= vocab), None) if vocab else None
                if bad is not None:
                    raise invalid("input", f"input[{i}]: token id {bad} is outside the vocabulary (0..{vocab - 1})")
            if len(ids) > context:
                raise context_exceeded("input", f"This model's maximum context length is {context} tokens. However, "
                                                f"you requested {len(ids)} tokens in the input for embedding "
                                                "generation. Please reduce the length of the input.")
            out.append(list(ids))
        return out

    async def _model(self, model: str) -> tuple[Manifest, Tokenizer | None]:
        """The pipeline's manifest and tokenizer (loaded once per folder, again when its manifest changes); a 400
        naming ``model`` unless it is a pooled encoder."""
        folder, mtime = await self.catalog.folder(model, self.model_dir(model))
        hit = self._models.get(folder)
        if hit is None or hit[0] != mtime:
            hit = self._models[folder] = (mtime, *await asyncio.to_thread(_load, folder))
        manifest = hit[1]
        if not self.pooled(manifest):
            what = ("a decoder: it generates text (use /v1/completions or /v1/chat/completions)"
                    if manifest.family == "decoder" else "an encoder without a pooling head: it answers token states")
            raise invalid("model", f"pipeline {model!r} ({manifest.model_type}) is {what}; /v1/embeddings serves "
                                   "the pooled encoder pipelines (sentence embeddings)")
        return manifest, hit[2]

    # ------------------------------------------------------------------ through the router

    async def _run(self, model: str, ids: list[list[int]], headers: Mapping[str, str]) -> list[torch.Tensor]:
        from quart_stage import wire

        ident = f"embd-{uuid.uuid4().hex[:20]}"
        sent = {"Content-Type": SAFETENSORS, "Accept": SAFETENSORS}
        if TIMEOUT_HEADER in headers:
            sent[TIMEOUT_HEADER] = headers[TIMEOUT_HEADER]
        turns = asyncio.Semaphore(IN_FLIGHT)

        async def one(i: int, row: list[int]) -> Answer:
            import torch

            body = wire.encode_bytes({"input_ids": torch.tensor([row], dtype=torch.int64)})
            async with turns:
                return await self.one_shot(model, "POST", "", {**sent, "X-Quart-Request-Id": f"{ident}-{i}"}, body)

        answers = await asyncio.gather(*(one(i, row) for i, row in enumerate(ids)))
        vectors = []
        for answer in answers:
            if answer.status != 200:
                raise _error_of(answer)
            try:
                tensors = wire.decode(bytes(answer.body), "stage answer").tensors
            except QuartError as exc:
                raise QuartError(502, f"pipeline {model!r} answered what is not safetensors: {exc.message}",
                                 "stage") from None
            out = tensors.get("logits")
            if out is None or out.dim() != 2 or out.shape[0] != 1:
                shape = None if out is None else list(out.shape)
                raise QuartError(502, f"pipeline {model!r} answered {sorted(tensors)} {shape}, not one pooled "
                                      "vector per input", "stage")
            vectors.append(out[0].float())
        return vectors


def _load(folder: str) -> tuple[Manifest, Tokenizer | None]:
    manifest = Manifest.load(folder)
    if not manifest.tokenizer:
        return manifest, None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer

    return manifest, Tokenizer.from_file(os.path.join(folder, manifest.tokenizer))


def _error_of(answer: Answer) -> QuartError:
    """The router's error answer (``{"error", "field"}``) as a :class:`QuartError`, its Retry-After kept."""
    from quart_stage import jsonparse

    try:
        doc = jsonparse.loads(bytes(answer.body))
    except QuartError:
        doc = None
    said: dict[str, Any] = doc if isinstance(doc, dict) else {}
    message, field = said.get("error"), said.get("field")
    if not isinstance(message, str):
        message = f"the pipeline answered HTTP {answer.status}"
    if not isinstance(field, str):
        field = None
    kept = {k: v for k, v in answer.headers.items() if k.lower() == "retry-after"}
    return QuartError(answer.status, message, field, kept)


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def _is_int(value: Any) -> bool:
    return type(value) is int  # noqa: E721 - bool is not a token id nor a dimension
