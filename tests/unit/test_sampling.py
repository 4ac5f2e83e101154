"""The last stage's sampler (quart_stage.sampling) against transformers' own logits processors on the same logits:
min_tokens, logit_bias, repetition_penalty, temperature, min_p, top_k and top_p; presence and frequency penalties
(transformers has none) against vLLM's formula written out token by token; the draw against the inverse CDF of
transformers' distribution; the header's checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from quart_stage import sample_history, sampling
from quart_stage.errors import QuartError
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 400
EOS = (2, 7)


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g) * 3
    prompt = torch.randint(0, VOCAB, (30,), generator=g).tolist()
    generated = torch.randint(0, VOCAB, (12,), generator=g).tolist() + [5, 5, 5]
    return logits, prompt, generated


def _params(prompt, generated, **kw) -> sampling.SampleParams:
    doc = {"seed": 11, **kw}
    if kw.get("repetition_penalty", 1.0) != 1.0:
        doc.update(history=sample_history.encode_history(prompt + generated), prompt_len=len(prompt))
    elif kw.get("presence_penalty") or kw.get("frequency_penalty"):
        doc.update(history=sample_history.encode_history(generated))
    return sampling.parse_sample(json.dumps(doc))  # through the header, as the stage reads it


def _presence_frequency(scores: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """vLLM's presence and frequency penalties, one id at a time (a second implementation)."""
    out = scores.clone()
    for token in set(generated):
        out[0, token] -= frequency * generated.count(token) + presence
    return out


def _transformers_logits(logits, prompt, generated, *, bias=None, repetition=1.0, min_tokens=0, presence=0.0,
                         frequency=0.0) -> torch.Tensor:
    ids = torch.tensor([prompt + generated])
    procs = LogitsProcessorList()
    if min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, list(EOS)))
    if bias:
        procs.append(SequenceBiasLogitsProcessor({(int(k),): float(v) for k, v in bias.items()}))
    if repetition != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition))
    scores = procs(ids, logits[None].clone())
    return _presence_frequency(scores, generated, presence, frequency)[0]


ADJUSTMENTS = [
    {},
    {"repetition_penalty": 1.7},
    {"repetition_penalty": 0.6},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8, "presence_penalty": -0.5},
    {"logit_bias": {"3": 100, "9": -100, "17": 4.5}},
    {"min_tokens": 20},
    {"min_tokens": 20, "repetition_penalty": 1.3, "frequency_penalty": 2.0, "logit_bias": {"2": 50}},
]


def _ours(prompt, generated, adj: dict, **kw) -> sampling.SampleParams:
    adj = dict(adj)
    min_tokens = adj.pop("min_tokens", 0)
    if min_tokens:
        kw.update(min_pos=len(prompt) + min_tokens, suppress=list(EOS))
    return _params(prompt, generated, **adj, **kw)


def _theirs(logits, prompt, generated, adj: dict) -> torch.Tensor:
    return _transformers_logits(logits, prompt, generated, bias=adj.get("logit_bias"),
                                repetition=adj.get("repetition_penalty", 1.0), min_tokens=adj.get("min_tokens", 0),
                                presence=adj.get("presence_penalty", 0.0), frequency=adj.get("frequency_penalty", 0.0))


@pytest.mark.parametrize("adj", ADJUSTMENTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adjusted_logits_and_greedy_equal_transformers_processors(adj, seed):
    logits, prompt, generated = _case(seed)
    position = len(prompt) + len(generated)  # the position of the token drawn next
    ours = sampling.adjusted(logits, _ours(prompt, generated, adj), position)
    theirs = _theirs(logits, prompt, generated, adj)
    assert torch.allclose(ours, theirs, atol=1e-5) and torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert sampling.choose(logits, _ours(prompt, generated, adj), position) == int(torch.argmax(theirs))


def test_min_tokens_suppresses_the_stop_ids_until_reached():
    logits = torch.zeros(VOCAB)
    logits[EOS[1]] = 50.0  # the model wants to stop
    params = sampling.parse_sample(json.dumps({"min_pos": 13, "suppress": list(EOS)}))
    assert sampling.choose(logits, params, 12) != EOS[1]
    assert sampling.choose(logits, params, 13) == EOS[1]  # the 3rd token of a 10-token prompt: min_tokens 3 met


WARPERS = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 20},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.05},
    {"temperature": 1.1, "top_k": 40, "top_p": 0.7, "min_p": 0.02},
    {"temperature": 0.8, "top_k": 1},
]


