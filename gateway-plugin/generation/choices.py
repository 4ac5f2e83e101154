"""A request with several choices (``n`` > 1, ``best_of``, a list of prompts): one session per choice, and which
are answered in which order. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway_plugin.generation.params import GenerationParams
from gateway_plugin.generation.session import Session


class Produced(Protocol):
    """What a choice's generation produced (openai_api.Outcome)."""

    prompt_tokens: int
    tokens: list[int]
    answers: list[dict]  # per token, the last stage's logprobs


@dataclass
class Run:
    """One choice's session: its prompt's index, its own index among the prompt's sessions."""

    prompt: int
    j: int
    params: GenerationParams
    session: Session
    outcome: Produced

    def index(self, n: int) -> int:
        """Its choice's ``index`` in OpenAI's order: prompt p's j-th choice is ``p * n + j``."""
        return self.prompt * n + self.j


def answered(runs: list[Run], prompts: int, n: int) -> list[tuple[int, Run]]:
    """(index, run) of the choices answered: each prompt's ``n``, the ones whose tokens' logprobs sum highest when
    it ran more (best_of, vLLM's rule; ties keep the seed order)."""
    out = []
    for p in range(prompts):
        mine = [r for r in runs if r.prompt == p]
        if len(mine) > n:
            mine = sorted(mine, key=lambda r: -sum(a.get("logprob", 0.0) for a in r.outcome.answers))[:n]
        out += [(p * n + j, run) for j, run in enumerate(mine)]
    return out


def usage(runs: list[Run]) -> dict[str, int]:
    """Each prompt's tokens once, every session's generated tokens."""
    prompt = sum({r.prompt: r.outcome.prompt_tokens for r in runs}.values())
    done = sum(len(r.outcome.tokens) for r in runs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
