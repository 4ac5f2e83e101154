"""Layer ranges of a stage: the ``X-Quart-Layers`` header, the shape of a range, and the layers a replica holds.

A stage holds layers ``[S, E)`` of its model's layer list ``[embeddings, block_0..block_{L-1}, head]``
(absolute, half-open). A request may ask for a contiguous sub-range ``[A, B)`` with ``S <= A < B <= E``
(header ``X-Quart-Layers: A-B``); absent means the whole stage. Input follows ``A`` (token ids at 0, else
``hidden_states``), output follows ``B`` (``logits`` at the head, else ``hidden_states``).

A replica started while its stage file is still arriving (KeysManager live start) holds only a prefix
``[S, S + k)``, a ParaServe part worker a range ``[S + lo, S + hi)`` that grows both ways as the rest arrives:
:class:`LiveProgress` reads it from the small progress file the transfer's writer updates after each layer's
sha256 matched (``keysmanager.transfer``, ``keysmanager.parts``). Every response says what the replica holds
(``X-Quart-Layers-Held``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quart_stage.errors import QuartError, invalid
from quart_stage.progress import read_range
from quart_stage.spans import H_LAYERS, H_LAYERS_HELD, SPAN, fmt  # noqa: F401 - re-exported

FIELD = "layers"


@dataclass(frozen=True)
class Shape:
    """What a stage (or a layer range of it) accepts and produces."""

    model: str
    takes_ids: bool
    gives_logits: bool
    dtype: torch.dtype
    in_width: int | None
    out_width: int
    vocab_size: int | None
    type_vocab_size: int | None
    max_seq: int | None


def manifest_shape(model: str, config: dict, dtype: torch.dtype, start: int, end: int, total: int) -> Shape:
    """The shape of layers ``[start, end)`` of a model with ``total`` layers and architecture ``config``."""
    hidden = int(config.get("hidden_size"))
    last = end == total
    return Shape(
        model=model, takes_ids=start == 0, gives_logits=last, dtype=dtype,
        in_width=None if start == 0 else hidden, out_width=int(config["vocab_size"]) if last else hidden,
        vocab_size=int(config["vocab_size"]),
        type_vocab_size=int(config["type_vocab_size"]) if "type_vocab_size" in config else None,
        max_seq=int(config.get("max_position_embeddings") or 0) or None,
    )


def parse_layers(value: str | None, stage: tuple[int, int]) -> tuple[int, int]:
    """The range a request asks for: ``stage`` when the header is absent; 400 naming ``layers`` when it is
    malformed or not inside ``stage``."""
    if value is None:
        return stage
    m = SPAN.match(value)
    if m is None:
        raise invalid(FIELD, f"{H_LAYERS} must be A-B (absolute layer indices, half-open), got {value!r}")
    a, b = int(m.group(1)), int(m.group(2))
    s, e = stage
    if not s <= a < b <= e:
        raise invalid(FIELD, f"layers [{a}, {b}) are not a non-empty range inside this stage's layers [{s}, {e})")
    return a, b


def not_held(span: tuple[int, int], held: tuple[int, int]) -> QuartError:
    """503 for a range this replica does not hold (yet)."""
    return QuartError(503, f"layers [{span[0]}, {span[1]}) are not all held here yet: this replica holds "
                           f"[{held[0]}, {held[1]})", FIELD, {"Retry-After": "1"})


def range_share(counts: list[int], span: tuple[int, int], stage: tuple[int, int]) -> float:
    """The share of the stage's parameters (and so of its emulated service time) in ``span``."""
    whole = sum(counts[stage[0]:stage[1]])
    if whole <= 0:
        return (span[1] - span[0]) / max(1, stage[1] - stage[0])
    return sum(counts[span[0]:span[1]]) / whole


class LiveProgress:
    """The layers a live replica holds: ``[start + lo, start + hi)`` read from the writer's progress file on each
    call (16 bytes, no thread, no polling); it only grows, and once the whole stage is held it stops reading."""

    def __init__(self, path: str, start: int, end: int) -> None:
        self.path, self.start, self.end = path, start, end
        self._lo, self._hi = 0, 0

    def verified(self) -> int:
        """How many layers are held now."""
        self.held()
        return self._hi - self._lo

    def held(self) -> tuple[int, int]:
        if not self.full:
            lo, hi = read_range(self.path)
            hi = min(hi, self.end - self.start)
            if lo < hi and (self._lo == self._hi or (lo <= self._lo and self._hi <= hi)):
                self._lo, self._hi = lo, hi  # never goes back: the writer only ever grows it
        return self.start + self._lo, self.start + self._hi

    @property
    def full(self) -> bool:
        return self._lo == 0 and self.start + self._hi >= self.end
