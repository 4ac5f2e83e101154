"""Token log-probabilities in OpenAI's answer shapes (chat's ``logprobs.content``, completions' ``tokens`` /
``token_logprobs`` / ``top_logprobs`` / ``text_offset``), from what the last stage answers per token:
``{"logprob": float, "top": [[id, logprob], ...]}`` (quart_stage.sampling.logprobs: the model's raw distribution,
vLLM's default). Pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[list[int]], str]


def _text(decode: Decode, token: int) -> str:
    return decode([token])


def chat(decode: Decode, tokens: Sequence[int], answers: Sequence[dict]) -> dict[str, Any]:
    """Chat's ``choice.logprobs`` for ``tokens`` (their stage answers in ``answers``, in order)."""
    content = []
    for token, answer in zip(tokens, answers, strict=True):
        text = _text(decode, token)
        top = [{"token": (t := _text(decode, i)), "logprob": lp, "bytes": list(t.encode())}
               for i, lp in answer.get("top", [])]
        content.append({"token": text, "logprob": answer.get("logprob"), "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion(decode: Decode, tokens: Sequence[int], answers: Sequence[dict], offset: int) -> dict[str, Any]:
    """Completions' ``choice.logprobs`` for ``tokens``, the first at character ``offset`` of the choice's text."""
    texts = [_text(decode, t) for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    tops = [{_text(decode, i): lp for i, lp in answer.get("top", [])} for answer in answers]
    return {"tokens": texts, "token_logprobs": [a.get("logprob") for a in answers], "top_logprobs": tops,
            "text_offset": offsets}
