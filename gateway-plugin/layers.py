"""Layer ranges in the router: which replica may run the next part of a stage, and which part.

A replica that is still receiving its parameters (BlitzScale's live scaling) or that holds only a part of
a stage (a ParaServe worker) serves the layers it holds: ``X-Quart-Layers-Held: A-B`` on each of its
answers (and ``layers_held`` in its host's report) says which. Ranges are half-open ``[A, B)`` in the
model's layer list (``[embeddings, block_0 .. block_{L-1}, head]``), as a stage's own range ``[S, E)`` is.

A request at a stage is at a layer position: ``None`` at the stage's start, else the first layer not yet
run. A replica is *eligible* when its held range starts at or before that position and reaches past it;
it runs from the position to the end of what it holds (``X-Quart-Layers``), and the request comes back to
the same stage's queue at the new position until the stage's last layer has run (cooperative execution:
the new replica runs the layers that have arrived, an existing one the rest). Pure.
"""

from __future__ import annotations

from gateway_plugin.ports import Replica
from quart_stage.spans import H_LAYERS as LAYERS
from quart_stage.spans import H_LAYERS_HELD as HELD
from quart_stage.spans import Span as Range
from quart_stage.spans import fmt as format_range
from quart_stage.spans import parse_span as parse_range

__all__ = ["HELD", "LAYERS", "Range", "eligible", "format_range", "held_range", "is_whole", "next_position",
           "parse_range", "part_for", "stage_range"]


def stage_range(replica: Replica) -> Range | None:
    """The whole stage's layers as the replica's host reported them (None: not reported, a whole replica)."""
    return replica.layers


def held_range(replica: Replica) -> Range | None:
    """The layers the replica can run now; None when it did not say (then it holds its whole stage)."""
    return replica.held or stage_range(replica)


def is_whole(replica: Replica) -> bool:
    """Holds every layer of its stage (what a replica that reports no layers is taken to hold)."""
    stage, held = stage_range(replica), replica.held
    return stage is None or held is None or held == stage


def eligible(replica: Replica, at: int | None) -> bool:
    """Can ``replica`` run the next part of a request at layer position ``at`` (None: the stage's start)?"""
    held = held_range(replica)
    if held is None:
        return at is None  # unknown layers: only whole-stage requests, which any whole replica runs
    stage = stage_range(replica)
    position = (stage[0] if stage else held[0]) if at is None else at
    return held[0] <= position < held[1]


def part_for(replica: Replica, at: int | None) -> Range | None:
    """The layers to ask ``replica`` for: None for its whole stage (no header), else ``[at or S, end held)``."""
    if at is None and is_whole(replica):
        return None
    held = held_range(replica)
    if held is None:  # reports no layers: only its whole stage, asked with no header
        return None
    stage = stage_range(replica)
    start = at if at is not None else (stage[0] if stage else held[0])
    return (start, held[1])


def next_position(ran: Range | None, stage: Range | None) -> int | None:
    """Where the request stands in its stage after running ``ran``: None when the stage is finished."""
    if ran is None or stage is None or ran[1] >= stage[1]:
        return None
    return ran[1]
