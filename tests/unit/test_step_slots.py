"""A replica's step slots (gateway_plugin.generation.slots): running sessions' steps go before new sessions'
prefills, first come first served within each, a cancelled waiter passes its slot on."""

from __future__ import annotations

import asyncio

from gateway_plugin.generation.slots import StepSlots


def test_running_steps_go_before_waiting_prefills_and_cancelled_waiters_pass_the_slot_on() -> None:
    async def main() -> list[str]:
        slots = StepSlots(1)
        order: list[str] = []
        release = asyncio.Event()

        async def step(name: str, running: bool) -> None:
            async with slots.hold(running):
                order.append(name)
                if name == "first":
                    await release.wait()

        first = asyncio.create_task(step("first", False))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(step(n, r)) for n, r in
                 [("prefill-a", False), ("decode-a", True), ("prefill-b", False), ("decode-b", True)]]
        gone = asyncio.create_task(step("cancelled", True))
        await asyncio.sleep(0.01)
        gone.cancel()
        release.set()
        await asyncio.gather(first, *tasks)
        assert slots.busy == 0 and slots.waiting == 0
        return order

    assert asyncio.run(main()) == ["first", "decode-a", "decode-b", "prefill-a", "prefill-b"]


def test_unlimited_slots_never_wait() -> None:
    async def main() -> int:
        slots = StepSlots(0)
        async with slots.hold(False), slots.hold(False), slots.hold(True):
            return slots.busy

    assert asyncio.run(main()) == 3
