"""What the service answers, as typed models (the client's own: it imports nothing of the server).

Fields the service adds later are ignored, and a chat item of a type this client does not know is kept as an
:class:`OtherChatItem`, so an older client keeps working against a newer service.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ToolStatus(StrEnum):
    RUNNING = "running"
    CANCELLING = "cancelling"  # cancelled, its tool still running (it ignored the cancellation): not ended
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"
    INTERRUPTED = "interrupted"


class AttentionReason(_Model):
    """Why a session needs an operator (``code``: generation_failed, tool_failed, tool_long_running, ...)."""

    code: str
    message: str
    since: datetime


class ModelSummary(_Model):
    """A model by name: never an endpoint or a credential."""

    provider: str
    model: str | None = None
    profile: str | None = None
    fallbacks: list[str] = Field(default_factory=list)


class Latency(_Model):
    time_to_first_token_ms: float | None = None
    time_to_first_audio_ms: float | None = None


class Takeover(_Model):
    """Who holds a session (an operator's takeover) and since when."""

    operator: str
    since: datetime
    displaced: str | None = None  # the operator a forced takeover displaced
    last_seen_at: datetime | None = None  # the holder's last say or heartbeat


class HandBack(_Model):
    """A hand-back: whose hold it ended, when, by whom, and the agent's reply to an unanswered input (if any)."""

    operator: str
    since: datetime
    until: datetime
    by: str
    speech_id: str | None = None


class Session(_Model):
    id: str
    agent: str
    state: str  # active, closing, closed, failed, ...
    agent_state: str  # initializing, listening, thinking, speaking
    current_speech_id: str | None = None
    created_at: datetime
    metadata: dict[str, Any] = Field(default_factory=dict)
    last_activity_at: datetime | None = None
    attention: list[AttentionReason] = Field(default_factory=list)
    model: ModelSummary | None = None
    latency: Latency = Field(default_factory=Latency)
    takeover: Takeover | None = None  # the operator holding it (None: the agent has it)


class ToolDescription(_Model):
    name: str
    description: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    policy: dict[str, Any] = Field(default_factory=dict)


class AgentInfo(_Model):
    """A registered agent: its tools and the model its sessions use by default."""

    name: str
    description: str | None = None
    tools: list[ToolDescription] = Field(default_factory=list)
    model: ModelSummary | None = None
    error: str | None = None


class AgentList(_Model):
    items: list[AgentInfo]


class AlertDelivery(_Model):
    """One transition of an alert (``opened``, ``cleared``) sent to one sink, and how it went."""

    sink: str
    transition: str
    state: str  # pending, delivered, failed, dropped
    attempts: int = 0
    last_error: str | None = None
    updated_at: datetime | None = None


class Alert(_Model):
    """A session's reason for attention sent to the server's webhook sinks, from when it opened until it cleared."""

    id: str
    session_id: str
    reason: str
    agent: str
    message: str
    since: datetime
    opened_at: datetime
    cleared_at: datetime | None = None
    deliveries: list[AlertDelivery] = Field(default_factory=list)


class AlertList(_Model):
    items: list[Alert]


class SessionList(_Model):
    """One page of sessions. ``missing_nodes``: in cluster mode, the nodes that did not answer an attention list in
    time (the service's ``Switchboard-Missing-Nodes`` header); their sessions are not in ``items``."""

    items: list[Session]
    next_cursor: str | None = None
    missing_nodes: list[str] = Field(default_factory=list)


class ChatMessage(_Model):
    id: str
    type: Literal["message"] = "message"
    created_at: datetime
    role: str
    text: str
    interrupted: bool = False


class FunctionCall(_Model):
    id: str
    type: Literal["function_call"] = "function_call"
    created_at: datetime
    call_id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class FunctionCallOutput(_Model):
    id: str
    type: Literal["function_call_output"] = "function_call_output"
    created_at: datetime
    call_id: str
    name: str
    output: str
    is_error: bool = False


class AgentHandoff(_Model):
    id: str
    type: Literal["agent_handoff"] = "agent_handoff"
    created_at: datetime
    from_agent: str | None = None
    to_agent: str


class OtherChatItem(_Model):
    """A chat item of a type this client does not know; its fields are kept."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: str
    type: str
    created_at: datetime


_CHAT_TYPES = ("message", "function_call", "function_call_output", "agent_handoff")


def _chat_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in _CHAT_TYPES else "other"


ChatItem = Annotated[
    Annotated[ChatMessage, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[AgentHandoff, Tag("agent_handoff")]
    | Annotated[OtherChatItem, Tag("other")],
    Discriminator(_chat_tag),
]


class Chat(_Model):
    items: list[ChatItem]
    next_cursor: str | None = None


class ScheduledCommand(_Model):
    """A command scheduled for a point of the conversation (``when``), or a coaching note (``kind="coach"``)."""

    id: str
    kind: str  # input, say, interrupt, coach
    at: str  # idle, after_speech, after_tool, next_turn
    state: str  # pending, applied, cancelled
    args: dict[str, Any] = Field(default_factory=dict)
    call_id: str | None = None
    speech_id: str | None = None
    created_at: datetime
    ended_at: datetime | None = None
    reason: str | None = None  # cancelled: cancelled_by_operator, session_closed, not_interruptible, failed
    result: dict[str, Any] = Field(default_factory=dict)  # applied: item_id, speech_id, interrupted


class ScheduledList(_Model):
    items: list[ScheduledCommand]


class CoachAccepted(_Model):
    id: str
    state: str


class InputAccepted(_Model):
    item_id: str | None = None  # None for an interim (final=false) input, or a scheduled one: nothing was committed
    speech_id: str | None = None  # None when no reply was queued
    scheduled: ScheduledCommand | None = None  # set when the input was scheduled (``when``)


class SayAccepted(_Model):
    speech_id: str | None = None  # None when the say was scheduled
    scheduled: ScheduledCommand | None = None


class InterruptResult(_Model):
    speech_id: str | None = None
    interrupted: bool
    scheduled: ScheduledCommand | None = None  # set when the interrupt was scheduled: nothing interrupted yet


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Speech(_Model):
    id: str
    source: str
    state: str  # scheduled, generating, playing, done
    interrupted: bool
    allow_interruptions: bool = True
    text: str
    played_text: str
    created_at: datetime
    usage: Usage = Field(default_factory=Usage)
    heard_text: str = ""  # what has been heard so far, while it plays too (``played_text`` grows at step ends)
    audio_played_ms: int | None = None  # as a media edge reported its player's position


class ToolProgress(_Model):
    message: str
    progress: float | None = None
    at: datetime


class ToolCall(_Model):
    session_id: str
    call_id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    status: ToolStatus | str  # a status this client does not know stays a string
    cancellable: bool
    scope: str
    background: bool
    progress: list[ToolProgress] = Field(default_factory=list)
    output: str | None = None
    is_error: bool = False
    error: str | None = None  # why it failed, for observers (redacted); the model was given ``output``
    speech_id: str | None = None
    started_at: datetime
    ended_at: datetime | None = None

    @property
    def ended(self) -> bool:
        return self.status not in (ToolStatus.RUNNING, ToolStatus.CANCELLING)


class ToolReport(_Model):
    """The answer to a backend's report: the call's status once the report is applied."""

    call_id: str
    status: ToolStatus | str

    @property
    def ended(self) -> bool:
        return self.status not in (ToolStatus.RUNNING, ToolStatus.CANCELLING)


class ToolCallList(_Model):
    items: list[ToolCall]
    next_cursor: str | None = None


class SessionToken(_Model):
    token: str
    session_id: str
    scopes: list[str]
    expires_at: datetime


class Health(_Model):
    status: Literal["ok", "unavailable"] | str
    detail: str | None = None


class Event(_Model):
    """One event of a session's log: ``seq`` is gap-free per session; ``cursor`` is set on the multi-session stream.

    ``data`` is the event's payload as sent (see the event types in openapi/asyncapi.json).
    """

    seq: int
    session_id: str
    type: str
    at: datetime
    data: dict[str, Any] = Field(default_factory=dict)
    cursor: int | None = None


class SessionExport(_Model):
    """A whole session as one document (``GET /v1/sessions/{sid}/export``)."""

    format: str
    exported_at: datetime
    session: Session
    chat: list[ChatItem]
    tool_calls: list[ToolCall]
    events: list[Event]
