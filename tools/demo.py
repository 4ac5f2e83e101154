"""`quartctl demo`: the README's main job, end to end on one machine.

1. partitions a model into pipeline stages (``quartctl partition``): by default the pretrained sentence-
   embedding model all-MiniLM-L6-v2 shipped by a PyPI package (``minilm``; ``smollm2`` for SmolLM2-135M, or
   a random-weight preset such as ``tiny``);
2. starts the embedded gateway with one KeysManager per simulated host (``quartctl up``, in-process,
   on an ephemeral port);
3. deploys every stage function over the gateway REST API, exactly as faas-cli does;
4. sends a prompt through every stage via the gateway (``POST /function/<model>`` when the router
   plugin is attached, otherwise the demo chains ``/function/<model>-stage-<i>`` itself) and prints a
   real answer (`quart_tools.answers`): the cosine similarity of sentences (minilm), a chat answer streamed
   through ``/v1/chat/completions`` (smollm2: sessions with per-stage KV caches), or, for random-weight presets, the next-token ids;
5. scales one stage over REST (``/system/scale-function``) with the cache-aware placer (``--placer``):
   the new replica lands where the stage is cached and forks from the KeysManager's zygote; the demo
   prints which source each replica started from (fork/peer/cold) and its asked-to-ready time, and
   spreads requests over both replicas;
6. shuts everything down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from quart_kernel.scheduling import PLACERS
from quart_provider.config import GatewayConfig
from quart_provider.routes import start_site
from quart_provider.stack import load_stack
from quart_provider.system import EmbeddedSystem
from quart_stage import cliargs
from quart_stage.presets import MODEL_PRESETS, resolve_preset
from quart_tools.answers import show_answer
from quart_tools.realmodels import REAL_MODELS
from tqdm import tqdm

from keysmanager.aio import within

OCTETS = "application/octet-stream"
DEFAULT_PROMPTS = {"minilm": "A man is playing a guitar.", "smollm2": "What is the capital of France?",
                   "preset": "Serverless pipelines scale one stage at a time"}


def say(step: str, text: str) -> None:
    print(f"\n[{step}] {text}", flush=True)


def partition_model(model: str, stages: int, out: Path) -> Path:
    """Partition (or reuse an identical earlier partition); returns the stack.yml path."""
    manifest = out / "manifest.json"
    if manifest.exists() and (out / "stack.yml").exists():
        doc = json.loads(manifest.read_text())
        if len(doc.get("stages", [])) == stages:
            print(f"  reusing {out} ({stages} stages)")
            return out / "stack.yml"
    from quart_tools.partition import partition

    started = time.perf_counter()
    result = partition(model, stages, str(out), stack={"compute": "cpu"}, progress=sys.stderr.isatty())
    total = sum(s.parameter_bytes for s in result.stages) if result else 0
    print(f"  {result.model if result else model}: {stages} stages, {total / 2**20:.1f} MiB of parameters, "
          f"written to {out} in {time.perf_counter() - started:.1f} s")
    return out / "stack.yml"


class Demo:
    def __init__(self, system: EmbeddedSystem, session: aiohttp.ClientSession) -> None:
        self.system = system
        self.url = system.url
        self.session = session
        self.auth = aiohttp.BasicAuth(system.credentials.user, system.credentials.password)

    async def deploy_ready(self, stack_path: Path) -> list[str]:
        """:meth:`deploy`, then wait until every function has a ready replica; the function names."""
        names = await self.deploy(stack_path)
        await self.wait_available(names)
        return names

    async def deploy(self, stack_path: Path) -> list[str]:
        """faas-cli deploy: PUT /system/functions, POST when the function does not exist yet."""
        stack = load_stack(stack_path)
        self.system.gateway.images.register(stack.image_index_entries())
        names = []
        for fn in stack.functions:
            async with self.session.put(f"{self.url}/system/functions", json=fn.request, auth=self.auth) as res:
                status = res.status
            if status == 404:
                async with self.session.post(f"{self.url}/system/functions", json=fn.request, auth=self.auth) as res:
                    status = res.status
                    text = await res.text()
                if status != 202:
                    raise RuntimeError(f"deploying {fn.name} failed: {status} {text}")
            print(f"  {fn.name}: deployed ({status}), labels {fn.request['labels']}")
            names.append(fn.name)
        return names

    async def function(self, name: str) -> dict:
        async with self.session.get(f"{self.url}/system/function/{name}", auth=self.auth) as res:
            return await res.json()

    async def wait_available(self, names: list[str], want: dict[str, int] | None = None, timeout_s: float = 600) -> None:
        want = want or {}
        bar = tqdm(total=sum(want.get(n, 1) for n in names), desc="  replicas ready", file=sys.stderr,
                   disable=not sys.stderr.isatty())
        started = time.monotonic()
        deadline = started + timeout_s
        last_print = started
        while True:
            statuses = [await self.function(n) for n in names]
            ready = sum(min(s.get("availableReplicas", 0), want.get(s["name"], 1)) for s in statuses)
            bar.update(ready - bar.n)
            if bar.disable and time.monotonic() - last_print >= 10:  # progress without a TTY too
                last_print = time.monotonic()
                print(f"  ... {ready}/{bar.total} replicas ready after {last_print - started:.0f} s", flush=True)
            if all(s.get("availableReplicas", 0) >= want.get(s["name"], 1) for s in statuses):
                bar.close()
                return
            if time.monotonic() > deadline:
                bar.close()
                have = ", ".join(f"{st['name']}: {st.get('availableReplicas', 0)} available of {st.get('replicas')} "
                                 f"desired (want {want.get(st['name'], 1)})" for st in statuses)
                raise TimeoutError(f"replicas not ready after {timeout_s:.0f} s ({have}); the gateway and "
                                   f"KeysManager logs are in {self.system.config.state_dir / 'logs'}")
            await asyncio.sleep(0.2)

    async def invoke_pipeline(self, model: str, stages: list[str], prompt: str, verbose: bool = True) -> dict:
        """One request through every stage; returns the last stage's JSON output."""
        body = json.dumps({"text": prompt}).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        async with self.session.post(f"{self.url}/function/{model}", data=body, headers=headers) as res:
            if res.status != 404:  # the router plugin took /function/<model>
                if res.status != 200:
                    raise RuntimeError(f"/function/{model} answered {res.status}: {await res.text()}")
                if verbose:
                    print(f"  POST /function/{model} -> 200 (the router plugin took the request through "
                          f"{' -> '.join(stages)})")
                return _output(await res.read(), res.content_type)
        content_type = "application/json"
        for i, name in enumerate(stages):
            last = i == len(stages) - 1
            headers = {"Content-Type": content_type, "Accept": "application/json" if last else OCTETS}
            started = time.perf_counter()
            async with self.session.post(f"{self.url}/function/{name}", data=body, headers=headers) as res:
                payload = await res.read()
                if res.status != 200:
                    raise RuntimeError(f"{name} answered {res.status}: {payload[:300]!r}")
                if verbose:
                    print(f"  POST /function/{name:<24} -> {res.status}, {len(payload):>8} bytes, compute "
                          f"{res.headers.get('X-Quart-Compute-Ms', '?'):>6} ms, round trip "
                          f"{(time.perf_counter() - started) * 1000:6.1f} ms")
            body, content_type = payload, OCTETS
        return _output(body, "application/json")

    async def invoke_async(self, model: str, texts: list[str], timeout_s: float = 120.0) -> None:
        """``POST /async-function/<model>`` with a batch of texts and a callback to a loopback listener of the
        demo's own; prints the 202 and what the callback brought."""
        received: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_callback(request: web.Request) -> web.Response:
            if not received.done():
                received.set_result((dict(request.headers), await request.read()))
            return web.Response(status=200)

        app = web.Application()
        app.router.add_post("/done", on_callback)
        runner, port = await start_site(app, "127.0.0.1", 0)
        try:
            headers = {"Content-Type": "application/json", "Accept": "application/json",
                       "X-Callback-Url": f"http://127.0.0.1:{port}/done"}
            async with self.session.post(f"{self.url}/async-function/{model}", json={"text": texts},
                                         headers=headers) as res:
                if res.status != 202:
                    raise RuntimeError(f"/async-function/{model} answered {res.status}: {await res.text()}")
                call_id = res.headers["X-Call-Id"]
            print(f"  POST /async-function/{model} (a batch of {len(texts)} texts, X-Callback-Url) -> 202 Accepted, "
                  f"X-Call-Id {call_id}")
            try:
                got, payload = await within(timeout_s, received)
            except TimeoutError:
                raise RuntimeError(f"no callback for async call {call_id} within {timeout_s:g} s") from None
            doc = json.loads(payload)
            print(f"  callback for {got.get('X-Call-Id')}: X-Function-Status {got.get('X-Function-Status')}, "
                  f"{doc['output']} {doc['shape']}, tokens per text {[sum(r) for r in doc.get('attention_mask', [])]} "
                  f"(the shorter text padded, its attention_mask carried through every stage)")
        finally:
            await runner.cleanup()

    async def wait_scaled(self, name: str, replicas: int, timeout_s: float) -> dict:
        """Until ``replicas`` are available, or the desired count drops below it (the autoscaler undid the
        scale); a clear error after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.function(name)
            if status["availableReplicas"] >= replicas or status["replicas"] < replicas:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: {status['availableReplicas']} of {status['replicas']} replicas "
                                   f"available after {timeout_s:.0f} s; see the logs in "
                                   f"{self.system.config.state_dir / 'logs'}")
            await asyncio.sleep(0.05)

    async def timeline(self, since: float) -> list[dict]:
        """The plugin controller's decisions since ``since`` (empty without the plugin)."""
        async with self.session.get(f"{self.url}/function/quart-plugin/timeline", params={"since": str(since)}) as res:
            return await res.json() if res.status == 200 else []

    async def controller_clock(self) -> float | None:
        """The controller's clock (the time of its latest step), or None without the plugin."""
        rows = await self.timeline(float("-inf"))
        return rows[-1]["time"] if rows else None

    async def pin_floor(self, name: str, replicas: int) -> int:
        """PUT /system/functions with ``com.openfaas.scale.min`` raised (what `faas-cli deploy --label` does):
        the autoscaler never goes below it, and only a label changed, so no replica restarts."""
        doc = await self.function(name)
        body = {k: doc[k] for k in ("image", "envVars", "labels", "annotations", "limits", "requests") if k in doc}
        body["service"] = name
        body["labels"] = {**doc.get("labels", {}), "com.openfaas.scale.min": str(replicas)}
        async with self.session.put(f"{self.url}/system/functions", json=body, auth=self.auth) as res:
            if res.status != 200:
                raise RuntimeError(f"raising the floor of {name} failed: {res.status} {await res.text()}")
            return res.status

    async def watch_controller(self, name: str, index: int, since: float, seconds: float) -> tuple[int, str]:
        """Follow the autoscaler's decisions for one stage for ``seconds``; returns (desired, reason) of the
        first decision that differs from the manual count, or of the last one."""
        manual = (await self.function(name))["replicas"]
        deadline = time.monotonic() + seconds
        last = (manual, "")
        while time.monotonic() < deadline:
            for row in await self.timeline(since):
                if row["time"] <= since:
                    continue
                since = row["time"]
                reason = (row.get("reasons") or [""] * (index + 1))[index]
                last = (row["desired"][index], reason)
                if row["desired"][index] != manual:
                    return last
            await asyncio.sleep(0.2)
        return last

    async def scale(self, name: str, replicas: int) -> dict:
        async with self.session.post(f"{self.url}/system/scale-function/{name}", auth=self.auth,
                                     json={"serviceName": name, "replicas": replicas}) as res:
            return {"status": res.status, **(await res.json())}

    async def show_listing(self) -> None:
        async with self.session.get(f"{self.url}/system/functions", auth=self.auth) as res:
            listing = await res.json()
        print(f"  {'function':<26}{'replicas':>9}{'available':>10}{'invocations':>12}")
        for f in listing:
            print(f"  {f['name']:<26}{f['replicas']:>9}{f['availableReplicas']:>10}{f['invocationCount']:>12}")

    async def show_replicas(self, name: str) -> None:
        async with self.session.get(f"{self.url}/system/replicas/{name}", auth=self.auth) as res:
            doc = await res.json()
        for r in doc["replicas"]:
            took = f"in {r['readyMs']:8.1f} ms" if r.get("readyMs") is not None else " " * 11
            print(f"  {r['id']:<34} host {r['host']:<7} {r['state']:<9} started by {r['source']:<5} {took} "
                  f"served {r['served']}")


def _output(payload: bytes, content_type: str) -> dict:
    """The last stage's output (argmax, shape, top-5 ids of the last position), from JSON or safetensors."""
    if content_type == "application/json":
        doc = json.loads(payload)
        tensor = None
        if "data" in doc:
            import torch

            tensor = torch.tensor(doc["data"])
    else:
        from quart_stage import wire

        name, tensor = next(iter(wire.decode(payload).tensors.items()))
        doc = {"output": name, "shape": list(tensor.shape), "argmax": tensor.argmax(-1).tolist()}
    if tensor is not None and tensor.dim() == 3:  # logits; an embedding model answers batch x hidden
        doc["top5"] = tensor[0, -1].float().topk(5).indices.tolist()
    return doc


def top_tokens(model_dir: Path, ids: list[int]) -> str:
    """The tokens behind ids, from the partition's byte-level tokenizer (empty if there is none)."""
    tokenizer = model_dir / "tokenizer.json"
    if not tokenizer.exists():
        return ""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    tokens = [tok.id_to_token(i) for i in ids]
    if all(t is None for t in tokens):
        return f"{ids} (ids beyond the byte-level tokenizer's {tok.get_vocab_size()} tokens)"
    return ", ".join(f"{i}={t!r}" if t is not None else str(i) for i, t in zip(ids, tokens, strict=True))


async def run(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)  # clean up on SIGTERM too
    state_dir = args.state_dir.resolve()
    model_dir = state_dir / "models" / f"{args.model}-{args.stages}"
    say("1/6", f"Partitioning the {args.model!r} model into {args.stages} stages (DeepSpeed partitioner)")
    stack_path = partition_model(args.model, args.stages, model_dir)

    # The plugin's controller runs as in `quartctl up` (QUART_POLICY, default quart; QUART_ACTUATOR,
    # default gateway). Step 5 shows how a manual scale and the autoscaler coexist.
    from gateway_plugin.config import PluginConfig
    from gateway_plugin.plugin import attach

    plugin_config = PluginConfig.from_env()
    say("2/6", f"Starting the embedded gateway and {args.hosts} KeysManager(s) ({args.gpus_per_host} slots each)")
    config = GatewayConfig.from_env(port=0, state_dir=state_dir, hosts=args.hosts, gpus_per_host=args.gpus_per_host,
                                    placer=args.placer, callback_allowed_networks="127.0.0.1/32")  # our listener
    system = EmbeddedSystem(config, plugin=attach)
    await system.start()
    try:
        print(f"  gateway {system.url}; credentials: user {system.credentials.user}, password in "
              f"{system.credentials.password_file} (mode 0600)")
        # every call is bounded: a pipeline request by the router's deadline (QUART_REQUEST_TIMEOUT_S, 60 s)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            demo = Demo(system, session)
            say("3/6", "Deploying the stage functions over the REST API (as `faas-cli deploy` does)")
            stages = await demo.deploy(stack_path)
            started = time.perf_counter()
            await demo.wait_available(stages)
            print(f"  all {len(stages)} stages ready in {time.perf_counter() - started:.1f} s (cold start: each "
                  "KeysManager loads the stage and keeps it cached as a zygote)")

            model = json.loads((model_dir / "manifest.json").read_text())["model"]
            say("4/6", f"Sending {args.prompt!r} through every stage via the gateway")
            out = await demo.invoke_pipeline(model, stages, args.prompt)
            if not await show_answer(session, system.url, model, stages, model_dir, args.prompt):
                next_ids = [row[-1] for row in out["argmax"]]
                print(f"  output {out['output']} {out['shape']}; next-token id(s) {next_ids}")
                if out.get("top5"):
                    print(f"  top-5 next tokens: {top_tokens(model_dir, out['top5']) or out['top5']}")
                print("  (random weights: the tokens are arbitrary; the point is the path through every stage)")
            await demo.invoke_async(model, [args.prompt, args.prompt.split()[0]])

            index = min(1, len(stages) - 1)
            target = stages[index]
            say("5/6", f"Scaling {target} to 2 replicas over REST (POST /system/scale-function/{target})")
            since = await demo.controller_clock()
            print(f"  -> {await demo.scale(target, 2)}")
            started = time.perf_counter()
            status = await demo.wait_scaled(target, 2, args.scale_timeout)
            if status["availableReplicas"] >= 2:
                print(f"  second replica ready in {time.perf_counter() - started:.2f} s (placer {args.placer})")
                await demo.show_replicas(target)
            else:
                print(f"  the autoscaler lowered {target} to {status['replicas']} before the second replica "
                      f"was ready ({time.perf_counter() - started:.2f} s)")
            await coexist(demo, target, index, since, plugin_config, args.watch)
            for _ in range(args.requests):
                await asyncio.gather(*(demo.invoke_pipeline(model, stages, args.prompt, verbose=False)
                                       for _ in range(2)))
            print(f"  sent {2 * args.requests} more requests, two at a time; replicas of {target}:")
            await demo.show_replicas(target)
            print("  GET /system/functions:")
            await demo.show_listing()
    finally:
        say("6/6", "Shutting down (replicas, zygotes, KeysManagers)")
        await system.stop()
    print("  done.")
    return 0


async def coexist(demo: Demo, target: str, index: int, since: float | None, config, watch_s: float) -> None:
    """Show what the autoscaler makes of the manual scale, and pin the floor when it undoes it."""
    if since is None:
        print("  (no gateway plugin attached: nothing else scales this stage)")
        return
    if config.actuator == "none":
        print(f"  the autoscaler (policy {config.policy}) only observes here (QUART_ACTUATOR=none): the manual "
              "scale stands")
        return
    print(f"  the autoscaler (policy {config.policy}, every {config.control_period_s:g} s) is acting too; "
          f"watching its decisions for {target} for up to {watch_s:g} s ...")
    desired, reason = await demo.watch_controller(target, index, since, watch_s)
    if desired >= 2:
        print(f"  it keeps {desired} replica(s) so far ({reason or 'no change'}); with no load it releases the extra "
              "one after its scale-down cool-down: a manual replica count is only a starting point for an "
              "autoscaler, as in OpenFaaS")
    else:
        print(f"  it set {target} back to {desired} replica(s) ({reason}): with no load the stage needs one; a "
              "manual replica count is only a starting point for an autoscaler, as in OpenFaaS")
    print("  pinning a floor: PUT /system/functions with com.openfaas.scale.min=2 (the autoscaler never goes below "
          "scale.min; only a label changes, so no replica restarts)")
    await demo.pin_floor(target, 2)
    started = time.perf_counter()
    await demo.wait_available([target], {target: 2}, timeout_s=60)
    print(f"  {target}: 2 replicas available after {time.perf_counter() - started:.2f} s, kept by the autoscaler "
          "from now on")


