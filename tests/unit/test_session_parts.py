"""A generation session over a part of a stage (``X-Quart-Layers`` with ``X-Quart-Session``, cooperative execution):
each replica keeps the KV cache of the layers it ran, the parts chained give transformers' greedy ``generate``,
a part is charged its share of the positions, and a step for other layers is 409 and changes nothing."""

from __future__ import annotations

import json

import pytest
import torch
from quart_stage import wire
from quart_stage.config import StageConfig
from quart_stage.runtime import StageRuntime
from quart_stage.spans import kv_charge
from quart_stage.verify import reference_model
from quart_tools.partition import partition

CONFIG = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=True)
PROMPT = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(5)).tolist()
NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("parts") / "llama")
    partition({**CONFIG, "_name": "parts"}, 1, d, progress=False, seed=11, std=0.5)
    with torch.inference_mode():
        ref = reference_model(d).generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False,
                                          use_cache=True, pad_token_id=0)[0, len(PROMPT):].tolist()
    return d, ref


def _step(rt: StageRuntime, body: bytes, ctype: str, pos: int, layers: str):
    return rt.handle(body, {"Content-Type": ctype, "X-Quart-Session": "s", "X-Quart-Session-Pos": str(pos),
                            "X-Quart-Layers": layers, "X-Quart-Session-Reserve": str(len(PROMPT) + NEW)})


def test_a_session_split_over_two_replicas_gives_generate_tokens_each_part_charged_its_share(model):
    model_dir, expected = model
    first, rest = (StageRuntime.load(StageConfig(model_dir=model_dir)) for _ in range(2))
    end = first.stage_range[1]  # 6: embeddings, 4 blocks, head
    tokens, pos, new = [], 0, PROMPT
    while len(tokens) < NEW:
        a = _step(first, json.dumps({"input_ids": [new]}).encode(), "application/json", pos, "0-2")
        assert a.status == 200 and a.headers["X-Quart-Layers"] == "0-2", a.body[:200]
        assert wire.decode(a.body).metadata["stage"] == "0"  # the same stage's next part takes it
        b = _step(rest, a.body, wire.CONTENT_TYPE, pos, f"2-{end}")
        assert b.status == 200, b.body[:200]
        pos += len(new)
        new = [json.loads(b.body)["token"]]
        tokens += new
    assert tokens == expected
    total = len(PROMPT) + NEW
    assert first.generation.table.used == kv_charge(total, (0, 2), (0, end)) == -(-total * 2 // end)
    assert rest.generation.table.used == kv_charge(total, (2, end), (0, end))
    other = _step(first, json.dumps({"input_ids": [new]}).encode(), "application/json", pos, "0-3")
    assert other.status == 409 and first.generation.table.held("s") == pos  # other layers: refused, nothing changed
