"""How the tests wait for a state: poll a condition until it holds, under one generous ceiling.

A test waits for what it needs (an event, a status, a server answering), never for a fixed time, and the ceiling is
there only to end a test that would otherwise hang: it is not a claim about speed, so it is the same everywhere and
large enough for a machine running the suite on several workers beside other work. A wait that asserts promptness
(an interruption answered within milliseconds, I3) states its own bound where it asserts it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

WAIT_S = 60.0  # the ceiling of every wait for a state (30 s was passed at load 10 on 2 cores)


async def until(check: Callable[[], Any], timeout: float = WAIT_S, every_s: float = 0.01) -> Any:
    """The first truthy value of ``check()`` (a function or a coroutine function), polled every ``every_s``."""
    async with asyncio.timeout(timeout):
        while True:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await asyncio.sleep(every_s)


def wait_until(check: Callable[[], Any], timeout: float = WAIT_S, every_s: float = 0.02) -> Any:
    """``until`` for code without an event loop."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:g} s: {check!r}")
        time.sleep(every_s)
    return value
