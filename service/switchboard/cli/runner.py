"""Running the service's event loop to a bounded end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger("switchboard.cli")

# once the server has stopped, how long the tasks still running get to end after they are cancelled
EXIT_GRACE_S = 5.0


def run_bounded(
    main: Coroutine[Any, Any, T],
    *,
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    grace_s: float = EXIT_GRACE_S,
    what: str = "the server",
) -> T:
    """``asyncio.run``, with a bounded end: what still runs once ``main`` has returned is cancelled and gets
    ``grace_s`` to end. ``asyncio.run`` waits for it however long it takes, and a tool body abandoned at shutdown
    because it ignores cancellation may never end: the process would never exit. Such a task is named in the log and
    left behind with the process."""
    loop = loop_factory() if loop_factory is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_remaining(loop, grace_s, what)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_remaining(loop: asyncio.AbstractEventLoop, grace_s: float, what: str) -> None:
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not pending:
        return
    for task in pending:
        task.cancel()
    _, stuck = loop.run_until_complete(asyncio.wait(pending, timeout=grace_s))
    for task in pending:
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler(
                {"message": "unhandled exception during shutdown", "exception": task.exception(), "task": task}
            )
    if stuck:
        logger.error(
            "%d task(s) ignore cancellation %.0f s after %s stopped; exiting without them: %s",
            len(stuck),
            grace_s,
            what,
            ", ".join(sorted(task.get_name() for task in stuck)),
        )
