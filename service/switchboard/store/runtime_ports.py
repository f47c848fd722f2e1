"""The runtime's ports (``ChatStore``, ``EventSink``) on the store's group-commit writer.

One of each per live session incarnation on a fenced node: each write it queues carries the epoch the incarnation was
created or adopted at (its fencing token, ``writes.Op.epoch``), so nothing it still has under way can land once the
node lost the session, even if the node has taken it back since.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from ..runtime.events import Event
from ..runtime.ports import ChatStore, Commit, EventSink
from .writer import GroupCommitWriter
from .writes import DurableCallback, Op


def _retrieve(fut: asyncio.Future[None]) -> None:
    # The writer logs failed writes; an event nobody awaited must not also log "exception never retrieved".
    if not fut.cancelled():
        fut.exception()


class StoreChatStore(ChatStore):
    """The ``ChatStore`` port: each commit is one transaction (shared with others queued at the same time)."""

    def __init__(self, writer: GroupCommitWriter, epoch: int | None = None) -> None:
        self._writer = writer
        self._epoch = epoch

    async def commit(self, session_id: str, commit: Commit) -> None:
        if not (
            commit.items
            or commit.tool_calls
            or commit.speeches
            or commit.session is not None
            or commit.receipts
            or commit.pending
        ):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writer.submit(Op(session_id, fut, commit=commit, epoch=self._epoch))
        await asyncio.shield(fut)  # a cancelled caller does not cancel the write


class StoreEventSink(EventSink):
    """The ``EventSink`` port: ``publish`` queues at once (call order is write order); the awaitable resolves
    after the event is committed and ``on_durable`` has been called with it."""

    def __init__(self, writer: GroupCommitWriter, on_durable: DurableCallback | None, epoch: int | None = None) -> None:
        self._writer = writer
        self._on_durable = on_durable
        self._epoch = epoch

    def publish(self, event: Event) -> Awaitable[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieve)
        self._writer.submit(Op(event.session_id, fut, event=event, on_durable=self._on_durable, epoch=self._epoch))
        return fut