@pytest.mark.parametrize("warp", WARPERS)
@pytest.mark.parametrize("adj", [ADJUSTMENTS[0], ADJUSTMENTS[-1]])
def test_sampling_distribution_equals_transformers_warpers(warp, adj):
    logits, prompt, generated = _case(5)
    position = len(prompt) + len(generated)
    params = _ours(prompt, generated, adj, **warp)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(warp["temperature"])])
    if warp.get("min_p"):
        warpers.append(MinPLogitsWarper(warp["min_p"]))
    if warp.get("top_k"):
        warpers.append(TopKLogitsWarper(warp["top_k"]))
    if warp.get("top_p"):
        warpers.append(TopPLogitsWarper(warp["top_p"]))
    ids = torch.tensor([prompt + generated])
    theirs = torch.softmax(warpers(ids, _theirs(logits, prompt, generated, adj)[None].clone())[0].double(), dim=-1)
    ours = sampling.distribution(logits, params, position)
    assert torch.equal(ours > 0, theirs > 0)  # the same tokens may be drawn
    assert torch.allclose(ours, theirs, atol=1e-6)
    # each draw is the inverse CDF of transformers' distribution (most likely first) at uniform(seed, position)
    for pos in range(position - 40, position + 1):  # all before min_tokens is met
        order = torch.sort(theirs, descending=True, stable=True).indices
        cdf = torch.cumsum(theirs[order], dim=0)
        u = sampling.uniform(params.seed, pos)
        expect = int(order[min(int((cdf <= u * float(cdf[-1])).sum()), VOCAB - 1)])
        got = sampling.choose(logits, params, pos)
        assert theirs[got] > 0 and (got == expect or abs(float(cdf[(order == got).nonzero()[0, 0]]) - u) < 1e-9)


def test_penalties_change_the_draws_and_replays_are_exact():
    logits, prompt, generated = _case(3)
    plain = _params(prompt, generated, temperature=1.0)
    penal = _params(prompt, generated, temperature=1.0, presence_penalty=2.0, repetition_penalty=2.0)
    positions = range(100, 300)
    a = [sampling.choose(logits, plain, p) for p in positions]
    b = [sampling.choose(logits, penal, p) for p in positions]
    assert a != b and b == [sampling.choose(logits, penal, p) for p in positions]


def test_logprobs_are_the_raw_distributions():
    logits, prompt, generated = _case(4)
    params = _params(prompt, generated, logprobs=3, repetition_penalty=1.5)
    doc = sampling.answer(logits, params, 50)
    raw = torch.log_softmax(logits, dim=-1)
    assert math.isclose(doc["logprob"], float(raw[doc["token"]]), abs_tol=1e-5)
    assert [i for i, _ in doc["top"]] == torch.topk(raw, 3).indices.tolist()
    assert "logprob" not in sampling.answer(logits, sampling.GREEDY, 50)


@pytest.mark.parametrize("doc, words", [
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"history": "!!"}, "history"), ({"history": "AAA="}, "int32"), ({"prompt_len": 2}, "prompt_len"),
    ({"suppress": [-1]}, "suppress"), ({"logprobs": 21}, "logprobs"), ({"min_pos": -1}, "min_pos"),
])
def test_bad_sample_fields_are_400_naming_them(doc, words):
    with pytest.raises(QuartError) as err:
        sampling.parse_sample(json.dumps(doc))
    assert err.value.status == 400 and words in err.value.message


def test_ids_outside_the_vocabulary_are_400():
    logits = torch.zeros(10)
    for doc in ({"logit_bias": {"10": 1}}, {"history": sample_history.encode_history([12]), "presence_penalty": 1}):
        with pytest.raises(QuartError):
            sampling.choose(logits, sampling.parse_sample(json.dumps(doc)), 0)
