"""The process that ``test_crash_recovery`` kills: one session, wired to a real store through a ``SessionHost``,
runs a scripted reply through one completed tool call and into a long one, then prints ``MARKER`` and waits for
SIGKILL.

    python tests/store/crash_child.py DATABASE_URL SCHEMA SESSION_ID       (SCHEMA: "" on SQLite)
    python tests/store/crash_child.py DATABASE_URL SCHEMA SESSION_ID lose-events

With ``lose-events`` the events from the first tool output's ``chat.item`` on are never written (the process "dies"
between the commit of the call's end and its events) and ``EVENTS_LOST`` is printed at that moment instead.

The test imports ``AGENTS`` and ``session_config`` from here, so both processes run the same agent and script.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

from switchboard import Agent, RunContext, function_tool
from switchboard.control.host import SessionHost
from switchboard.control.hub import EventHub
from switchboard.control.session_config import PlayoutSettings, SessionConfig
from switchboard.control.settings import Settings
from switchboard.runtime.agent import AgentRegistry
from switchboard.runtime.events import Event, EventSink
from switchboard.store import Store

MARKER = "LONG TOOL STARTED"
EVENTS_LOST = "EVENTS LOST"


class Crasher(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You book rooms.")

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something at once."""
        return f"booked {what}"

    @function_tool
    async def slow(self, ctx: RunContext, seconds: float) -> str:
        """Work for a long time."""
        # the executor committed this call as `running` before starting its body: the crash finds it in flight
        print(MARKER, flush=True)
        await asyncio.sleep(seconds)
        return "slow done"


AGENTS = {"crasher": Crasher}


def session_config(sid: str) -> SessionConfig:
    turns = [
        {"text": "Booking.", "tool_calls": [{"name": "book", "arguments": {"what": "room 12"}}]},
        {"text": "Booked. Now the long one.", "tool_calls": [{"name": "slow", "arguments": {"seconds": 600}}]},
        {"text": "Before the crash you had {{tool_output:book}}"},  # the first turn after the restart
    ]
    return SessionConfig(
        id=sid,
        agent="crasher",
        llm={"provider": "scripted", "turns": turns, "fallback": {"text": "fallback turn"}},
        playout=PlayoutSettings(words_per_second=500),
    )


def build_host(
    store: Store,
    on_event: Callable[[Event], None] | None = None,
    wrap_sink: Callable[[EventSink], EventSink] | None = None,
) -> SessionHost:
    # a stop lets go at once of the tools still running (they never end) instead of granting the uncancellable 10 s
    settings = Settings(database_url="sqlite+aiosqlite://", words_per_second=500, shutdown_tool_grace_s=0)
    registry = AgentRegistry(AGENTS)
    return SessionHost(
        store=store, registry=registry, hub=EventHub(), settings=settings, on_event=on_event, wrap_sink=wrap_sink
    )


class LosingSink:
    """An event sink that stops writing at the first tool output's ``chat.item``: what a crash right after the commit
    of a call's end leaves (its output and its end durable, their events lost)."""

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self.lost = False

    def publish(self, event: Event) -> Awaitable[None]:
        ended = event.type == "chat.item" and event.data["item"]["type"] == "function_call_output"
        if ended and not self.lost:
            self.lost = True
            print(EVENTS_LOST, flush=True)
        if self.lost:
            return asyncio.get_running_loop().create_future()  # never written, never resolved
        return self._sink.publish(event)


async def main(url: str, schema: str, sid: str, mode: str = "") -> None:
    store = Store.from_url(url, schema=schema or None)
    await store.migrate()
    await store.start()
    host = build_host(store, wrap_sink=LosingSink if mode == "lose-events" else None)
    await host.create(session_config(sid), {})
    await host.sessions[sid].input("Book room 12, then do the long thing.")
    await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
