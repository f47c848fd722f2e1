"""Ports: what the runtime needs from persistence. The store implements them; tests use the in-memory ones.

Who retries: a ``ChatStore`` owns retrying while its database is unavailable. ``commit`` returns once the commit
is durable, however long an outage lasts (until the store is closed), and raises only errors that are permanent for
that commit. Callers never retry a commit: they cannot know whether a failed attempt landed, and the store keeps a
session's writes in order only while it is the one retrying them. The ``EventSink`` does the same for events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatItem
from .events import Event, EventSink
from .pending import PendingCommand
from .receipt import Completion, Receipt, completions
from .speech import SpeechInfo
from .status import SessionStatus
from .tools import ToolCallInfo


class Takeover(BaseModel):
    """Who holds a session (an operator's takeover, ``runtime.takeover``) and since when."""

    model_config = ConfigDict(frozen=True)

    operator: str = Field(description="Who holds it: the audit trail's name of the caller that took it over.")
    since: datetime = Field(description="When they took it over.")
    displaced: str | None = Field(default=None, description="The operator a forced takeover displaced.")


class SessionState(BaseModel):
    """The runtime-owned part of a session's persisted state."""

    agent: str
    entered: bool = True  # the agent's on_enter has run (false: owed to whoever runs the session next)
    state: SessionStatus = SessionStatus.ACTIVE
    llm_state: dict[str, Any] | None = None
    current_speech_id: str | None = None
    takeover: Takeover | None = None  # an operator holds it: no reply of the model plays until it is handed back


class Commit(BaseModel):
    """One unit of work for the store: everything in it is written in a single transaction, the idempotency
    ``receipts`` of the commands whose effect it is included (see ``Completion``)."""

    items: list[ChatItem] = Field(default_factory=list)
    tool_calls: list[ToolCallInfo] = Field(default_factory=list)
    speeches: list[SpeechInfo] = Field(default_factory=list)
    session: SessionState | None = None
    receipts: list[Completion] = Field(default_factory=list)
    pending: list[PendingCommand] = Field(default_factory=list)  # scheduled commands and coaching notes (full records)


@dataclass(slots=True)
class Reported:
    """What a session's durable event log already reports: the chat items with a ``chat.item`` event (and the input
    with a ``user.input`` event), the calls with a ``tool.ended`` event, the speeches with a ``speech.created`` and a
    ``speech.done`` event. A commit and its events are separate writes,
    so a crash between them leaves durable changes unreported; recovery emits what is missing (nothing durable
    without its event)."""

    items: set[str] = field(default_factory=set)
    ended_calls: set[str] = field(default_factory=set)
    done_speeches: set[str] = field(default_factory=set)
    inputs: set[str] = field(default_factory=set)  # chat items with a ``user.input`` event
    created_speeches: set[str] = field(default_factory=set)
    # the operators' holds with a ``session.taken_over`` and with a ``session.handed_back`` event ("<since> <operator>")
    taken_over: set[str] = field(default_factory=set)
    handed_back: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)  # scheduled commands and notes with their accepting event

    def add(self, event_type: str, key: str) -> None:
        """Note one event: ``key`` is its item id, call id or speech id."""
        getattr(self, _REPORTED_IN[event_type]).add(key)

    def add_all(self, event_type: str, keys: Iterable[str]) -> None:
        """Note the events of one type: ``keys`` are what they report (see ``add``)."""
        getattr(self, _REPORTED_IN[event_type]).update(keys)

    def open_holds(self) -> set[str]:
        """The holds the log reports taken and not handed back."""
        return self.taken_over - self.handed_back

    @classmethod
    def of(cls, events: Iterable[Event]) -> Reported:
        """From events in memory (a store that keeps them as objects)."""
        reported = cls()
        for event in events:
            subject = reported_subject(event)
            if subject is not None:
                reported.add(event.type, subject)
        return reported


# Where a ``Reported`` notes each kind of event it tracks.
_REPORTED_IN = {
    "chat.item": "items",
    "tool.ended": "ended_calls",
    "speech.done": "done_speeches",
    "user.input": "inputs",
    "speech.created": "created_speeches",
    "session.taken_over": "taken_over",
    "session.handed_back": "handed_back",
    "scheduled.created": "pending",
    "session.coached": "pending",
}


def reported_subject(event: Event) -> str | None:
    """What ``event`` reports, if it is one a ``Reported`` tracks: a ``chat.item``'s item id, a ``tool.ended``'s
    call id, a ``speech.done``'s speech id."""
    if event.type in HOLD_EVENTS:
        return hold_subject(event.data.get("since"), event.data.get("operator"))
    path = REPORTED_KEYS.get(event.type)
    if path is None:
        return None
    value = event.data.get(path[0])
    if path[1] is not None:
        value = value.get(path[1]) if isinstance(value, dict) else None
    return value if isinstance(value, str) else None


# The event types a ``Reported`` tracks, and where their key is in the event's data (a field, or a field of one).
REPORTED_KEYS: dict[str, tuple[str, str | None]] = {
    "chat.item": ("item", "id"),
    "tool.ended": ("call_id", None),
    "speech.done": ("speech_id", None),
    "user.input": ("item_id", None),
    "speech.created": ("speech_id", None),
    "scheduled.created": ("id", None),
    "session.coached": ("id", None),
}


#: The events of an operator's hold, reported by the hold they concern (``hold_subject``).
HOLD_EVENTS = frozenset({"session.taken_over", "session.handed_back"})


def hold_subject(since: object, operator: object) -> str | None:
    """The key of one hold in the log: its ``since`` as the event carries it (JSON) and its operator."""
    return f"{since} {operator}" if isinstance(since, str) and isinstance(operator, str) else None


class ChatStore(Protocol):
    async def commit(self, session_id: str, commit: Commit) -> None:
        """Write ``commit`` atomically and return once it is durable. Appending items costs O(1) whatever the
        context size.

        While the store is unavailable it retries on its own (with backoff, in order with the session's other
        writes); an error it raises is permanent for this commit and must not be retried by the caller. Once the
        commit is durable each of its ``receipts`` is marked landed.

        A session does not wait for one commit to be durable before making the next (it pipelines them): commits of
        one session become durable in the order of the calls, also when they overlap. The order of a call is when
        it is made: everything before the coroutine's first suspension counts as the call.
        """
        ...


__all__ = [
    "HOLD_EVENTS",
    "REPORTED_KEYS",
    "ChatStore",
    "Commit",
    "Completion",
    "EventSink",
    "Receipt",
    "Reported",
    "SessionState",
    "Takeover",
    "completions",
    "hold_subject",
    "reported_subject",
]
