"""Schemas of scheduled commands (``when``) and coaching notes."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..runtime.pending import PendingCommand, PendingKind, PendingPoint, PendingState


class WhenNow(BaseModel):
    """Apply now (the default, as without `when`)."""

    model_config = ConfigDict(extra="forbid")
    at: Literal["now"]


class WhenIdle(BaseModel):
    """Apply when the session is next idle: no speech playing or queued, and the agent not thinking (at once when it
    is idle already)."""

    model_config = ConfigDict(extra="forbid")
    at: Literal["idle"]


class WhenAfterSpeech(BaseModel):
    """Apply once the speech playing now (or, with none playing, the first queued) has ended, interrupted or not; at
    once when there is none. It is never cut off for this."""

    model_config = ConfigDict(extra="forbid")
    at: Literal["after_speech"]


class WhenAfterTool(BaseModel):
    """Apply once the tool call `call_id` of this session has ended (at once when it has ended already); a call this
    session does not know is refused (422 `unknown_tool_call`)."""

    model_config = ConfigDict(extra="forbid")
    at: Literal["after_tool"]
    call_id: str = Field(min_length=1, max_length=200)


When = Annotated[WhenNow | WhenIdle | WhenAfterSpeech | WhenAfterTool, Field(discriminator="at")]

WHEN_DESCRIPTION = (
    'When the command applies: now (the default), or at a point of the conversation: `{"at": "idle"}`, '
    '`{"at": "after_speech"}`, `{"at": "after_tool", "call_id": ...}`. A scheduled command is accepted (202 '
    "with `scheduled`) once it is durable, applies once when its point comes (commands due at the same point in the "
    "order they were accepted), survives a drain or a failover, and is cancelled (`scheduled.cancelled`) if the "
    "session closes first."
)


class ScheduledRead(BaseModel):
    """A scheduled command, or a coaching note (`kind: coach`, `at: next_turn`), and where it stands."""

    id: str
    kind: PendingKind
    at: PendingPoint
    state: PendingState = Field(description="`pending` until it is `applied` or `cancelled`.")
    args: dict[str, Any] = Field(description="The command's body (`text`, `force`, ...; a note: `note`).")
    call_id: str | None = Field(default=None, description="`after_tool`: the call it waits for.")
    speech_id: str | None = Field(
        default=None, description="`after_speech`: the speech it waits for (null: it was due when accepted)."
    )
    created_at: datetime
    ended_at: datetime | None = None
    reason: str | None = Field(
        default=None,
        description="Cancelled: `cancelled_by_operator`, `session_closed`, `not_interruptible` or `failed`.",
    )
    result: dict[str, Any] = Field(
        default_factory=dict, description="Applied: what it did (`item_id`, `speech_id`, `interrupted`)."
    )

    @classmethod
    def of(cls, command: PendingCommand) -> ScheduledRead:
        return cls.model_validate(command.model_dump())


class ScheduledList(BaseModel):
    items: list[ScheduledRead]


class CoachAccepted(BaseModel):
    id: str
    state: PendingState


__all__ = [
    "WHEN_DESCRIPTION",
    "CoachAccepted",
    "ScheduledList",
    "ScheduledRead",
    "When",
    "WhenAfterSpeech",
    "WhenAfterTool",
    "WhenIdle",
    "WhenNow",
]
