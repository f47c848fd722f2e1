"""Ports: what the runtime needs from persistence. The store implements them; tests use the in-memory ones.

Who retries: a ``ChatStore`` owns retrying while its database is unavailable. ``commit`` returns once the commit
is durable, however long an outage lasts (until the store is closed), and raises only errors that are permanent for
that commit. Callers never retry a commit: they cannot know whether a failed attempt landed, and the store keeps a
session's writes in order only while it is the one retrying them. The ``EventSink`` does the same for events.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel, Field

from .chat import ChatItem
from .events import EventSink
from .speech import SpeechInfo
from .status import SessionStatus
from .tools import ToolCallInfo


class SessionState(BaseModel):
    """The runtime-owned part of a session's persisted state."""

    agent: str
    state: SessionStatus = SessionStatus.ACTIVE
    llm_state: dict[str, Any] | None = None
    current_speech_id: str | None = None


class Commit(BaseModel):
    """One unit of work for the store: everything in it is written in a single transaction."""

    items: list[ChatItem] = Field(default_factory=list)
    tool_calls: list[ToolCallInfo] = Field(default_factory=list)
    speeches: list[SpeechInfo] = Field(default_factory=list)
    session: SessionState | None = None


class ChatStore(Protocol):
    async def commit(self, session_id: str, commit: Commit) -> None:
        """Write ``commit`` atomically and return once it is durable. Appending items costs O(1) whatever the
        context size.

        While the store is unavailable it retries on its own (with backoff, in order with the session's other
        writes); an error it raises is permanent for this commit and must not be retried by the caller.
        """
        ...


__all__ = ["ChatStore", "Commit", "EventSink", "SessionState"]
