"""The virtual-time loop itself: a schedule's clock always moves to the timers it runs."""

from __future__ import annotations

import asyncio

import pytest

from tests.lost_tasks import lost_tasks

from .vloop import LostTask, check_nothing_lost, close_loop, new_loop


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


def test_a_schedule_loses_no_task_to_the_loop_closing_and_reports_one_it_lost() -> None:
    """What still runs when a schedule ends (a tool that ignores cancellation) is run to its end before the loop
    closes, not dropped pending; a task that failed with nobody retrieving why is a finding (``LostTask``)."""
    loop = new_loop()
    ended: list[str] = []

    async def deaf() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)  # swallows the cancel and works on
        ended.append("deaf")

    async def fails() -> None:
        raise RuntimeError("nobody looks")

    async def main() -> None:
        loop.create_task(deaf())
        loop.create_task(fails())
        await asyncio.sleep(1)

    try:
        loop.run_until_complete(main())
    finally:
        close_loop(loop)
    assert ended == ["deaf"]
    with pytest.raises(LostTask, match="nobody looks"):
        check_nothing_lost(loop)
    assert len(lost_tasks()) == 1  # the suite's own check saw it too; lost on purpose here
