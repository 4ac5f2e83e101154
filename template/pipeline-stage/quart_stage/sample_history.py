"""The token history a step's sample carries (``X-Quart-Sample``'s ``history``), for the penalties at the last stage.

Torch-free, so that the gateway (which builds each step's sample) never imports torch; the stage reads it back in
:mod:`quart_stage.sampling`.
"""

from __future__ import annotations

import base64

import numpy as np


def encode_history(ids: list[int] | tuple[int, ...]) -> str:
    """``ids`` as the ``history`` value: base64 of little-endian int32."""
    return base64.b64encode(np.asarray(ids, dtype="<i4").tobytes()).decode()


def with_history(sample: dict, prompt: list[int], generated: list[int]) -> dict:
    """``sample`` for the step that draws the token after ``prompt + generated``: with the ids its penalties read
    (the prompt's and the generated ones for ``repetition_penalty``, the generated ones for presence and
    frequency), so that the step is a pure function of its request and a replay samples the same."""
    if sample.get("repetition_penalty", 1.0) != 1.0 or sample.get("prompt_logprobs", -1) >= 0:
        return {**sample, "history": encode_history(prompt + generated), "prompt_len": len(prompt)}
    if (sample.get("presence_penalty") or sample.get("frequency_penalty")) and generated:
        return {**sample, "history": encode_history(generated)}
    return sample
