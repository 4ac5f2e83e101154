"""The generation doors of the gateway: OpenAI's ``/v1`` API and generation bodies on ``/function/<model>``.

- ``GET /v1/models``: the decoder and embedding pipelines (``id``: ``com.quart.model``; vLLM's ``max_model_len``, ``root``);
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's request and answer shapes (the
  chat template of the model's tokenizer), ``stream: true`` → server-sent events ending with ``data: [DONE]``
  (the first chunk goes with the first token, as vLLM's: a client's TTFT is the prefill), ``usage`` counts,
  errors as ``{"error": {"message", "type", "param", "code"}}``;
- ``POST /v1/embeddings``: :mod:`.embeddings` (the pooled encoder pipelines, through the router's one-shot path);
- ``POST /function/<model>`` with a generation body (:func:`.params.is_generation`): the same engine,
  answered in the project's shape (``{"tokens", "text", "finish_reason", "usage", ...}``, errors
  ``{"error", "field"}``), streamed as ``data: {"token", "text"}`` events when ``stream`` is true.

The body is bounded before it is parsed, the text before it is tokenized; a request is checked whole
before its session is placed. A stream that cannot go on ends with ``data: {"error": ...}`` and
``data: [DONE]``; every request ends. TTFT and TPOT go to the metrics collector (histograms, the request records,
vLLM's serving metrics: :class:`~gateway_plugin.metrics.ServingMetrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from gateway_plugin.generation import logprobs, sse
from gateway_plugin.generation.choices import Run, answered, usage
from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.embeddings import EmbeddingsAPI, OneShot
from gateway_plugin.generation.params import GenerationParams, is_generation, parse
from gateway_plugin.generation.session import Session
from gateway_plugin.generation.sessions import SessionEngine
from gateway_plugin.generation.tokens import (
    ModelCatalog,
    ModelInfo,
    TextStream,
    context_of,
    default_tokenizer_cache,
    is_registry_url,
    max_tokens_for,
)
from gateway_plugin.metrics import MetricsCollector, RequestRecord, ServingMetrics
from quart_kernel.admission import client_deadline_s
from quart_stage import jsonparse
from quart_stage.errors import QuartError, invalid
from quart_stage.manifest import Manifest

log = logging.getLogger("quart.openai")

TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}


def openai_error(exc: QuartError) -> dict[str, Any]:
    """OpenAI's error object for a :class:`QuartError` (``detail["code"]``, when it has one, is the code)."""
    code = exc.detail.get("code") or ("model_not_found" if exc.status == 404 and exc.field == "model"
                                      else str(exc.status))
    return {"error": {"message": exc.message, "type": TYPES.get(exc.status, "server_error" if exc.status >= 500
                                                                  else "invalid_request_error"),
                      "param": exc.field, "code": code}}


@dataclass
class Outcome:
    """What one generation produced (for the answer, the records and the metrics)."""

    prompt_tokens: int
    arrival: float
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    first_at: float | None = None
    last_at: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens (the ITL histogram)
    error: QuartError | None = None
    answers: list[dict] = field(default_factory=list)  # per token, its logprobs (when asked)
    reported: int = 0  # tokens whose logprobs a stream has sent
    echo: str = ""  # completions' echo: the prompt's text, before the completion's
    prompt: tuple[list[int], list[dict]] = ((), ())  # echo with logprobs: the prompt's ids and their logprobs

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.tokens),
                "total_tokens": self.prompt_tokens + len(self.tokens)}


