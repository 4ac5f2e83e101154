"""Real answers from a partitioned pretrained model: sentence embeddings + cosine similarity, greedy text.

Both run through the stage functions, via the gateway (``POST /function/<model>``: the router plugin
takes the request through every stage) or, without the plugin, stage by stage
(``/function/<model>-stage-<i>``). In-process callers (tests, ``quartctl bench realmodel``) pass a
``step`` of their own.

With the plugin attached, a decoder answers through the gateway's ``/v1/chat/completions`` stream
(:func:`stream_chat`: sessions whose KV caches stay in the stage replicas, docs/generation.md). Without
it, generation falls back to this module's greedy loop, which keeps **no KV cache**: each new token is
one pass of the whole sequence so far through every stage. The stages stay stateless, so any replica of any stage serves any token (the
router may spread one generation over replicas and scale a stage mid-generation), at the price of
recomputing the prefix: a token costs O(prompt + generated) positions of compute instead of one. For
the few-token answers here (a 30-token prompt, ~10 tokens) that is a few tens of milliseconds per token
on this machine; a KV cache would need stage-local state pinned to one replica per request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Sequence

import aiohttp

JSON = "application/json"
OCTETS = "application/octet-stream"
Step = Callable[[list[int]], Awaitable[int]]
"""One pass through the pipeline: token ids so far -> the greedy next id."""


def chat_prompt(user: str) -> str:
    """SmolLM2-Instruct's chat format (ChatML) for one user turn, ready for the assistant's answer."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


async def greedy(step: Step, ids: list[int], max_new: int, stop: set[int] | None = None) -> list[int]:
    """Up to `max_new` greedy token ids after `ids` (stops after a token in `stop`)."""
    ids, new = list(ids), []
    for _ in range(max_new):
        token = await step(ids)
        new.append(token)
        ids.append(token)
        if stop and token in stop:
            break
    return new


async def stream_chat(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int
                      ) -> str | None:
    """Ask ``POST /v1/chat/completions`` (greedy, ``stream: true``) and print the answer as its tokens arrive;
    the text, or None when the gateway serves no ``/v1`` (no plugin)."""
    import time

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = last = None
    text, chunks = "", 0
    async with session.post(f"{url.rstrip('/')}/v1/chat/completions", json=body) as res:
        if res.status == 404 and res.content_type != "text/event-stream":
            return None
        if res.status == 400:  # e.g. a partition made before the chat template was kept: the old path
            print(f"  /v1/chat/completions: {(await res.json())['error']['message']}")
            return None
        if res.status != 200:
            raise RuntimeError(f"/v1/chat/completions answered {res.status}: {await res.text()}")
        print(f"  POST /v1/chat/completions (stream) -> {prompt!r}\n    ", end="", flush=True)
        async for raw in res.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the stream ended with an error: {event['error']}")
            delta = (event["choices"][0].get("delta") or {}).get("content") if event.get("choices") else None
            if delta:
                first = first or time.perf_counter()
                last = time.perf_counter()
                chunks += 1
                text += delta
                print(delta, end="", flush=True)
    print()
    if first is not None:
        per = (last - first) * 1000 / max(1, chunks - 1)
        print(f"  first token after {(first - started) * 1000:.0f} ms, then {per:.0f} ms a chunk (each stage keeps the "
              "session's KV cache; a step carries one position)")
    return text


class GatewayClient:
    """Calls a partitioned model through the gateway: the router plugin's ``/function/<model>`` when it is
    attached, else every ``/function/<stage>`` in turn."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, stages: list[str]):
        self.session, self.url, self.model, self.stages = session, url.rstrip("/"), model, stages

    async def run(self, doc: dict) -> dict:
        """One request (JSON input) through every stage; the last stage's JSON output."""
        body, headers = json.dumps(doc).encode(), {"Content-Type": JSON, "Accept": JSON}
        async with self.session.post(f"{self.url}/function/{self.model}", data=body, headers=headers) as res:
            if res.status != 404:
                if res.status != 200:
                    raise RuntimeError(f"/function/{self.model} answered {res.status}: {await res.text()}")
                return json.loads(await res.read())
        ctype = JSON
        for i, name in enumerate(self.stages):
            accept = JSON if i == len(self.stages) - 1 else OCTETS
            async with self.session.post(f"{self.url}/function/{name}", data=body,
                                         headers={"Content-Type": ctype, "Accept": accept}) as res:
                payload = await res.read()
                if res.status != 200:
                    raise RuntimeError(f"{name} answered {res.status}: {payload[:300]!r}")
            body, ctype = payload, OCTETS
        return json.loads(body)

    async def embed(self, texts: list[str]) -> list[list[float]]:
        """Unit-length sentence embeddings of `texts` (one padded batch, one pass)."""
        doc = await self.run({"text": texts})
        if "data" not in doc or len(doc["shape"]) != 2:
            raise RuntimeError(f"{self.model} did not answer embeddings (batch x hidden): {doc.get('shape')}")
        return doc["data"]

    async def next_token(self, ids: list[int]) -> int:
        """The greedy next token after `ids` (argmax of the last position's logits)."""
        doc = await self.run({"input_ids": [ids]})
        return int(doc["argmax"][0][-1])


COMPARE_WITH = ("Someone plays an instrument.", "The stock market fell sharply today.")
NEW_TOKENS = 12


async def show_answer(session: aiohttp.ClientSession, url: str, model: str, stages: list[str], model_dir,
                      prompt: str) -> bool:
    """Print a real answer of a pretrained partition through the gateway; False for random weights.

    A sentence model: the embeddings of `prompt` and two other sentences, and their cosine similarities.
    A pretrained decoder: a greedy completion (ChatML for SmolLM2), one pass through every stage a token.
    """
    import time
    from pathlib import Path

    from quart_stage.manifest import Manifest

    manifest = Manifest.load(str(model_dir))
    if manifest.extra.get("weights") != "checkpoint" or not manifest.tokenizer:
        return False
    client = GatewayClient(session, url, model, stages)
    if manifest.config.get("quart_plan") == "bert-sentence":
        texts = [prompt, *COMPARE_WITH]
        started = time.perf_counter()
        vectors = await client.embed(texts)
        print(f"  sentence embeddings ({len(vectors)} x {len(vectors[0])}, unit length, mean-pooled in the last "
              f"stage) in {(time.perf_counter() - started) * 1000:.0f} ms; cosine similarity:")
        for text, vector in zip(texts[1:], vectors[1:], strict=True):
            print(f"    {cosine(vectors[0], vector):+.3f}  {prompt!r} vs {text!r}")
        return True
    if manifest.family != "decoder":
        return False
    streamed = await stream_chat(session, url, model, prompt, NEW_TOKENS * 4)
    if streamed is not None:
        return True
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / manifest.tokenizer))
    text = chat_prompt(prompt) if manifest.source.endswith(".gguf") else prompt
    ids = tok.encode(text).ids
    stop = {i for i in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")) if i is not None}
    started = time.perf_counter()
    new = await greedy(client.next_token, ids, NEW_TOKENS, stop)
    took = time.perf_counter() - started
    print(f"  (no /v1 API: the plugin is not attached) greedy completion ({len(new)} tokens, each one pass "
          f"through all {len(stages)} stages, no KV cache; "
          f"{took * 1000 / max(1, len(new)):.0f} ms a token):")
    print(f"    {prompt!r} -> {tok.decode(new).strip()!r}")
    return True
