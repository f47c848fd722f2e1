"""^C ends a command that runs until stopped (`switchboard tail`) within a bound, with exit status 130, even when
what it runs swallows its cancellation: under load a stream's own timeout once turned the cancellation into a
reconnect, and `tail` went on after ^C."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from switchboard.cli.operator import STOP_GRACE_S, until_signalled


async def _stubborn(started: asyncio.Event) -> int:
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass  # swallowed, as by a stream that takes it for a lost connection and reconnects
    await asyncio.sleep(3600)  # the next cancellation ends it
    return 0


async def test_sigint_ends_the_command_with_130_even_if_its_work_swallows_the_cancellation() -> None:
    started = asyncio.Event()
    work = _stubborn(started)
    running = asyncio.create_task(until_signalled(work))
    await started.wait()
    sent = time.monotonic()
    os.kill(os.getpid(), signal.SIGINT)
    assert await running == 130
    assert time.monotonic() - sent < STOP_GRACE_S + 5  # bound: the grace, then the command ends without its work
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is taken away again
    leftover = [t for t in asyncio.all_tasks() if t.get_coro() is work]
    for task in leftover:  # what the command left behind (the process would exit without it)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_work_that_ends_gives_its_own_status() -> None:
    async def done() -> int:
        return 3

    assert await until_signalled(done()) == 3
