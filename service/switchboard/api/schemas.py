"""Request and response bodies of the public API (separate from the runtime's and the store's models)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..control.host import PlayoutSettings, SessionConfig
from ..runtime.chat import ChatItem

SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
#: A session's metadata as JSON, at most: it comes back in every list of sessions (up to ``MAX_SESSIONS_PAGE``).
MAX_METADATA_BYTES = 4096
MAX_SESSIONS_PAGE = 200
CHAT_PAGE_DEFAULT = 200
CHAT_PAGE_MAX = 1000


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlayoutConfig(_In):
    words_per_second: float = Field(default=3.0, gt=0, le=1000)


class SessionCreate(_In):
    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN, description="Client-chosen id (idempotent).")
    agent: str = Field(min_length=1, max_length=100)
    llm: dict[str, Any] | None = Field(
        default=None,
        description='The model: a server-side model profile, {"profile": "<name>", "temperature"?} (profiles are '
        "configured with SWITCHBOARD_MODELS; endpoints and credentials never come from a request), or a script, "
        '{"provider": "scripted", "turns": [...], "fallback"?}. Default: the agent\'s own model.',
    )
    playout: PlayoutConfig | None = None
    preemptive_generation: bool | None = None
    allow_interruptions: bool | None = None
    max_tool_steps: int | None = Field(default=None, ge=0, le=20)
    metadata: dict[str, Any] = Field(
        default_factory=dict, description=f"Free-form JSON, at most {MAX_METADATA_BYTES} bytes as JSON."
    )

    @field_validator("metadata")
    @classmethod
    def _small_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is {size} bytes as JSON; at most {MAX_METADATA_BYTES}")
        return value

    def session_config(self) -> SessionConfig:
        """How the session runs (everything but its metadata), as the host takes it."""
        return SessionConfig(
            id=self.id,
            agent=self.agent,
            llm=self.llm,
            playout=PlayoutSettings(words_per_second=self.playout.words_per_second) if self.playout else None,
            preemptive_generation=self.preemptive_generation,
            allow_interruptions=self.allow_interruptions,
            max_tool_steps=self.max_tool_steps,
        )


# the states a session is stored in (what ``GET /v1/sessions?state=`` can match)
SessionStateFilter = Literal["initializing", "active", "closing", "closed", "failed"]


class SessionRead(BaseModel):
    id: str
    agent: str
    state: str
    agent_state: str
    current_speech_id: str | None
    created_at: datetime
    metadata: dict[str, Any]


class SessionList(BaseModel):
    items: list[SessionRead]
    next_cursor: str | None


class ChatRead(BaseModel):
    items: list[ChatItem]
    next_cursor: str | None = Field(
        default=None, description="Where the next page starts (pass it as `cursor`); null on the last page."
    )


class InputCreate(_In):
    text: str = Field(min_length=1)
    final: bool = True
    interrupt: bool = True
    force: bool = False
    reply: bool = True
    role: Literal["user", "system", "developer"] = "user"


class InputAccepted(BaseModel):
    item_id: str | None
    speech_id: str | None


class SayCreate(_In):
    text: str = Field(min_length=1)
    allow_interruptions: bool = True
    add_to_chat: bool = True


class SayAccepted(BaseModel):
    speech_id: str


class InterruptCreate(_In):
    force: bool = False


class InterruptResult(BaseModel):
    speech_id: str | None
    interrupted: bool


class UsageRead(BaseModel):
    """Model tokens, summed over a speech's generation steps (0 when the provider reports none)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


class SpeechRead(BaseModel):
    id: str
    source: str
    state: str
    interrupted: bool
    allow_interruptions: bool
    text: str
    played_text: str
    created_at: datetime
    usage: UsageRead = Field(default_factory=UsageRead)


class ProgressRead(BaseModel):
    message: str
    progress: float | None
    at: datetime


class ToolCallRead(BaseModel):
    session_id: str
    call_id: str
    name: str
    arguments: dict[str, Any]
    status: str
    cancellable: bool
    scope: str
    background: bool
    progress: list[ProgressRead]
    output: str | None
    is_error: bool
    speech_id: str | None
    started_at: datetime
    ended_at: datetime | None


class ToolCallList(BaseModel):
    items: list[ToolCallRead]


class ToolProgressReport(_In):
    """Progress of a webhook call, from its backend (as the tool's own ``ctx.update()``)."""

    message: str = Field(min_length=1)
    progress: float | None = Field(default=None, ge=0, le=1)


class ToolResultReport(_In):
    """The result of a webhook call whose backend answered 202."""

    output: str
    is_error: bool = False


class TokenCreate(_In):
    ttl_s: int | None = Field(default=None, ge=10, le=7 * 24 * 3600)


class TokenRead(BaseModel):
    token: str
    session_id: str
    scopes: list[str]
    expires_at: datetime


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str | None = None
