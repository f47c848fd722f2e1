"""The service's event loop ends within its bounds, even when a task ignores cancellation."""

from __future__ import annotations

import asyncio
import time

from switchboard.cli.runner import run_bounded
from tests.lost_tasks import lost_tasks


def test_what_still_runs_when_the_server_stops_is_cancelled_and_awaited() -> None:
    cleaned: list[str] = []

    async def worker() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.01)  # its cleanup runs to its end
            cleaned.append("worker")

    async def main() -> str:
        asyncio.get_running_loop().create_task(worker())
        await asyncio.sleep(0)
        return "served"

    assert run_bounded(main(), grace_s=5.0) == "served"
    assert cleaned == ["worker"]


def test_a_task_that_ignores_cancellation_is_named_and_left_behind_not_waited_for(caplog) -> None:
    async def deaf() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    left: list[asyncio.Task[None]] = []

    async def main() -> None:
        left.append(asyncio.get_running_loop().create_task(deaf(), name="tool-body:deaf"))
        await asyncio.sleep(0)

    started = time.monotonic()
    run_bounded(main(), grace_s=0.2)
    assert time.monotonic() - started < 2.0
    assert "exiting without them: tool-body:deaf" in caplog.text
    left.clear()
    assert any("destroyed but it is pending" in report for report in lost_tasks())  # left on purpose
