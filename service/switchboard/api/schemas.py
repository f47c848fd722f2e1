"""Request and response bodies of the public API (separate from the runtime's and the store's models)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from ..control.attention import AttentionCode
from ..control.catalog import AgentDescription, ModelSummary
from ..control.session_config import PlayoutSettings, SessionConfig
from ..runtime.chat import ChatItem
from ..runtime.llm.scripted import ScriptConfig
from ..runtime.text import valid_json
from .schemas_scheduled import WHEN_DESCRIPTION, ScheduledRead, When

SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$"
#: A session's metadata as JSON, at most: it comes back in every list of sessions (up to ``MAX_SESSIONS_PAGE``).
MAX_METADATA_BYTES = 4096
MAX_SESSIONS_PAGE = 200
CHAT_PAGE_DEFAULT = 200
CHAT_PAGE_MAX = 1000
TOOL_CALL_PAGE_DEFAULT = 200
TOOL_CALL_PAGE_MAX = 1000


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        # A body's lone surrogates (``"\ud800"`` in its JSON) become U+FFFD: the one rule of ``runtime.text``.
        return valid_json(data)


class PlayoutConfig(_In):
    words_per_second: float = Field(default=3.0, gt=0, le=1000)
    first_audio_ms: int | None = Field(
        default=None,
        ge=0,
        le=10_000,
        description="Time to first audio: the simulated voice starts this long after a speech's first text "
        "(the agent is `speaking` from then on). Default: the server's `SWITCHBOARD_FIRST_AUDIO_MS` (0).",
    )


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with each ``$ref`` to its ``$defs`` replaced by the definition (to embed it in one field)."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


def _llm_schema() -> dict[str, Any]:
    """The documented shapes of a session's ``llm`` (validated by the model profiles and the provider, so that a
    refusal says why in words)."""
    script = ScriptConfig.model_json_schema()
    script = _inline_refs(script, script.get("$defs", {}))
    script["properties"] = {"provider": {"const": "scripted", "default": "scripted"}, **script["properties"]}
    script["title"] = "Scripted model"
    profile = {
        "title": "Model profile",
        "type": "object",
        "description": "A model the server configured (SWITCHBOARD_MODELS), by name.",
        "properties": {
            "profile": {"type": "string", "description": "The profile's name."},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        },
        "required": ["profile"],
        "additionalProperties": False,
    }
    example = {
        "provider": "scripted",
        "turns": [
            {
                "text": "Let me look that up.",
                "tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "A-1"}}],
            },
            {"text": "Your order {{tool_output:lookup_order}}.", "ttft_ms": 200, "word_ms": 50},
        ],
        "fallback": {"text": "Is there anything else?"},
    }
    return {"anyOf": [profile, script, {"type": "null"}], "examples": [example, {"profile": "fast"}]}


class SessionCreate(_In):
    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN, description="Client-chosen id (idempotent).")
    agent: str = Field(min_length=1, max_length=100)
    llm: Annotated[dict[str, Any] | None, WithJsonSchema(_llm_schema())] = Field(
        default=None,
        description='The model: a server-side model profile, {"profile": "<name>", "temperature"?} (profiles are '
        "configured with SWITCHBOARD_MODELS; endpoints and credentials never come from a request), or a script, "
        '{"provider": "scripted", "turns": [...], "fallback"?}. Default: the agent\'s own model; for an agent without '
        "one, a stand-in (`stand-in` in the session's `model`) that calls the tools a user writes as calls and says "
        "how to connect a model otherwise.",
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
            playout=PlayoutSettings(
                words_per_second=self.playout.words_per_second, first_audio_ms=self.playout.first_audio_ms
            )
            if self.playout
            else None,
            preemptive_generation=self.preemptive_generation,
            allow_interruptions=self.allow_interruptions,
            max_tool_steps=self.max_tool_steps,
        )


# the states a session is stored in (what ``GET /v1/sessions?state=`` can match)
SessionStateFilter = Literal["initializing", "active", "closing", "closed", "failed"]


class AttentionRead(BaseModel):
    """One reason the session needs an operator."""

    code: AttentionCode = Field(description="What is wrong (a stable code).")
    message: str = Field(description="What is wrong, for a person.")
    since: datetime = Field(description="Since when.")


class LatencyRead(BaseModel):
    """The latest turn's latency (null until the session has had one)."""

    time_to_first_token_ms: float | None = Field(default=None, description="Model request to its first chunk.")
    time_to_first_audio_ms: float | None = Field(
        default=None, description="A reply's first model request to its first word playing."
    )


