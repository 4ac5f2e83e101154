"""A split session's background-replay rejoin (gateway_plugin.generation.cooperative.LiveSplits) against a fake
session host: the replay feeds the session's whole context and is checked against the token after it."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from dataclasses import dataclass

from gateway_plugin.generation.config import GenerationConfig
from gateway_plugin.generation.cooperative import LiveSplits
from gateway_plugin.generation.kvbook import KVBook
from gateway_plugin.generation.session import Session, Split

PROMPT = list(range(1, 65))  # 64 positions, as the BlitzScale generation bench's prompts
MAX_TOKENS = 16


@dataclass
class Replica:
    id: str
    url: str = "http://127.0.0.1:9/"
    layers: tuple[int, int] = (0, 16)
    held: tuple[int, int] = (0, 16)
    state: str = "ready"  # gateway_plugin.ports.Replica


def model(seed: int, ids: list[int]) -> int:
    """A pure next-token function of (seed, every id so far), as the emulated stage's."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{ids}".encode(), digest_size=4).digest(), "big") % 1000


class Host:
    """What LiveSplits uses of the engine; steps answer ``model`` over exactly what they were fed."""

    def __init__(self) -> None:
        self.book, self.config, self.clock = KVBook(1000), GenerationConfig(rejoin="shadow"), time.monotonic
        self.source, self.fed, self.active = None, [], {}

    async def step(self, session: Session, new: list[int], pos: int, last: bool) -> int:
        self.fed.append((session.id, pos, list(new)))
        return model(session.sample["seed"], new if pos == 0 else [])

    def drop(self, session: Session) -> None:
        pass

    def forget(self, replica, session_id, then=None) -> None:
        pass

    def renew(self, session: Session, new_id: str | None = None) -> None:
        session.id = new_id or uuid.uuid4().hex

    def client(self):
        raise AssertionError("a shadow rejoin moves no bytes")

    def rehome(self, session, stage, placed) -> None:
        raise AssertionError("not used by a rejoin")


def _split_session(generated: int, reserve: int) -> tuple[Session, Replica]:
    """A session split at layer 8 of 16 whose live replica is now whole, ``generated`` tokens in."""
    whole, live = Replica("whole"), Replica("live")
    need, seed = len(PROMPT) + MAX_TOKENS, 7
    tokens: list[int] = []
    while len(tokens) < generated:
        tokens.append(model(seed, PROMPT + tokens))
    split = Split(live, (0, 8), (8, 16), part_tokens=need // 2 + reserve, rest_tokens=need // 2, reserve=reserve)
    session = Session("m", ["fn"], [whole], need, list(PROMPT), MAX_TOKENS, {"seed": seed}, frozenset(),
                      generated=tokens, fed=len(PROMPT) + generated - 1, splits={0: split})
    return session, live


def test_the_rejoin_replay_feeds_the_whole_context_and_its_token_matches_whatever_the_booking() -> None:
    """The replay used to be sent ``sequence[:n]`` with ``n`` rebound by the loop that booked its extra room (the
    extra positions), so it fed a prefix (40 here: a prompt token to compare, "another token than the session had")
    or past the end (an IndexError), and the session stayed split."""
    for reserve in (0, 40):  # not predicted to outlive the loading (extra = 80) or its room held (extra = 40)
        async def main(reserve=reserve):
            host = Host()
            splits = LiveSplits(host)
            session, live = _split_session(generated=6, reserve=reserve)
            fed = session.fed
            host.book.reserve_all(session.bookings())
            await splits.rejoin(session)  # starts the background replay
            assert splits.shadows == 1 and session.splits[0].task is not None
            await session.splits[0].task
            await splits.rejoin(session)  # the switch
            (_, pos, replayed), = host.fed
            assert (pos, replayed) == (0, (PROMPT + session.generated)[:fed])
            assert splits.replayed[0][0] == fed
            assert splits.rejoins == session.rejoins == 1 and not session.splits and session.replicas == [live]
            assert session.fed == fed  # the next step catches up from there
            assert host.book.reserved == {"live": session.need}  # the split's shares and the replay's extra freed
        asyncio.run(main())
