"""Real answers from a partitioned pretrained model: sentence embeddings + cosine similarity, greedy text.

Both run through the stage functions, via the gateway (``POST /function/<model>``: the router plugin
takes the request through every stage) or, without the plugin, stage by stage
(``/function/<model>-stage-<i>``). In-process callers (tests, ``quartctl bench realmodel``) pass a
``step`` of their own.

Generation is greedy and keeps **no KV cache**: each new token is one pass of the whole sequence so far
through every stage. The stages stay stateless, so any replica of any stage serves any token (the
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
