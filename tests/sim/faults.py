"""A store and an event sink with injected faults, holding only what is durable.

Faults, each chosen by the schedule: an outage (every write waits until it ends: the store retries), a permanent
error on a chosen write (the next write raises an error the store will never accept, as PostgreSQL does for a NUL in
a text column), slow commits (each write takes a while of virtual time), and a crash: from that instant nothing more
becomes durable, and every write still in flight or made afterwards by the dead process hangs forever (the process
is gone; its tasks are simply never run again).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field

from switchboard.runtime.chat import ChatItem, order_items
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit, SessionState
from switchboard.runtime.speech import SpeechInfo
from switchboard.runtime.tools import ToolCallInfo


class PermanentStoreError(Exception):
    """A write the store rejects for good (a constraint, a value it cannot hold)."""


@dataclass
class Durable:
    """Everything one session has made durable."""

    items: dict[str, ChatItem] = field(default_factory=dict)
    tool_calls: dict[str, ToolCallInfo] = field(default_factory=dict)
    speeches: dict[str, SpeechInfo] = field(default_factory=dict)
    session: SessionState | None = None
    events: list[Event] = field(default_factory=list)

    def chat(self) -> list[ChatItem]:
        return order_items(self.items.values())

    @property
    def last_seq(self) -> int:
        return self.events[-1].seq if self.events else 0


class FaultyStore:
    """Implements both ports (``ChatStore`` and ``EventSink``) for one process lifetime (``generation``)."""

    def __init__(self, durable: dict[str, Durable], *, generation: int) -> None:
        self.durable = durable
        self.generation = generation
        self.crashed = False
        self.outage_until = -1.0
        self.poison_next = 0
        self.commit_delay_s = 0.0
        self.event_delay_s = 0.0
        self.writes = 0
        self.permanent_errors = 0
        self.published: list[Event] = []  # every event handed to the sink, in call order
        self._event_tail: asyncio.Future[None] | None = None
        self._writers: set[asyncio.Task[None]] = set()
        self._turns: dict[str, asyncio.Lock] = {}

    def _session(self, sid: str) -> Durable:
        return self.durable.setdefault(sid, Durable())

    async def _hang(self) -> None:
        await asyncio.get_running_loop().create_future()  # a dead process never returns from a write

    # -- ChatStore ----------------------------------------------------------------------------------------------

    async def commit(self, session_id: str, commit: Commit) -> None:
        # a session's commits may overlap (it pipelines them); they land in call order, as the port promises
        async with self._turns.setdefault(session_id, asyncio.Lock()):
            await self._commit(session_id, commit)

    async def _commit(self, session_id: str, commit: Commit) -> None:
        loop = asyncio.get_running_loop()
        if self.crashed:
            await self._hang()
        await asyncio.sleep(self.commit_delay_s)
        if self.crashed:
            await self._hang()
        while loop.time() < self.outage_until and not self.crashed:  # the store retries until the database is back
            await asyncio.sleep(self.outage_until - loop.time())
        if self.crashed:
            await self._hang()
        self.writes += 1
        if self.poison_next > 0:
            self.poison_next -= 1
            self.permanent_errors += 1
            raise PermanentStoreError("the store rejected this write (simulated)")
        d = self._session(session_id)
        for item in commit.items:
            d.items.setdefault(item.id, item)
        for info in commit.tool_calls:
            d.tool_calls[info.call_id] = info
        for sp in commit.speeches:
            d.speeches[sp.id] = sp
        if commit.session is not None:
            d.session = commit.session

    async def flush(self) -> None:
        """What a graceful shutdown does last: every event accepted so far becomes durable."""
        if self._event_tail is not None:
            await asyncio.shield(self._event_tail)

    # -- EventSink ----------------------------------------------------------------------------------------------

    def publish(self, event: Event) -> Awaitable[None]:
        """Events become durable in order, one after the other (like a group commit); a crash loses the rest."""
        self.published.append(event)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        previous = self._event_tail
        self._event_tail = done

        async def write() -> None:
            if previous is not None:
                await asyncio.shield(previous)
            await asyncio.sleep(self.event_delay_s)
            while loop.time() < self.outage_until and not self.crashed:  # the writer retries until the store is back
                await asyncio.sleep(self.outage_until - loop.time())
            if self.crashed:
                await self._hang()
            self._session(event.session_id).events.append(event)
            if not done.done():
                done.set_result(None)

        task = loop.create_task(write(), name=f"event-write:{event.seq}")
        self._writers.add(task)
        task.add_done_callback(self._writers.discard)
        return done