def main(argv: list[str]) -> int:
    p = cliargs.ArgumentParser(prog="quartctl demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="minilm",
                   help="minilm (default: sentence embeddings), smollm2 (text generation), or a random-weight "
                        "preset (small, tiny, ...)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (default 4)")
    p.add_argument("--hosts", type=int, default=2, help="simulated hosts (default 2)")
    p.add_argument("--gpus-per-host", type=int, default=8,
                   help="replica slots per host (default 8: room beside the stages, so a scaled stage forks where "
                        "it is cached)")
    p.add_argument("--placer", choices=PLACERS, default="cache-aware", help="replica placer (default cache-aware)")
    p.add_argument("--prompt", default=None,
                   help="the text sent (default: a sentence for minilm, a question for smollm2, a prompt for presets)")
    p.add_argument("--requests", type=int, default=3, help="extra request pairs after scaling (default 3)")
    p.add_argument("--watch", type=float, default=4.0,
                   help="seconds to follow the autoscaler's decisions after the manual scale (default 4)")
    p.add_argument("--scale-timeout", type=float, default=60.0,
                   help="seconds to wait for the manually added replica (default 60)")
    p.add_argument("--state-dir", type=Path, default=Path(".quart/demo"), help="models, sockets, logs")
    p.add_argument("--verbose", "-v", action="store_true", help="log the gateway's and plugin's messages")
    args = p.parse_args(argv)
    if args.model not in REAL_MODELS and resolve_preset(args.model) is None:
        p.error(f"--model {args.model!r} is neither a packaged model ({', '.join(REAL_MODELS)}) nor a preset "
                f"({', '.join(MODEL_PRESETS)})")
    args.prompt = args.prompt or DEFAULT_PROMPTS.get(args.model, DEFAULT_PROMPTS["preset"])
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="  %(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        return asyncio.run(run(args))
    except (TimeoutError, RuntimeError) as exc:
        print(f"quartctl demo: {exc}", file=sys.stderr)
        return 1
