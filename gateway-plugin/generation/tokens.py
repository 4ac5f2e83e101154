"""A pipeline's tokenizer on the gateway: prompts and chat messages to token ids, token ids to text.

The files are those of the partitioned model folder (``QUART_MODEL_DIR`` of the pipeline's stage 0):
``manifest.json`` (the family, the context length, the EOS ids), ``tokenizer.json`` and, when the source
had them, ``tokenizer_config.json`` / ``chat_template.jinja`` (special tokens and the chat template),
read with transformers' ``PreTrainedTokenizerFast``. Loaded once per folder, in a thread. A model that only
the registry holds (stage 0 has ``QUART_MODEL_URL``, no folder) has those files fetched once into a local
cache folder (``QUART_GEN_TOKENIZER_CACHE``) first.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from gateway_plugin.generation.params import GenerationParams
from quart_stage.errors import QuartError, invalid
from quart_stage.manifest import Manifest
from quart_stage.settings import setting

log = logging.getLogger("quart.generation")
REGISTRY_SCHEME = "s3://"


@dataclass(frozen=True, slots=True, eq=False)
class ModelInfo:
    """What generation needs to know about one decoder pipeline."""

    name: str
    model_dir: str
    context: int  # positions the model can hold (max_position_embeddings)
    eos_ids: frozenset[int]
    tokenizer: Any  # transformers.PreTrainedTokenizerFast

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt_ids(self, params: GenerationParams) -> list[int]:
        """The prompt's token ids (the caller bounded the text by characters first)."""
        if params.prompt_ids is not None:
            vocab = len(self.tokenizer)
            bad = next((i for i in params.prompt_ids if i >= vocab), None)
            if bad is not None:
                raise invalid("prompt", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
            return list(params.prompt_ids)
        if params.messages is not None:
            if not self.has_chat_template:
                raise invalid("messages", f"pipeline {self.name!r} has no chat template; use /v1/completions")
            messages = [{"role": role, "content": text} for role, text in params.messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return list(self.tokenizer.encode(params.prompt or "", add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_model(name: str, model_dir: str) -> ModelInfo:
    """The tokenizer and limits of a partitioned decoder; a 400 for an encoder or a folder without a tokenizer."""
    manifest = Manifest.load(model_dir)
    if manifest.family != "decoder":
        raise invalid("model", f"pipeline {name!r} is a {manifest.family} ({manifest.model_type}), not a decoder: "
                               "it does not generate text")
    if not manifest.tokenizer:
        raise invalid("model", f"pipeline {name!r} has no tokenizer in {model_dir}")
    from transformers import PreTrainedTokenizerFast

    if os.path.isfile(os.path.join(model_dir, "tokenizer_config.json")):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, manifest.tokenizer))
    eos = manifest.config.get("eos_token_id")
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(int(tokenizer.eos_token_id))
    return ModelInfo(name, model_dir, context_of(manifest), frozenset(int(i) for i in eos_ids), tokenizer)


CONTEXT_CODE = "context_length_exceeded"  # OpenAI's code of a request that does not fit the model's context


def context_of(manifest: Manifest) -> int:
    """Positions a partitioned model holds (its config's ``max_position_embeddings``; 2048 when it says none)."""
    return int(manifest.config.get("max_position_embeddings") or manifest.config.get("n_positions") or 2048)


def max_tokens_for(context: int, prompt_len: int, requested: int | None, door: str, default: int) -> int:
    """A request's max_tokens, or its door's default: 16 on ``/v1/completions`` (OpenAI's), else the rest of the
    context (vLLM's), bounded by ``default`` (``QUART_GEN_DEFAULT_MAX_TOKENS``) when that is above 0. An overflow is
    worded as OpenAI and vLLM word it (clients such as LiteLLM map it to their context-window error). Pure."""
    room = context - prompt_len
    if prompt_len < 1:
        raise invalid("prompt", "the prompt has no tokens")
    what = "messages" if door == "chat" else "prompt"
    if room < 1:
        raise context_exceeded(what, f"This model's maximum context length is {context} tokens. However, your "
                                     f"request has {prompt_len} input tokens. Please reduce the length of the "
                                     f"{'input messages' if door == 'chat' else 'prompt'}.")
    if requested is None:
        return min(room, 16) if door == "completion" else min(room, default) if default > 0 else room
    if requested > room:
        raise context_exceeded("max_tokens", f"This model's maximum context length is {context} tokens. However, you "
                                             f"requested {prompt_len + requested} tokens ({prompt_len} in the {what}, "
                                             f"{requested} in the completion). Please reduce the length of the {what} "
                                             "or completion.")
    return requested or 1  # 0 (echo): the prefill's step runs, its token is not answered


def context_exceeded(field_name: str, message: str) -> QuartError:
    """A 400 for a request that does not fit the model's context: worded by the caller as OpenAI words it
    ("This model's maximum context length is ..."; LiteLLM maps that to its context-window error), with OpenAI's
    code."""
    return QuartError(400, message, field_name, detail={"code": CONTEXT_CODE})


def is_registry_url(source: str | None) -> bool:
    return bool(source) and str(source).startswith(REGISTRY_SCHEME)


def default_tokenizer_cache() -> str:
    return os.path.join(setting("XDG_CACHE_HOME", str, "") or os.path.expanduser("~/.cache"), "quart-faas", "tokenizers")


def fetch_tokenizer(url: str, cache_root: str) -> str:
    """The local folder holding ``url``'s manifest and tokenizer, under ``cache_root`` (one manifest GET when
    the copy there is current). Runs in a thread."""
    from keysmanager.registry import ModelRegistry, RegistryError

    folder = os.path.join(cache_root, hashlib.sha256(url.encode()).hexdigest()[:24])
    try:
        os.makedirs(cache_root, mode=0o700, exist_ok=True)
        return str(ModelRegistry(url).tokenizer_folder(folder))
    except (RegistryError, OSError) as exc:
        raise OSError(str(exc)) from None


@dataclass
class ModelCatalog:
    """Loaded :class:`ModelInfo` per model folder (reloaded when its manifest changes). One load per folder at a
    time: concurrent first requests wait for it (transformers' lazy imports are not thread-safe: parallel
    first loads raised ImportError, a 500). A source is a folder or a registry URL (``s3://``): a URL's
    tokenizer is fetched once into ``cache_root`` and its folder remembered."""

    cache_root: str = field(default_factory=default_tokenizer_cache)
    cache: dict[str, tuple[float, ModelInfo | QuartError]] = field(default_factory=dict)
    loading: dict[str, asyncio.Lock] = field(default_factory=dict)
    fetched: dict[str, str] = field(default_factory=dict)  # registry URL -> its local tokenizer folder
    fetching: dict[str, asyncio.Future] = field(default_factory=dict)
    failed_at: dict[str, float] = field(default_factory=dict)  # registry URL -> when its last fetch failed
    retry_s: float = 10.0  # a failed fetch is tried again no sooner (every request asks)

    async def local(self, name: str, source: str | None) -> str | None:
        """The folder of ``source``: itself, or for a registry URL its tokenizer fetched (503 naming the
        registry's error when it cannot be)."""
        if not is_registry_url(source):
            return source
        folder = self.fetched.get(source)
        if folder is None:
            try:
                folder = await asyncio.shield(self._fetch(source))
            except OSError as exc:
                raise QuartError(503, f"pipeline {name!r}: cannot fetch its tokenizer from the registry "
                                      f"({source}): {exc}", "model") from None
        return folder

    def _fetch(self, url: str) -> asyncio.Future:
        """The one fetch of ``url``'s tokenizer in flight (a new one after a failed one); it records the folder."""
        task = self.fetching.get(url)
        now = time.monotonic()
        if task is None or (task.done() and url not in self.fetched
                            and now - self.failed_at.get(url, -self.retry_s) >= self.retry_s):
            task = self.fetching[url] = asyncio.ensure_future(asyncio.to_thread(fetch_tokenizer, url, self.cache_root))

            def record(done: asyncio.Future) -> None:
                if done.cancelled():
                    return
                if done.exception() is None:
                    self.fetched[url] = done.result()
                else:
                    self.failed_at[url] = time.monotonic()
                    log.warning("fetching the tokenizer of %s: %s", url, done.exception())

            task.add_done_callback(record)
        return task

    async def folder(self, name: str, source: str | None) -> tuple[str, float]:
        """The local folder of pipeline ``name``'s model and its manifest's mtime (a 400 naming ``model`` when there
        is none the gateway can read)."""
        if not source:
            raise invalid("model", f"pipeline {name!r} has no model folder the gateway can read "
                                   "(QUART_MODEL_DIR or QUART_MODEL_URL of its stage 0): it cannot tokenize for it")
        model_dir = await self.local(name, source) or ""
        try:
            return model_dir, os.stat(os.path.join(model_dir, "manifest.json")).st_mtime
        except OSError:
            raise invalid("model", f"pipeline {name!r}: no manifest.json in {model_dir}") from None

    async def get(self, name: str, source: str | None) -> ModelInfo:
        model_dir, mtime = await self.folder(name, source)
        hit = self.cache.get(model_dir)
        if hit is None or hit[0] != mtime:
            async with self.loading.setdefault(model_dir, asyncio.Lock()):
                hit = self.cache.get(model_dir)
                if hit is None or hit[0] != mtime:  # not loaded by the request this one waited for
                    try:
                        info: ModelInfo | QuartError = await asyncio.to_thread(load_model, name, model_dir)
                    except QuartError as exc:
                        info = exc
                    except (OSError, ValueError) as exc:
                        info = invalid("model", f"pipeline {name!r}: cannot load its tokenizer: {exc}")
                    hit = self.cache[model_dir] = (mtime, info)
        if isinstance(hit[1], QuartError):
            raise hit[1]
        return hit[1]

    def known_decoder(self, source: str | None) -> bool | None:
        """Whether a source holds a decoder: from the loaded cache, else its manifest (None: unreadable, or a
        registry URL whose tokenizer is not fetched yet: the fetch is started)."""
        if is_registry_url(source):
            folder = self.fetched.get(source)
            if folder is None:
                self._start_fetch(source)
                return None
            source = folder
        if not source:
            return None
        hit = self.cache.get(source)
        if hit is not None:
            return isinstance(hit[1], ModelInfo)
        try:
            return Manifest.load(source).family == "decoder"
        except (OSError, ValueError, TypeError):
            return None

    def _start_fetch(self, url: str) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._fetch(url)


class TextStream:
    """The text of the generated tokens as it grows, cut at the first stop string (kept in the text with
    ``include``; none looked for before ``min_tokens`` tokens, vLLM's rule).

    Text that could still become a stop string, and an incomplete UTF-8 sequence (U+FFFD at the end), is
    held back until the next token decides it."""

    def __init__(self, model: ModelInfo, stops: tuple[str, ...], include: bool = False, min_tokens: int = 0) -> None:
        self.model = model
        self.stops = stops
        self.include = include
        self.min_tokens = min_tokens
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.armed = 0  # characters before the first token whose text may hold a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; the new text that is safe to hand out (``stopped`` once a stop string appeared)."""
        if len(self.ids) < self.min_tokens:
            self.armed = len(self.model.decode(self.ids)) if self.ids else 0
        self.ids.append(token)
        text = self.model.decode(self.ids)
        if len(self.ids) >= self.min_tokens:
            found = [(i, s) for s in self.stops
                     if (i := text.find(s, max(0, self.sent - len(s), self.armed - len(s) + 1))) >= 0]
            if found:
                cut, stop = min(found)
                end = cut + len(stop) if self.include else cut
                self.stopped = True
                delta, self.sent = text[self.sent:end], max(self.sent, end)
                return delta
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta

    def finish(self) -> str:
        """The held-back rest, once no more tokens come."""
        if self.stopped:
            return ""
        text = self.model.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta
