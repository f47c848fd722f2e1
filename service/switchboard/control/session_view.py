"""SessionView: one session as this process knows it, for the API's reads."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.chat import ChatItem
from ..runtime.session import AgentSession
from ..runtime.speech import SpeechInfo
from ..runtime.status import SessionStatus
from ..runtime.tools import ToolCallInfo, ToolStatus
from ..store import SessionRecord, Store
from . import tool_pages


@dataclass(frozen=True, slots=True)
class SessionView:
    """One session as this process knows it: its stored record, and the live session when this process runs it.

    Reads answer from the live session when there is one, else from the store.
    """

    record: SessionRecord
    live: AgentSession | None
    store: Store

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def state(self) -> str:
        return self.live.state if self.live is not None else self.record.state

    @property
    def ended(self) -> bool:
        """Closed or failed for good: its last event is durable and nothing follows it."""
        return self.live is None and SessionStatus(self.record.state).ended

    async def chat(self) -> list[ChatItem]:
        if self.live is not None:
            return self.live.chat.items
        return await self.store.chat_items(self.id)

    async def chat_page(self, cursor: str | None, limit: int) -> tuple[list[ChatItem], bool]:
        """The ``limit`` chat items after the item ``cursor`` (None: from the start) and whether more follow; from
        the store, only those items are read. Raises ``KeyError`` when ``cursor`` is not an item of this chat."""
        if self.live is None:
            return await self.store.chat_page(self.id, cursor, limit)
        items = self.live.chat.items
        start = 0
        if cursor is not None:
            start = next((i + 1 for i, item in enumerate(items) if item.id == cursor), -1)
            if start < 0:
                raise KeyError(cursor)
        return items[start : start + limit], start + limit < len(items)

    async def speech(self, speech_id: str) -> SpeechInfo | None:
        handle = self.live.speech(speech_id) if self.live is not None else None
        if handle is not None:
            return handle.info().model_copy(update={"heard_text": handle.heard_text})
        return await self.store.speech(self.id, speech_id)

    async def tool_calls(self, status: ToolStatus | None = None) -> list[ToolCallInfo]:
        """The session's tool calls, by start time (then id)."""
        if self.live is None:
            infos = await self.store.tool_calls(self.id, status)
        else:
            infos = self.live.tool_calls(status)
            if not self.live.remembers_every_tool_call:  # older ended calls are only in the store now
                known = {i.call_id for i in infos}
                infos += [i for i in await self.store.tool_calls(self.id, status) if i.call_id not in known]
        return sorted(infos, key=lambda i: i.order_key)

    async def tool_call_page(
        self, status: ToolStatus | None, cursor: str | None, limit: int
    ) -> tuple[list[ToolCallInfo], bool]:
        """The ``limit`` tool calls (by start time) after the call ``cursor`` (None: from the start) and whether more
        follow; from the store, only those calls are read. Raises ``KeyError`` when ``cursor`` is not a call of this
        session."""
        return await tool_pages.session_page(self.id, self.live, self.store, status, cursor, limit)

    async def tool_call(self, call_id: str) -> ToolCallInfo | None:
        info = self.live.tool_call(call_id) if self.live is not None else None
        return info if info is not None else await self.store.tool_call(self.id, call_id)
