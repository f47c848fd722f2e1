"""Run a scenario on the virtual clock: timings are exact and a scenario of seconds runs in milliseconds."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from switchboard.runtime.events import Event
from switchboard.runtime.speech import SpeechHandle

from ..sim.vloop import new_loop
from ..unit.harness import Harness


def on_virtual_clock(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """Run the async ``test`` on a fresh virtual-time loop; fail on a leaked task or a forced cancel."""

    @functools.wraps(test)
    def run() -> None:
        loop = new_loop()
        forced = SpeechHandle.forced_cancels
        try:
            loop.run_until_complete(_checked(test))
        finally:
            loop.close()
            asyncio.set_event_loop(None)
        assert SpeechHandle.forced_cancels == forced, "the forced-interrupt safety net fired"

    return run


async def _checked(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    before = set(asyncio.all_tasks())
    await test()
    me = asyncio.current_task()
    for _ in range(50):
        leaked = [t for t in asyncio.all_tasks() - before if t is not me and not t.done()]
        if not leaked:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"leaked tasks: {[t.get_name() for t in leaked]}")


class Timeline:
    """When (on the loop's clock) each event of a harness's session was published."""

    def __init__(self, h: Harness) -> None:
        self.at: list[tuple[float, Event]] = []
        loop = asyncio.get_running_loop()
        publish = h.events.publish

        def recording(event: Event) -> Any:
            self.at.append((loop.time(), event))
            return publish(event)

        h.events.publish = recording  # type: ignore[method-assign]

    def time_of(self, type: str, pred: Callable[[Event], bool] = lambda e: True) -> float:
        return next(t for t, e in self.at if e.type == type and pred(e))

    def states(self) -> list[str]:
        return [e.data["state"] for _, e in self.at if e.type == "agent.state"]