class SessionRead(BaseModel):
    id: str
    agent: str
    state: str
    agent_state: str
    current_speech_id: str | None
    created_at: datetime
    metadata: dict[str, Any]
    owner_node: str | None = Field(
        default=None, description="The node running the session (null: none yet, or it is over)."
    )
    last_activity_at: datetime = Field(description="The session's latest event this process saw (else its creation).")
    attention: list[AttentionRead] = Field(
        default_factory=list, description="Why the session needs an operator now, oldest first (empty: it does not)."
    )
    model: ModelSummary | None = Field(default=None, description="The model the session uses.")
    latency: LatencyRead = Field(default_factory=LatencyRead)
    takeover: TakeoverRead | None = Field(
        default=None, description="The operator holding the session (null: the agent has it)."
    )


class AgentList(BaseModel):
    items: list[AgentDescription]


class SessionList(BaseModel):
    items: list[SessionRead]
    next_cursor: str | None


class ChatRead(BaseModel):
    items: list[ChatItem]
    next_cursor: str | None = Field(
        default=None, description="Where the next page starts (pass it as `cursor`); null on the last page."
    )


class _Schedulable(_In):
    """A command's body that may carry ``when``: without one it dumps as it did before ``when`` existed, so the digest
    of an ``Idempotency-Key``'s request is the same (a retry across an upgrade is still recognised)."""

    # no return annotation: the schema of the body stays the model's (an annotation would replace it)
    @model_serializer(mode="wrap")
    def _without_no_when(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        data = handler(self)
        if isinstance(data, dict) and data.get("when", "") is None:
            del data["when"]
        return data


class InputCreate(_Schedulable):
    text: str = Field(min_length=1)
    final: bool = True
    interrupt: bool = True
    force: bool = False
    reply: bool = True
    role: Literal["user", "system", "developer"] = "user"
    when: When | None = Field(default=None, description=WHEN_DESCRIPTION + " Only for a final input.")

    @model_validator(mode="after")
    def _final_when_scheduled(self) -> InputCreate:
        if self.when is not None and self.when.at != "now" and not self.final:
            raise ValueError("an interim transcript (final=false) cannot be scheduled: it applies now or never")
        return self


class _MaybeScheduled(BaseModel):
    """A command's answer: ``scheduled`` appears only when the command was scheduled (``when``); the answer of a
    command applied now is what it always was."""

    # no return annotation: the schema of the answer stays the model's (an annotation would replace it)
    @model_serializer(mode="wrap")
    def _without_unscheduled(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        data = handler(self)
        if isinstance(data, dict) and data.get("scheduled", "") is None:
            del data["scheduled"]
        return data


class InputAccepted(_MaybeScheduled):
    item_id: str | None
    speech_id: str | None
    scheduled: ScheduledRead | None = Field(
        default=None, description="Set when the input was scheduled (`when`): then `item_id` and `speech_id` are null."
    )


class SayCreate(_Schedulable):
    text: str = Field(min_length=1)
    allow_interruptions: bool = True
    add_to_chat: bool = True
    when: When | None = Field(default=None, description=WHEN_DESCRIPTION)


class SayAccepted(_MaybeScheduled):
    speech_id: str | None = Field(description="The speech queued; null when it was scheduled (`scheduled`).")
    scheduled: ScheduledRead | None = Field(default=None, description="Set when the say was scheduled (`when`).")


class TakeoverCreate(_In):
    force: bool = Field(default=False, description="Take it from another operator who holds it (they are displaced).")


class TakeoverRead(BaseModel):
    """Who holds the session (an operator's takeover) and since when."""

    operator: str = Field(description="The operator holding it, as the audit trail names the caller.")
    since: datetime
    displaced: str | None = Field(default=None, description="The operator a forced takeover displaced.")
    last_seen_at: datetime | None = Field(
        default=None, description="The holder's last sign (a takeover, a say, a heartbeat), where the session runs."
    )


class TakeoverSayCreate(_In):
    text: str = Field(min_length=1)


class HandBackRead(BaseModel):
    """A hand-back: whose hold it ended, when, by whom, and the reply it queued to an unanswered input."""

    operator: str
    since: datetime
    until: datetime
    by: str = Field(description="Who handed it back.")
    speech_id: str | None = Field(description="The agent's reply to the user's unanswered input (null: none owed).")


class CoachCreate(_In):
    note: str = Field(min_length=1, description="For the agent's next model request only; the user never sees it.")


class InterruptCreate(_Schedulable):
    force: bool = False
    when: When | None = Field(default=None, description=WHEN_DESCRIPTION + " Then it answers 202.")


class InterruptResult(_MaybeScheduled):
    speech_id: str | None
    interrupted: bool
    scheduled: ScheduledRead | None = Field(
        default=None, description="Set when the interrupt was scheduled (`when`, 202): nothing is interrupted yet."
    )


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
    played_text: str = Field(description="What was heard, committed at the end of each step.")
    heard_text: str = Field(
        default="",
        description="What has been heard so far, the step playing now included: it grows as the speech plays "
        "(read it while `state` is `playing`); the same as `played_text` once the speech is done.",
    )
    audio_played_ms: int | None = Field(
        default=None,
        description="The audio played so far, in milliseconds, all steps, as the media edge reported its player's "
        "position (`playback.progress` `played_ms`); null when it reported none. Kept while the session runs here.",
    )
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
    error: str | None = Field(
        default=None, description="Why the call failed (the exception's message, redacted); the model is given `output`"
    )
    speech_id: str | None
    started_at: datetime
    ended_at: datetime | None


class ToolCallCancel(_In):
    force: bool = Field(
        default=False, description="Cancel even while the speech that made the call does not allow interruptions"
    )


class ToolCallList(BaseModel):
    items: list[ToolCallRead]
    next_cursor: str | None = Field(
        default=None, description="Where the next page starts (pass it as `cursor`); null on the last page."
    )


class ToolProgressReport(_In):
    """Progress of a webhook call, from its backend (as the tool's own ``ctx.update()``)."""

    message: str = Field(min_length=1)
    progress: float | None = Field(default=None, ge=0, le=1)
    silent: bool = Field(
        default=False,
        description="Recorded and streamed as `tool.progress`, but asks for no spoken reply: a first report that is "
        "silent moves the call to the background without the agent answering it.",
    )


class ToolResultReport(_In):
    """The result of a webhook call whose backend answered 202."""

    output: str
    is_error: bool = False


class ToolReportRead(BaseModel):
    """A report's answer: the call's status once the report is applied (`running`, or how it ended). Only what the
    reporting backend already knows: never the call's arguments, progress or other sessions' state."""

    call_id: str
    status: str


class TokenCreate(_In):
    ttl_s: int | None = Field(default=None, ge=10, le=7 * 24 * 3600)
    scopes: list[Literal["sessions:read", "events:read", "media:connect"]] | None = Field(
        default=None,
        min_length=1,
        description="What the token may do (default: `sessions:read`, `events:read`). `media:connect` (connect as "
        "the session's media edge) needs an API key that holds it.",
    )


class TokenRead(BaseModel):
    token: str
    session_id: str
    scopes: list[str]
    expires_at: datetime


class NodeRead(BaseModel):
    """A running (or recently running) instance of the service on this database."""

    id: str
    url: str = Field(description="How the other nodes reach this one.")
    state: Literal["live", "draining", "stopped", "dead"] = Field(
        description="`draining`: stopping, handing its sessions to the other nodes (SIGTERM in cluster mode)."
    )
    mode: Literal["single", "cluster"]
    sessions: int = Field(description="Live sessions it owns.")
    heartbeat_at: datetime
    lease_until: datetime


class NodeList(BaseModel):
    items: list[NodeRead]


class Health(BaseModel):
    status: Literal["ok", "unavailable", "fenced", "draining"]
    detail: str | None = None


class ExportedEvent(BaseModel):
    """One event of the session's log, as a stream delivers it."""

    seq: int
    session_id: str
    type: str
    at: datetime
    data: dict[str, Any]


class SessionExport(BaseModel):
    """A whole session in one document: what an operator hands on, or keeps."""

    format: Literal["switchboard.session-export/1"]
    exported_at: datetime
    session: SessionRead
    chat: list[ChatItem] = Field(description="The chat context in conversation order.")
    tool_calls: list[ToolCallRead] = Field(description="Every tool call, by start time, with progress and output.")
    events: list[ExportedEvent] = Field(
        description="The durable event log in `seq` order (operator actions included); last, so that a big log is "
        "streamed a page at a time."
    )
