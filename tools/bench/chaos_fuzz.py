"""Seeded fuzzing of the gateway's deploy, scale, function, async and OpenAI APIs (`quartctl bench chaos`).

Each case mutates a valid request (a field's type or value swapped for NaN, a huge or negative number,
5,000-deep nesting, a long or odd string, a bad label or environment variable, random bytes, a lying
``Content-Length``-free chunked body) and records the answer. A 5xx is a finding, so is a request left
unanswered for 10 s (a hang) and a gateway process that is gone (a crash). Functions the fuzzer manages
to deploy are named ``fz-*`` with ``com.openfaas.scale.min: 0`` (nothing starts) and removed at the end.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp

ODD_VALUES: list[Any] = [None, True, -1, 0, 2**70, -(2**70), 1e308, "", "x" * 70_000, "NaN", [], {}, [1, [2]],
                         "../../etc/passwd", "\u0000", "é", 3.5]
ODD_RAW = [b"NaN", b"Infinity", b"-Infinity", b"[" * 5000 + b"]" * 5000, b"1" + b"0" * 5000, b'"\\ud800"', b"1e400",
           b"-1e400"]
LABELS = ["com.quart.stage", "com.quart.model", "com.quart.stages", "com.openfaas.scale.min",
          "com.openfaas.scale.max", "com.quart.concurrency", "com.quart.profile-ms", "com.quart.keysmanager"]
ENV_NAMES = ["PYTHONWARNINGS", "BROWSER", "LD_PRELOAD", "PYTHONPATH", "A B", "", "QUART_MODEL_DIR", "OK_NAME"]


def _base(rng: random.Random) -> dict[str, Any]:
    return {"service": f"fz-{rng.randrange(10**6)}", "image": "quart/echo",
            "labels": {"com.openfaas.scale.min": "0", "com.openfaas.scale.max": "1"},
            "envVars": {"A": "1"}, "limits": {"cpu": "100m", "memory": "64Mi"}}


def _mutate(rng: random.Random, doc: dict[str, Any]) -> bytes:
    """One mutation of ``doc``, serialized (some mutations are only expressible as raw bytes)."""
    kind = rng.randrange(8)
    if kind == 0 and doc:
        doc[rng.choice(list(doc))] = rng.choice(ODD_VALUES)
    elif kind == 1:
        doc.setdefault("labels", {})[rng.choice(LABELS)] = str(rng.choice(ODD_VALUES))
    elif kind == 2:
        doc.setdefault("envVars", {})[rng.choice(ENV_NAMES)] = str(rng.choice(ODD_VALUES))[:100]
    elif kind == 3:
        doc.setdefault("limits", {})[rng.choice(["cpu", "memory"])] = rng.choice(["nan", "inf", "-1", "1e400", "9" * 400,
                                                                                  "0", "lots", "1Ei"])
    elif kind == 4:
        key = rng.choice(list(doc) or ["x"])
        raw = json.dumps({k: v for k, v in doc.items() if k != key}).encode()
        return raw[:-1] + (b", " if len(raw) > 2 else b"") + json.dumps(key).encode() + b": " + rng.choice(ODD_RAW) + b"}"
    elif kind == 5:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif kind == 6:
        return json.dumps(doc).encode()[: rng.randrange(1, 40)]
    return json.dumps(doc).encode()


def _case(rng: random.Random) -> tuple[str, str, bytes, dict[str, str], bool]:
    """(method, path, body, headers, chunked) of one case; one in ten claims a ``Content-Encoding`` its body
    does not have (issue 31: a 500 on the pipeline, ``/async-function`` and ``/system``)."""
    method, path, body, headers, chunked = _request(rng)
    if rng.random() < 0.1:
        headers = {**headers, "Content-Encoding": rng.choice(["gzip", "deflate", "br", "x-unknown"])}
    return method, path, body, headers, chunked


def _openai(rng: random.Random) -> tuple[str, str, bytes, dict[str, str], bool]:
    """A mutated OpenAI-shaped request (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``)."""
    if rng.random() < 0.1:
        return rng.choice(["GET", "POST"]), "/v1/models", b"", {}, False
    doc: dict[str, Any] = {"model": rng.choice(["bert-21b", "fz-none", ""]), "max_tokens": 4, "stream": rng.random() < 0.3}
    if rng.random() < 0.5:
        doc["prompt"] = rng.choice(["hi", "x" * 300_000, ["a", "b"], [1, 2, 3]])
        path = "/v1/completions"
    else:
        doc["messages"] = rng.choice([[{"role": "user", "content": "hi"}], [{"role": "x"}], "hi", []])
        path = "/v1/chat/completions"
    return "POST", path, _mutate(rng, doc), {"Content-Type": "application/json"}, rng.random() < 0.2


def _request(rng: random.Random) -> tuple[str, str, bytes, dict[str, str], bool]:
    api = rng.randrange(5)
    if api == 4:
        return _openai(rng)
    if api == 0:
        return rng.choice(["POST", "PUT"]), "/system/functions", _mutate(rng, _base(rng)), {}, rng.random() < 0.2
    if api == 1:
        doc = {"serviceName": "bert-21b-stage-0", "replicas": 2}
        return "POST", "/system/scale-function/fz-none", _mutate(rng, doc), {}, False
    headers = {"Content-Type": rng.choice(["application/json", "application/octet-stream", "text/plain", "x/y"])}
    doc = {"input_ids": [[1, 2, 3]]} if rng.random() < 0.8 else {"text": rng.choice(["hi", "x" * 20_000, ["a", "b"]])}
    body = _mutate(rng, doc) if rng.random() < 0.7 else bytes(rng.randrange(256)
                                                                                     for _ in range(rng.randrange(200)))
    if rng.random() < 0.2:
        headers["X-Quart-Timeout-Ms"] = "".join(c for c in str(rng.choice(ODD_VALUES))[:30] if c.isprintable() and c.isascii())
    target = rng.choice(["bert-21b", "bert-21b-stage-0", "bert-21b-stage-1", "fz-none", "bert-21b.other"])
    if api == 2:
        return "POST", f"/function/{target}", body, headers, rng.random() < 0.2
    headers["X-Callback-Url"] = rng.choice(["http://127.0.0.1:9/cb", "ftp://x", "not a url", "http://[::1", ""])
    return "POST", f"/async-function/{target}", body, headers, False


async def fuzz(gw: Any, cases: int, seed: int) -> dict[str, Any]:
    """Run ``cases`` seeded cases against ``gw`` (a running :class:`~quart_tools.bench.chaos.Gateway`)."""
    rng = random.Random(seed)
    found = {"cases": 0, "status_5xx": 0, "hangs": 0, "crashes": 0, "by_status": {}, "examples_5xx": []}
    sem = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as session:
        async def one(method: str, path: str, body: bytes, headers: dict[str, str], chunked: bool) -> None:
            async with sem:
                auth = gw.auth if path.startswith("/system") else None
                data: Any = body
                if chunked:
                    async def pieces():
                        yield body[: len(body) // 2]
                        yield body[len(body) // 2:]
                    data = pieces()
                try:
                    async with session.request(method, gw.url + path, data=data, headers=headers, auth=auth,
                                               timeout=aiohttp.ClientTimeout(total=10)) as r:
                        await r.read()
                        found["by_status"][str(r.status)] = found["by_status"].get(str(r.status), 0) + 1
                        if r.status >= 500:
                            found["status_5xx"] += 1
                            if len(found["examples_5xx"]) < 5:
                                found["examples_5xx"].append({"path": path, "status": r.status,
                                                              "body": body[:200].decode("latin-1")})
                except TimeoutError:
                    found["hangs"] += 1
                except aiohttp.ClientError:
                    if not gw.alive():
                        found["crashes"] += 1
                found["cases"] += 1

        await asyncio.gather(*(one(*_case(rng)) for _ in range(cases)))
        if not gw.alive():
            found["crashes"] = max(1, found["crashes"])
        else:
            async with session.get(f"{gw.url}/system/functions", auth=gw.auth) as r:
                names = [f["name"] for f in await r.json() if f["name"].startswith("fz-")]
            for name in names:
                async with session.delete(f"{gw.url}/system/functions", json={"functionName": name}, auth=gw.auth):
                    pass
            found["deployed_and_removed"] = len(names)
    return found
