"""Ports: what the runtime needs from persistence. The store implements them; tests use the in-memory ones."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from pydantic import BaseModel, Field

from .chat import ChatItem
from .events import Event
from .speech import SpeechInfo
from .tools import ToolCallInfo


class SessionState(BaseModel):
    """The runtime-owned part of a session's persisted state."""

    agent: str
    state: str = "active"
    llm_state: dict[str, Any] | None = None
    current_speech_id: str | None = None


class StoreUnavailable(Exception):
    """The store cannot write right now (its database is unreachable, say): the same write may be retried."""


class Commit(BaseModel):
    """One unit of work for the store: everything in it is written in a single transaction."""

    items: list[ChatItem] = Field(default_factory=list)
    tool_calls: list[ToolCallInfo] = Field(default_factory=list)
    speeches: list[SpeechInfo] = Field(default_factory=list)
    session: SessionState | None = None


class ChatStore(Protocol):
    async def commit(self, session_id: str, commit: Commit) -> None:
        """Write ``commit`` atomically. Appending items costs O(1) whatever the context size."""
        ...


class EventSink(Protocol):
    def publish(self, event: Event) -> Awaitable[None]:
        """Accept ``event`` now, in call order; the awaitable resolves once it is durable and delivered.

        Events of one session arrive with strictly increasing ``seq``; the sink must keep that order.
        """
        ...
