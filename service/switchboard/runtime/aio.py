"""Small asyncio helpers shared by the runtime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger("switchboard.runtime")


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel the given tasks and wait until they are finished, whatever they raise.

    If the caller itself is cancelled while waiting, the tasks are still cancelled and the CancelledError propagates.
    """
    pending = [t for t in tasks if t is not None and not t.done()]
    for t in pending:
        t.cancel()
    if not pending:
        return
    await asyncio.wait(pending)
    for t in pending:
        if not t.cancelled():
            with contextlib.suppress(BaseException):
                t.exception()


async def run_to_end(aw: Awaitable[T]) -> T:
    """Await ``aw`` in a task that the caller's cancellation does not cut short.

    A cancelled caller still waits for the task to end (further cancellations meanwhile are absorbed), then raises
    CancelledError; what the task raised or returned is dropped. For work that must not stop halfway (a database
    transaction: a driver cut off mid-statement may keep its locks).
    """
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([task])
        if not task.cancelled():
            with contextlib.suppress(BaseException):
                task.exception()
        raise


def resolve(fut: asyncio.Future[T], value: T) -> None:
    if not fut.done():
        fut.set_result(value)


async def first_of(aw: Awaitable[T], *stops: asyncio.Future[Any]) -> tuple[bool, T | None]:
    """Wait for ``aw`` or any of ``stops``, whichever resolves first.

    Returns ``(True, result)`` when ``aw`` finished first, ``(False, None)`` when a stop future resolved first.
    A coroutine is run as a task and cancelled if a stop wins; a future passed in is never cancelled (waiting
    through ``asyncio.wait`` does not cancel what it waits on).
    """
    owned = asyncio.iscoroutine(aw)
    fut: asyncio.Future[T] = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({fut, *stops}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        if owned:
            fut.cancel()
        raise
    if fut.done():
        return True, fut.result()
    if owned:
        await cancel_and_wait(fut)
    return False, None


def forget_when_done(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    """A done callback that drops a task from ``tasks`` and retrieves its outcome: whoever awaited it may have been
    cut off, and the outcome is logged where it arose."""

    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here too: a caller that was cut off never will

    return done


def spawn(coro: Coroutine[Any, Any, T], *, name: str, tasks: set[asyncio.Task[Any]]) -> asyncio.Task[T]:
    """Create a task that is tracked in ``tasks`` and logs (rather than hides) an unexpected exception."""
    task = asyncio.create_task(coro, name=name)
    tasks.add(task)

    def _done(t: asyncio.Task[Any]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            logger.error("task %s failed", t.get_name(), exc_info=t.exception())

    task.add_done_callback(_done)
    return task