class GenerationAPI:
    """The handlers; ``pipelines()`` names each pipeline's stage functions, ``model_dir(model)`` its folder."""

    def __init__(self, engine: SessionEngine, pipelines: Callable[[], dict[str, list[str]]],
                 model_dir: Callable[[str], str | None], config: GenerationConfig,
                 collector: MetricsCollector | None = None, clock: Callable[[], float] = time.monotonic,
                 one_shot: OneShot | None = None) -> None:
        """``one_shot``: the router's path (``Router.answer``) for ``/v1/embeddings``; without it, that is a 404."""
        self.engine = engine
        self.pipelines = pipelines
        self.model_dir = model_dir
        self.config = config
        self.collector = collector
        self.clock = clock
        self.catalog = ModelCatalog(config.tokenizer_cache or default_tokenizer_cache())
        self.serving = collector.serving if collector is not None else ServingMetrics()
        self._decoders: dict[str, bool] = {}  # model folder -> a decoder (generates)
        self.embeddings = None if one_shot is None else EmbeddingsAPI(
            one_shot, pipelines, model_dir, config, self.catalog, collector, clock)

    # ------------------------------------------------------------------ doors

    async def v1(self, request: web.Request) -> web.StreamResponse:
        """``/v1/<path>``: the OpenAI-compatible API."""
        path = request.path.rstrip("/")
        try:
            if path == "/v1/models":
                if request.method != "GET":
                    raise QuartError(405, "use GET /v1/models", "method")
                return web.json_response(await self.models())
            door = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}.get(path)
            if door is None and not (path == "/v1/embeddings" and self.embeddings is not None):
                raise QuartError(404, f"no route {request.method} {path}; this gateway serves /v1/models, /v1/completions, "
                                      f"/v1/chat/completions{' and /v1/embeddings' if self.embeddings else ''}", "path")
            if request.method != "POST":
                raise QuartError(405, f"use POST {path}", "method")
            doc = await self._read_json(request)
            if door is None and self.embeddings is not None:
                return web.json_response(await self.embeddings.embed(doc, request.headers))
            return await self.generate(request, parse(doc, door, self.config), door)
        except QuartError as exc:
            return web.json_response(openai_error(exc), status=exc.status, headers=exc.headers)

    def generates(self, model: str) -> bool:
        """Whether pipeline ``model`` is a decoder (its ``/function`` calls may generate); remembered per folder.
        A registry model whose tokenizer is still on its way counts as one (the generation door looks at each
        body and hands one-shot bodies back)."""
        source = self.model_dir(model)
        known = self._decoders.get(source or "")
        if known is None:
            found = self.catalog.known_decoder(source)
            if found is None and is_registry_url(source):
                return True
            known = self._decoders[source or ""] = bool(found)
        return known

    async def function(self, request: web.Request, model: str) -> web.StreamResponse | None:
        """``POST /function/<model>`` when its body asks for generation (:func:`.params.is_generation`); None
        for a one-shot body (the router's path)."""
        if request.method != "POST":
            return None
        return await self.answer(request, model, await request.read())

    async def answer(self, request: web.Request, model: str, body: bytes) -> web.StreamResponse | None:
        """The generation answer to ``body`` (read by the gateway) on ``/function/<model>``; None: one-shot."""
        if len(body) > self.config.max_body_bytes or not body.lstrip()[:1] == b"{" or not any(
                key in body for key in (b'"prompt"', b'"max_tokens"', b'"stream"', b'"input_ids"')):
            return None
        try:
            doc = jsonparse.loads(body)  # deep nesting, NaN: a QuartError, never a RecursionError (a 500)
        except QuartError:
            return None  # the one-shot path answers what is wrong with it
        if not is_generation(doc):
            return None
        try:
            return await self.generate(request, parse(doc, "native", self.config, model), "native")
        except QuartError as exc:
            return web.json_response(exc.to_json(), status=exc.status, headers=exc.headers)

    async def models(self) -> dict[str, Any]:
        """The decoder and embedding pipelines with ``max_model_len`` and ``root`` (vLLM's fields); a registry model's
        tokenizer is fetched first (one that cannot be is left out)."""
        data = []
        for name, stages in sorted(self.pipelines().items()):
            try:
                folder = await self.catalog.local(name, self.model_dir(name))
                manifest = Manifest.load(folder or "")
            except (QuartError, OSError, ValueError, TypeError):
                continue
            if manifest.family == "decoder" or (self.embeddings is not None and self.embeddings.pooled(manifest)):
                data.append({"id": name, "object": "model", "created": 0, "owned_by": "quart", "root": manifest.model,
                             "parent": None, "max_model_len": context_of(manifest), "stages": len(stages)})
        return {"object": "list", "data": data}

    async def _read_json(self, request: web.Request) -> Any:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise invalid("body", f"the body has {request.content_length} bytes; at most {limit}", 413)
        body = bytearray()
        async for chunk in request.content.iter_chunked(1 << 16):
            body += chunk
            if len(body) > limit:
                raise invalid("body", f"the body has more than {limit} bytes", 413)
        return jsonparse.loads(body, "body", "the body")  # 400 for anything that is not plain JSON

    # ------------------------------------------------------------------ one generation

    async def _prepared(self, params: GenerationParams, door: str) -> tuple[list[str], ModelInfo, list[int], int]:
        """(the pipeline's stages, its model, the prompt's ids, max_tokens), each checked (404 / 400 naming it)."""
        stages = self.pipelines().get(params.model)
        if not stages:
            raise QuartError(404, f"no pipeline named {params.model!r} is deployed (GET /v1/models lists them)",
                             "model")
        info = await self.catalog.get(params.model, self.model_dir(params.model))
        if params.prompt_chars > 4096:  # a long text is tokenized off the event loop
            prompt = await asyncio.to_thread(info.prompt_ids, params)
        else:
            prompt = info.prompt_ids(params)
        max_tokens = max_tokens_for(info.context, len(prompt), params.max_tokens, door, self.config.default_max_tokens)
        vocab = len(info.tokenizer)
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:
            raise invalid("logit_bias", f"logit_bias names token id {params.logit_bias[-1][0]}; the vocabulary "
                                        f"has {vocab} (0..{vocab - 1})")
        return stages, info, prompt, max_tokens

    async def generate(self, request: web.Request, params: GenerationParams, door: str) -> web.StreamResponse:
        if params.runs > 1 or params.more_prompts:
            return await self._several(request, params, door)
        arrival = self.clock()
        wait_s = client_deadline_s(request.headers, self.config.room_wait_s)  # X-Quart-Timeout-Ms bounds the entry wait
        stages, info, prompt, max_tokens = await self._prepared(params, door)
        sample = params.sample(len(prompt), info.eos_ids)
        eos = frozenset() if params.ignore_eos else info.eos_ids
        with self.serving.waiting.labels(params.model).track_inprogress():
            session = await self.engine.open(params.model, stages, prompt, max_tokens, sample, eos, wait_s=wait_s,
                                             gone=lambda: sse.client_gone(request))
        outcome = Outcome(len(prompt), arrival)
        if params.echo:
            outcome.echo = params.prompt if params.prompt is not None else info.decode(prompt)
        ident = f"{'chatcmpl' if door == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.serving.running.labels(params.model).inc()
        try:
            if params.stream:
                response = await sse.open_stream(request, {"X-Quart-Request-Id": ident})
                await self._stream(request, response, session, info, params, door, ident, outcome)
                return response
            await self._collect(request, session, info, params, outcome)
            if outcome.error is not None:
                exc = outcome.error
                body = openai_error(exc) if door != "native" else exc.to_json()
                return web.json_response(body, status=exc.status, headers=exc.headers)
            return web.json_response(self._answer(door, ident, params.model, outcome, session,
                                                  self._new_logprobs(door, info, outcome)))
        finally:
            self.serving.running.labels(params.model).dec()
            self.engine.finish(session)
            self._record(ident, params.model, arrival, outcome)

    async def _tokens(self, request: web.Request, session: Session, info: ModelInfo, params: GenerationParams,
                      outcome: Outcome):
        """(token, text delta) as they come, ``outcome`` kept current; stops at a stop string or id, EOS,
        max_tokens, or when the client is gone; an engine failure lands in ``outcome.error``."""
        text = TextStream(info, params.stop, params.include_stop_str_in_output, params.min_tokens)
        stop_ids = set(params.stop_ids)
        try:
            async with contextlib.aclosing(self.engine.tokens(session)) as tokens:
                async for token in tokens:
                    if params.max_tokens == 0:
                        outcome.finish_reason = "length"
                        break
                    now = self.clock()
                    outcome.first_at = outcome.first_at or now
                    if outcome.last_at is not None:
                        outcome.gaps.append(now - outcome.last_at)
                    outcome.last_at = now
                    outcome.tokens.append(token)
                    if "logprobs" in session.sample:  # asked, or best_of's ranking
                        outcome.answers.append(session.logprobs[-1] if session.logprobs else {})
                    if token in stop_ids:
                        outcome.finish_reason = "stop"
                        break
                    delta = "" if token in info.eos_ids else text.push(token)
                    outcome.text += delta
                    if text.stopped:
                        outcome.finish_reason = "stop"
                        yield token, delta
                        break
                    yield token, delta
                    if sse.client_gone(request):
                        outcome.finish_reason = "client_gone"
                        break
                else:
                    outcome.finish_reason = session.finish_reason or "length"
        except QuartError as exc:
            outcome.error = exc
        except Exception as exc:  # never a hung stream: an explicit error
            log.exception("generation %s failed", session.id)
            outcome.error = QuartError(502, f"generation failed: {type(exc).__name__}: {exc}", "stage")
        outcome.prompt = session.prompt, session.prompt_logprobs
        if outcome.error is None and outcome.finish_reason != "stop":
            rest = text.finish()
            outcome.text += rest
            if rest:
                yield None, rest

    async def _collect(self, request, session, info, params, outcome) -> None:
        async for _ in self._tokens(request, session, info, params, outcome):
            pass

    async def _stream(self, request, response, session, info, params, door, ident, outcome) -> None:
        created = int(time.time())
        opened = bool(outcome.echo)  # the first token's chunk goes out even before it has text, a chat's role with
        try:  # it (vLLM's order): a client's TTFT, taken at the first chunk, is the prefill. Echo: the prompt first
            if outcome.echo:
                await sse.send(response, self._chunk(door, ident, params.model, created, outcome.echo, None))
            async for token, delta in self._tokens(request, session, info, params, outcome):
                if door == "native":
                    await sse.send(response, {"text": delta} if token is None else {"token": token, "text": delta})
                elif not opened or delta:
                    await sse.send(response, self._chunk(door, ident, params.model, created, delta, None,
                                                         role=door == "chat" and not opened,
                                                         lp=self._new_logprobs(door, info, outcome)))
                    opened = True
            if door == "chat" and not opened and outcome.error is None:  # no token came (a stop id first)
                await sse.send(response, self._chunk(door, ident, params.model, created, "", None, role=True))
            if outcome.error is not None:
                exc = outcome.error
                await sse.send(response, openai_error(exc) if door != "native" else exc.to_json())
            elif door == "native":
                await sse.send(response, {"finish_reason": outcome.finish_reason, "usage": outcome.usage(),
                                          "replays": session.replays})
            else:
                await sse.send(response, self._chunk(door, ident, params.model, created, "", outcome.finish_reason,
                                                     lp=self._new_logprobs(door, info, outcome)))
                if params.include_usage:
                    await sse.send(response, {"id": ident, "object": _object(door, True), "created": created,
                                              "model": params.model, "choices": [], "usage": outcome.usage()})
            await sse.done(response)
        except sse.GONE:  # the client went away: the session was closed with the iterator
            outcome.finish_reason = outcome.finish_reason or "client_gone"

    @staticmethod
    def _new_logprobs(door: str, info: ModelInfo, outcome: Outcome) -> dict[str, Any] | None:
        """The logprobs of the tokens a stream has not reported yet (None when none were asked); with echo (never
        streamed) the prompt's tokens first, the first with no logprob."""
        start, outcome.reported = outcome.reported, len(outcome.answers)
        tokens, answers = outcome.tokens[start:outcome.reported], outcome.answers[start:outcome.reported]
        echoed = start == 0 and bool(outcome.prompt[1])
        if echoed:
            tokens, answers = [*outcome.prompt[0], *tokens], [{"logprob": None}, *outcome.prompt[1], *answers]
        if not answers:
            return None
        if door == "chat":
            return logprobs.chat(info.decode, tokens, answers)
        offset = 0 if echoed else len(outcome.echo) + len(info.decode(outcome.tokens[:start]))
        return logprobs.completion(info.decode, tokens, answers, offset)

    @staticmethod
    def _chunk(door: str, ident: str, model: str, created: int, delta: str, finish: str | None,
               role: bool = False, lp: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
        if door == "chat":
            body: dict[str, Any] = {"role": "assistant", "content": delta} if role else ({"content": delta} if delta else {})
            choice = {"index": index, "delta": body, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}
        return {"id": ident, "object": _object(door, True), "created": created, "model": model, "choices": [choice]}

    @staticmethod
    def _answer(door: str, ident: str, model: str, outcome: Outcome, session: Session,
                lp: dict[str, Any] | None = None) -> dict[str, Any]:
        if door == "native":
            return {"id": ident, "model": model, "tokens": outcome.tokens, "text": outcome.text,
                    "finish_reason": outcome.finish_reason, "usage": outcome.usage(), "replays": session.replays,
                    "ttft_ms": outcome_ms(outcome)[0], "tpot_ms": outcome_ms(outcome)[1]}  # the gateway's clock
        if door == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": outcome.text}, "logprobs": lp,
                      "finish_reason": outcome.finish_reason}
        else:
            choice = {"index": 0, "text": outcome.echo + outcome.text, "logprobs": lp,
                      "finish_reason": outcome.finish_reason}
        return {"id": ident, "object": _object(door, False), "created": int(time.time()), "model": model,
                "choices": [choice], "usage": outcome.usage()}

    # ------------------------------------------------------------------ several choices

    async def _several(self, request: web.Request, params: GenerationParams, door: str) -> web.StreamResponse:
        """``n`` > 1, ``best_of`` or a list of prompts: one session per choice (``best_of`` or ``n`` per prompt, the
        i-th seeded ``seed + i``), run at once; choice ``p * n + j`` is prompt p's j-th (OpenAI's order). With
        ``best_of`` > n, the n of each prompt whose tokens' logprobs sum highest (vLLM's rule)."""
        arrival = self.clock()
        wait_s = client_deadline_s(request.headers, self.config.room_wait_s)
        runs: list[Run] = []
        ident = f"{'chatcmpl' if door == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            for p, one in enumerate(params.prompts()):
                stages, info, prompt, max_tokens = await self._prepared(one, door)
                base = one.sample(len(prompt), info.eos_ids)
                if params.runs > params.n and params.logprobs is None:
                    base["logprobs"] = 0  # best_of ranks by the chosen tokens' logprobs (not reported)
                eos = frozenset() if params.ignore_eos else info.eos_ids
                echo = (one.prompt if one.prompt is not None else info.decode(prompt)) if params.echo else ""
                for j in range(params.runs):
                    seed = None if params.seed is None else params.seed + j
                    session = await self.engine.open(params.model, stages, prompt, max_tokens, {**base, "seed": seed},
                                                     eos, wait_s=wait_s, gone=lambda: sse.client_gone(request))
                    runs.append(Run(p, j, one, session, Outcome(len(prompt), arrival, echo=echo)))
            if params.stream:
                response = await sse.open_stream(request, {"X-Quart-Request-Id": ident})
                await self._stream_several(request, response, runs, info, params, door, ident)
                return response
            await asyncio.gather(*(self._collect(request, r.session, info, r.params, r.outcome) for r in runs))
            failed = next((r.outcome.error for r in runs if r.outcome.error is not None), None)
            if failed is not None:
                return web.json_response(openai_error(failed), status=failed.status, headers=failed.headers)
            choices = []
            for index, run in answered(runs, 1 + len(params.more_prompts), params.n):
                lp = self._new_logprobs(door, info, run.outcome) if params.logprobs is not None else None
                choice = self._answer(door, ident, params.model, run.outcome, run.session, lp)["choices"][0]
                choices.append({**choice, "index": index})
            return web.json_response({"id": ident, "object": _object(door, False), "created": int(time.time()),
                                      "model": params.model, "choices": choices, "usage": usage(runs)})
        finally:
            for run in runs:
                self.engine.finish(run.session)
                self._record(f"{ident}-{run.prompt}-{run.j}", params.model, arrival, run.outcome)

    async def _stream_several(self, request, response, runs: list[Run], info, params, door, ident) -> None:
        """Every choice's chunks as they come, each with its index; a choice's last chunk when it ends."""
        created, queue = int(time.time()), asyncio.Queue()

        async def pump(k: int, run: Run) -> None:
            try:
                async for token, delta in self._tokens(request, run.session, info, run.params, run.outcome):
                    queue.put_nowait((k, token, delta))
            finally:
                queue.put_nowait((k, None, None))

        tasks = [asyncio.create_task(pump(k, run)) for k, run in enumerate(runs)]
        opened: set[int] = set()  # choices whose first chunk went out: each goes with its first token (see _stream)
        try:
            for k, run in enumerate(runs):
                if run.outcome.echo:
                    await sse.send(response, self._chunk(door, ident, params.model, created, run.outcome.echo, None,
                                                         index=run.index(params.n)))
                    opened.add(k)
            left = len(runs)
            while left:
                k, token, delta = await queue.get()
                run = runs[k]
                index = run.index(params.n)
                if delta is None:
                    left -= 1
                    if run.outcome.error is not None:
                        await sse.send(response, openai_error(run.outcome.error))
                        break
                    if door == "chat" and k not in opened:  # no token came (a stop id first)
                        await sse.send(response, self._chunk(door, ident, params.model, created, "", None, role=True,
                                                             index=index))
                    await sse.send(response, self._chunk(door, ident, params.model, created, "",
                                                         run.outcome.finish_reason, index=index,
                                                         lp=self._new_logprobs(door, info, run.outcome)))
                elif delta or k not in opened:
                    await sse.send(response, self._chunk(door, ident, params.model, created, delta, None, index=index,
                                                         role=door == "chat" and k not in opened,
                                                         lp=self._new_logprobs(door, info, run.outcome)))
                    opened.add(k)
            else:
                if params.include_usage:
                    await sse.send(response, {"id": ident, "object": _object(door, True), "created": created,
                                              "model": params.model, "choices": [], "usage": usage(runs)})
            await sse.done(response)
        except sse.GONE:
            for run in runs:
                run.outcome.finish_reason = run.outcome.finish_reason or "client_gone"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ measuring

    def _record(self, ident: str, model: str, arrival: float, outcome: Outcome) -> None:
        if self.collector is None:
            return
        end = self.clock()
        ttft, tpot = outcome_ms(outcome)
        status = outcome.error.status if outcome.error is not None else 499 if outcome.finish_reason == "client_gone" else 200
        with contextlib.suppress(Exception):  # measuring never fails a request
            self.collector.record(RequestRecord(
                id=ident, model=model, arrival=arrival, end=end, status=status, latency_ms=1000 * (end - arrival),
                error=outcome.error.message if outcome.error else "", ttft_ms=ttft, tpot_ms=tpot,
                tokens=len(outcome.tokens)))
            self.serving.finished(model, end - arrival, outcome.prompt_tokens if outcome.tokens else 0,
                                            len(outcome.tokens), None if ttft is None else ttft / 1000, outcome.gaps)


def _object(door: str, chunk: bool) -> str:
    if door == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def outcome_ms(outcome: Outcome) -> tuple[float | None, float | None]:
    """(TTFT from the request's arrival, TPOT: mean time between tokens after the first), in ms."""
    if outcome.first_at is None:
        return None, None
    ttft = 1000 * (outcome.first_at - outcome.arrival)
    n = len(outcome.tokens)
    tpot = 1000 * (outcome.last_at - outcome.first_at) / (n - 1) if n > 1 and outcome.last_at else None
    return ttft, tpot
