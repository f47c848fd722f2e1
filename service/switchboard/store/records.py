"""Records the store reads and writes besides the runtime's own types, and its exceptions."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from ..runtime.chat import ChatItem
from ..runtime.events import Event
from ..runtime.pending import PendingCommand
from ..runtime.ports import Reported, Takeover
from ..runtime.speech import SpeechInfo
from ..runtime.status import SessionStatus
from ..runtime.tools import ToolCallInfo


def now_utc() -> datetime:
    return datetime.now(UTC)


class SessionRecord(BaseModel):
    """A session row. ``config`` is the create body (llm, playout, options...); the runtime owns
    ``agent``/``state``/``llm_state``/``current_speech_id`` and updates them through ``Commit.session``."""

    id: str
    agent: str
    state: SessionStatus = SessionStatus.INITIALIZING
    config: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    llm_state: dict[str, Any] | None = None
    current_speech_id: str | None = None
    entered: bool = True  # its agent's on_enter has run (false: owed to whoever runs the session next)
    takeover: Takeover | None = None  # the operator who holds it (``runtime.takeover``), None when none does
    created_at: datetime = Field(default_factory=now_utc)
    updated_at: datetime = Field(default_factory=now_utc)
    owner_node: str | None = None  # the node running it (``ownership``), None when no node has claimed it
    owner_epoch: int = 0


class IdempotencyState(StrEnum):
    PENDING = "pending"  # reserved: its holder runs the command (or did, and died before its effect)
    DONE = "done"  # the command's answer, committed with its effect


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds an idempotency reservation: a node, in one process incarnation (``nodes.incarnation``)."""

    node: str
    incarnation: str


class IdempotencyRecord(BaseModel):
    """One operator command sent with an ``Idempotency-Key`` (I7): its reservation, then its remembered answer."""

    key: str
    scope: str  # e.g. "POST /v1/sessions/s1/input"
    request_hash: str
    status_code: int
    response_body: Any = None
    created_at: datetime = Field(default_factory=now_utc)
    state: IdempotencyState = IdempotencyState.DONE
    holder_node: str | None = None
    holder_incarnation: str | None = None

    def held_by(self, holder: Holder) -> bool:
        return (self.holder_node, self.holder_incarnation) == (holder.node, holder.incarnation)


@dataclass(frozen=True, slots=True)
class Claim:
    """What ``reserve`` found for a key: ``held`` (the caller holds the reservation now and runs the command;
    ``taken_from``: it took it over from that dead holder), or the key's ``record`` (done: replay it; pending: a live
    holder runs the command; another request hash: the key was used for another request)."""

    held: bool
    record: IdempotencyRecord | None = None
    taken_from: Holder | None = None


@dataclass(slots=True)
class SessionData:
    """What recovery reads of one session (``Store.load_sessions_bulk``)."""

    items: list[ChatItem] = field(default_factory=list)  # ordered, as ``Store.chat_items`` returns them
    tool_calls: list[ToolCallInfo] = field(default_factory=list)
    speeches: list[SpeechInfo] = field(default_factory=list)
    pending: list[PendingCommand] = field(default_factory=list)  # scheduled commands and notes not yet applied
    last_seq: int = 0
    reported: Reported = field(default_factory=Reported)  # what its durable event log reports
    recent: list[Event] = field(default_factory=list)  # its latest events of the kinds asked for, oldest first


@dataclass(frozen=True, slots=True)
class ReadError:
    """A stored row that could not be turned back into its type; it was skipped."""

    table: str
    session_id: str | None
    key: str  # the row's key within its table (pos, call_id, seq, ...)
    error: str


class StoreError(Exception):
    pass


class SessionExists(StoreError):
    """``create_session`` with an id that is already taken."""


class QuotaFull(StoreError):
    """``create_session`` for an owner that already has as many live sessions as its quota allows."""


class StoreClosed(StoreError):
    """The store was closed (or closed before this write could be made durable)."""


class ReceiptRefused(StoreError):
    """A commit carried the completion of an idempotency reservation its holder no longer holds (another request
    took the key over, its holder being presumed dead): nothing of the commit was written."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the reservation of idempotency key {key!r} is no longer held by this process")
        self.key = key


class SessionFenced(StoreError):
    """A write of a session this node no longer owns: another node took it over (its epoch moved on), or this node
    let go of it. Nothing of the write landed, and no later write of this node for the session will."""

    def __init__(self, session_id: str, detail: str) -> None:
        super().__init__(f"session {session_id}: {detail}")
        self.session_id = session_id
        self.detail = detail
