"""A deterministic event loop on a virtual clock.

``time()`` is virtual: when nothing is ready to run, the clock jumps to the next timer instead of sleeping, so a
schedule that spans minutes of session time runs in milliseconds, and the same inputs give the same order of
callbacks every time (asyncio runs ready callbacks first-in first-out; timers due at the same instant keep the order
the heap gives them, which depends only on the order they were scheduled in).

The simulation does no real I/O. A loop with nothing ready and no timer can never make progress again: that is a
hang, and it is reported (``Stalled``) instead of blocking forever.
"""

from __future__ import annotations

import asyncio
import gc
import heapq
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from tests.lost_tasks import LOST_TASK_MESSAGES

T = TypeVar("T")


#: A schedule spans at most a few virtual minutes, which take well under a second of real time; one still running
#: after this long is spinning (tasks that keep each other ready without the clock ever moving).
REAL_TIME_LIMIT_S = 30.0


class Stalled(RuntimeError):
    """Every task waits on something that nothing will ever resolve."""


class Livelock(RuntimeError):
    """Tasks keep running without the schedule ever finishing (a busy loop)."""


class LostTask(RuntimeError):
    """asyncio lost a task of the schedule: one destroyed while still pending, or one that failed with nobody
    retrieving why (a close, cancel or crash path left work behind)."""


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        self._clock_resolution = 1e-9
        self._real_deadline = time.monotonic() + REAL_TIME_LIMIT_S
        self.lost: list[str] = []  # what asyncio reported about lost tasks (also once the loop is closed)
        self.set_exception_handler(self._on_exception)

    def _on_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = context.get("message", "")
        if any(lost in message for lost in LOST_TASK_MESSAGES):
            what = context.get("task") or context.get("future")
            self.lost.append(f"{message} {what!r} exception={context.get('exception')!r}")
        self.default_exception_handler(context)

    def time(self) -> float:
        return self._now

    def _run_once(self) -> None:
        if time.monotonic() > self._real_deadline:
            raise Livelock(f"still running after {REAL_TIME_LIMIT_S:g}s of real time (virtual t={self._now:.3f}s)")
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        while scheduled and scheduled[0].cancelled():
            heapq.heappop(scheduled)
            self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
        if not self._ready and not self._stopping:  # type: ignore[attr-defined]
            if not scheduled:
                raise Stalled(f"nothing can run at t={self._now:.3f}s: every task waits forever")
            self._now = max(self._now, scheduled[0].when())
        elif scheduled and scheduled[0].when() < self._now + self._clock_resolution:
            # the base loop runs a timer this close as due; the clock must reach its time too, or a task that sleeps
            # until an instant a hair ahead (``sleep(deadline - time())``) wakes before it again and again while
            # another task keeps the ready queue busy, and the clock never moves
            self._now = max(self._now, scheduled[0].when())
        super()._run_once()  # type: ignore[misc]

    def advance_to(self, when: float) -> None:
        self._now = max(self._now, when)


def new_loop() -> VirtualTimeLoop:
    loop = VirtualTimeLoop()
    asyncio.set_event_loop(loop)
    return loop


def run(loop: VirtualTimeLoop, coro: Coroutine[Any, Any, T]) -> T:
    return loop.run_until_complete(coro)


def close_loop(loop: VirtualTimeLoop) -> None:
    """Close ``loop`` the way ``asyncio.run`` closes its own: what still runs (the tasks of a crashed process, a tool
    that ignores cancellation) is cancelled and run to its end first, so that no task is dropped unfinished."""
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def check_nothing_lost(loop: VirtualTimeLoop) -> None:
    """Raise ``LostTask`` if asyncio lost a task of this (closed) loop."""
    gc.collect()  # a lost task is reported when it is collected
    if loop.lost:
        raise LostTask("\n".join(loop.lost))
