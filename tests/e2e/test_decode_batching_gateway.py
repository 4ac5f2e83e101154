"""Continuous batching through a running embedded gateway (KeysManager host, real ``tiny`` stage replicas as
processes at 3 stages, ``com.quart.batch.decode-max: 8`` on every stage): concurrent streams on
``/function/<model>`` are token-identical to transformers' greedy ``generate``, and their decode steps ran in
batches of several sessions (docs/batching.md#decode-continuous-batching)."""

from __future__ import annotations

import concurrent.futures

import requests
import torch
from quart_stage.verify import reference_model
from quart_tools.partition import partition
from support.embedded_system import deploy_stack, stage_system, wait_available

PROMPTS = [[7, 8, 9, 10, 11], [40, 41], list(range(60, 90)), [3] * 9, [90, 12, 33, 5], list(range(100, 112))]
NEW = [24, 16, 20, 12, 24, 18]


def test_concurrent_streams_batch_and_give_generates_tokens(tmp_path):
    model_dir = tmp_path / "tiny"
    partition("tiny", 3, str(model_dir), stack={"compute": "cpu"}, progress=False)
    system = stage_system(tmp_path)
    try:
        names = deploy_stack(system, model_dir, {"com.quart.batch.decode-max": "8"})
        bad = {"service": "bad", "image": "quart/echo:latest", "labels": {"com.quart.batch.decode-max": "0"}}
        refused = requests.post(f"{system.url}/system/functions", json=bad, auth=system.auth, timeout=30)
        assert refused.status_code == 400 and "com.quart.batch.decode-max" in refused.text
        wait_available(system, dict.fromkeys(names, 1))

        def stream(k: int) -> list[int]:
            res = requests.post(f"{system.url}/function/tiny", json={"input_ids": PROMPTS[k], "max_tokens": NEW[k],
                                                                      "ignore_eos": True}, timeout=120)
            assert res.status_code == 200, res.text
            return res.json()["tokens"]

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(stream, range(len(PROMPTS))))
        engine = system.system.gateway.invoke_hooks[0].__self__.engine
        sizes = [int(size) for lane in engine.batch_sizes().values() for size in lane]
    finally:
        system.close()
    whole = reference_model(str(model_dir))
    whole.generation_config.eos_token_id = None
    whole.generation_config.pad_token_id = 0
    with torch.inference_mode():
        expected = [whole.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, use_cache=True)[0, len(p):]
                    .tolist() for p, n in zip(PROMPTS, NEW, strict=True)]
    assert got == expected
    assert max(sizes) >= 2  # steps of several sessions ran as one call
