"""In-memory implementations of the ports, for tests and for running a session without a database."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable

from .chat import ChatItem, order_items
from .events import Event, done_future
from .pending import PendingCommand, split_marks
from .ports import ChatStore, Commit, EventSink, SessionState
from .speech import SpeechInfo
from .tools import ToolCallInfo

OUTAGE_RETRY_S = 0.01


class MemoryStore(ChatStore):
    """Keeps every commit in dictionaries.

    ``fail_next`` simulates an outage of N write attempts. Like the real store, this store rides it out itself
    (the port makes the store the only one that retries): the commit waits, then lands once, in order.
    """

    def __init__(self) -> None:
        self.items: dict[str, list[ChatItem]] = defaultdict(list)
        self.tool_calls: dict[str, dict[str, ToolCallInfo]] = defaultdict(dict)
        self.speeches: dict[str, dict[str, SpeechInfo]] = defaultdict(dict)
        self.sessions: dict[str, SessionState] = {}
        self.pending: dict[str, dict[str, PendingCommand]] = defaultdict(dict)  # scheduled commands, coaching notes
        self.commits: list[tuple[str, Commit]] = []
        self.fail_next = 0
        self.retries = 0  # attempts that failed during a simulated outage
        self._turns: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def commit(self, session_id: str, commit: Commit) -> None:
        # overlapping commits land in call order (the port's promise): taken in turn, first come first served
        async with self._turns[session_id]:
            await self.write(session_id, commit)

    async def write(self, session_id: str, commit: Commit) -> None:
        """Land one commit, in its session's turn (a store for a test delays or rejects writes here)."""
        await asyncio.sleep(0)  # a real store yields; so does this one
        while self.fail_next > 0:
            self.fail_next -= 1
            self.retries += 1
            await asyncio.sleep(OUTAGE_RETRY_S)
        self.commits.append((session_id, commit))
        known = {it.id for it in self.items[session_id]}
        self.items[session_id].extend(it for it in commit.items if it.id not in known)
        for tc in commit.tool_calls:
            self.tool_calls[session_id][tc.call_id] = tc
        for sp in commit.speeches:
            self.speeches[session_id][sp.id] = sp
        if commit.session is not None:
            self.sessions[session_id] = commit.session
        marks, _ = split_marks(commit.receipts)
        for cmd in [*commit.pending, *marks]:
            self.pending[session_id][cmd.id] = cmd
        for receipt in commit.receipts:
            receipt.mark_landed()

    def chat(self, session_id: str) -> list[ChatItem]:
        return order_items(self.items[session_id])


class MemoryEventLog(EventSink):
    """Keeps events per session and fans them out to subscribers (unbounded queues)."""

    def __init__(self) -> None:
        self.events: dict[str, list[Event]] = defaultdict(list)
        self._subscribers: dict[str, list[asyncio.Queue[Event]]] = defaultdict(list)

    def publish(self, event: Event) -> Awaitable[None]:
        log = self.events[event.session_id]
        if log and event.seq != log[-1].seq + 1:
            raise AssertionError(f"seq gap: {log[-1].seq} -> {event.seq}")
        log.append(event)
        for q in self._subscribers[event.session_id]:
            q.put_nowait(event)
        return done_future()

    def types(self, session_id: str) -> list[str]:
        return [e.type for e in self.events[session_id]]

    def of_type(self, session_id: str, type: str) -> list[Event]:
        return [e for e in self.events[session_id] if e.type == type]

    async def subscribe(self, session_id: str, since: int = 0) -> AsyncIterator[Event]:
        q: asyncio.Queue[Event] = asyncio.Queue()
        backlog = [e for e in self.events[session_id] if e.seq > since]
        self._subscribers[session_id].append(q)
        try:
            last = since
            for e in backlog:
                last = e.seq
                yield e
            while True:
                e = await q.get()
                if e.seq > last:
                    last = e.seq
                    yield e
        finally:
            self._subscribers[session_id].remove(q)
