"""The virtual-time loop itself: a schedule's clock always moves to the timers it runs."""

from __future__ import annotations

import asyncio

from .vloop import new_loop


def test_sleeping_until_an_instant_a_hair_ahead_reaches_it_while_other_tasks_are_busy() -> None:
    """Two tasks that wait for the same instant by sleeping the rest of the way (as a store retrying until an outage
    ends does) keep the ready queue busy in turn; the clock must still reach that instant, and they must end."""
    loop = new_loop()
    now = 2.690999999999998  # the instant and the deadline are a few units of float rounding apart
    deadline = 2.691
    wakeups = 0

    async def wait_until_deadline(phase: int) -> None:
        nonlocal wakeups
        for _ in range(phase):  # out of step with the other task: one of them is always ready to run
            await asyncio.sleep(0)
        while loop.time() < deadline:
            wakeups += 1
            assert wakeups < 100, f"the clock is stuck at {loop.time()!r}, short of {deadline!r}"
            await asyncio.sleep(deadline - loop.time())

    async def main() -> float:
        loop.advance_to(now)
        await asyncio.gather(wait_until_deadline(0), wait_until_deadline(1))
        return loop.time()

    try:
        assert loop.run_until_complete(main()) >= deadline
    finally:
        asyncio.set_event_loop(None)
        loop.close()
