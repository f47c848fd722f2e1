"""The event catalogue: one typed payload model per event type, collected in one registry.

An event's ``data`` on the wire is its payload's fields. The models are the single source of the event contract:
``EventLog.emit`` accepts only registered payloads, and the AsyncAPI document is generated from ``EVENT_TYPES``.

>>> log.emit(ToolProgress(call_id="call_1", message="Searching", progress=0.5))
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatItem
from .pending import PendingKind, PendingPoint
from .speech import SpeechSource
from .status import AgentState
from .tools import DropReason, ToolStatus

InputRole = Literal["user", "system", "developer"]
# ``transcript``: a final transcript a media edge sent, taken as the user's input
OperatorActionKind = Literal[
    "input",
    "transcript",
    "say",
    "interrupt",
    "cancel_tool",
    "close",
    "takeover",
    "takeover_say",
    "handback",
    "coach",
    "schedule",
    "cancel_scheduled",
]
SpeculationState = Literal["started", "used", "discarded"]


class EventPayload(BaseModel):
    """The typed ``data`` of one event type; a subclass names its wire type in ``type``.

    A field with a default is an optional key: it appears in ``data`` only when the emitter sets it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: ClassVar[str]
    _optional_keys: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._optional_keys = frozenset(name for name, field in cls.model_fields.items() if not field.is_required())

    def data(self) -> dict[str, Any]:
        """The wire form of this payload: JSON-compatible values, optional keys only when set."""
        # the serializer model_dump wraps, called directly: half the cost, and this runs for every event
        data: dict[str, Any] = self.__pydantic_serializer__.to_python(self, mode="json")
        if self._optional_keys:
            for name in self._optional_keys - self.model_fields_set:
                del data[name]
        return data


# -- the session ----------------------------------------------------------------------------------------------


class SessionStarted(EventPayload):
    """The session is live and accepts input."""

    type: ClassVar[Literal["session.started"]] = "session.started"
    agent: str = Field(description="The agent the session starts with.")


class SessionRecovered(EventPayload):
    """The session was live when the service stopped and runs again; what was in flight has been settled."""

    type: ClassVar[Literal["session.recovered"]] = "session.recovered"
    agent: str
    interrupted_calls: list[str] = Field(description="Calls that were running and ended `interrupted`.")
    retried_calls: list[str] = Field(description='Calls that were running and run again (`on_restart="retry"`).')
    resumed_calls: list[str] = Field(
        default_factory=list,
        description='Calls that were running and go on where they were (`on_restart="resume"`, the default of webhook '
        "tools): each waits for the work already under way (its backend's report) instead of starting it again, and "
        "ends once, like any call.",
    )
    interrupted_speeches: list[str] = Field(
        description="Speeches an interrupt had stopped whose end was not written yet; each ends interrupted."
    )
    resumed_speeches: list[str] = Field(
        default_factory=list,
        description="Speeches the session owed (accepted, not finished where it ran before): each is played now, in "
        "order (a reply generated anew from the chat as it is now, a say with its text).",
    )


class SessionClosed(EventPayload):
    """The session has closed; nothing follows this event."""

    type: ClassVar[Literal["session.closed"]] = "session.closed"
    reason: str | None = Field(
        default=None, description="Why the service closed it (`idle`: nothing happened for its idle timeout)."
    )


class SessionFailed(EventPayload):
    """The session could not be recovered and is marked failed; nothing follows this event."""

    type: ClassVar[Literal["session.failed"]] = "session.failed"
    reason: str
    interrupted_calls: list[str] = Field(description="Calls it left running, each ended `interrupted`.")
    agent: str | None = Field(default=None, description="Present when the session's agent no longer exists.")


class AgentStateChanged(EventPayload):
    """The agent's conversational state changed."""

    type: ClassVar[Literal["agent.state"]] = "agent.state"
    state: AgentState


class AgentHandedOff(EventPayload):
    """A tool handed the session to another agent."""

    type: ClassVar[Literal["agent.handoff"]] = "agent.handoff"
    from_agent: str | None
    to_agent: str


class UserInput(EventPayload):
    """Input was injected: an interim transcript (``final=false``, nothing committed) or a committed message."""

    type: ClassVar[Literal["user.input"]] = "user.input"
    item_id: str | None = Field(description="The committed message's chat item (null for interim input).")
    text: str
    final: bool
    role: InputRole


class ChatItemAdded(EventPayload):
    """An item was committed to the chat context."""

    type: ClassVar[Literal["chat.item"]] = "chat.item"
    item: ChatItem


# -- speech and generation ------------------------------------------------------------------------------------


class SpeechCreated(EventPayload):
    """A speech was queued."""

    type: ClassVar[Literal["speech.created"]] = "speech.created"
    speech_id: str
    source: SpeechSource


class SpeechStarted(EventPayload):
    """A speech began to play."""

    type: ClassVar[Literal["speech.started"]] = "speech.started"
    speech_id: str


class SpeechInterrupted(EventPayload):
    """A speech was interrupted; ``played_text`` is what was heard (and committed); ``audio_played_ms``, when a media
    edge reported its player's position (``played_ms``), how much of its audio was played, all segments together."""

    type: ClassVar[Literal["speech.interrupted"]] = "speech.interrupted"
    speech_id: str
    played_text: str
    audio_played_ms: int | None = None


class SpeechDone(EventPayload):
    """A speech finished, played out or interrupted."""

    type: ClassVar[Literal["speech.done"]] = "speech.done"
    speech_id: str
    interrupted: bool


class GenerationStarted(EventPayload):
    """A model request began for a step of a speech."""

    type: ClassVar[Literal["generation.started"]] = "generation.started"
    speech_id: str
    step: int = Field(ge=0, description="The step within the speech (tool replies add steps).")
    preemptive: bool = Field(description="Whether the step uses a speculative generation started early.")


class GenerationSpeculative(EventPayload):
    """A speculative generation on an interim transcript was started, used or discarded."""

    type: ClassVar[Literal["generation.speculative"]] = "generation.speculative"
    state: SpeculationState
    user_text: str = Field(description="The interim transcript the generation was started on.")
    reason: DropReason | None = Field(
        default=None,
        description="Why it was discarded (only with `discarded`, when known): the calls it started end with it.",
    )


class GenerationFailed(EventPayload):
    """The model failed during a step; what was heard is committed as an interrupted message."""

    type: ClassVar[Literal["generation.failed"]] = "generation.failed"
    speech_id: str
    step: int = Field(ge=0)
    error: str


# -- tools ----------------------------------------------------------------------------------------------------


class ToolStarted(EventPayload):
    """A tool call began executing."""

    type: ClassVar[Literal["tool.started"]] = "tool.started"
    call_id: str
    name: str
    arguments: dict[str, Any]
    cancellable: bool
    speech_id: str | None = Field(description="The speech whose reply called the tool (null after a restart).")
    speculative: bool = Field(
        default=False,
        description="Started early by a speculative reply (a tool declared free of side effects), before the user's "
        "turn was confirmed; its `speech_id` is null. If the reply is dropped, the call ends `cancelled` with a "
        "`reason`, and nothing of it reaches the chat.",
    )


class ToolProgress(EventPayload):
    """A running tool reported progress (the first report moves it to the background)."""

    type: ClassVar[Literal["tool.progress"]] = "tool.progress"
    call_id: str
    message: str
    progress: float | None = Field(description="Fraction done, when the tool knows it.")


class ToolCancelling(EventPayload):
    """A cancelled call whose tool ignores cancellation: it is still running, its status `cancelling`, until its body
    returns; its `tool.ended` follows then (a close lets the body go, and ends the call `cancelled`)."""

    type: ClassVar[Literal["tool.cancelling"]] = "tool.cancelling"
    call_id: str
    reason: str = Field(description="Who cancelled it, as its output will say.")


class ToolEnded(EventPayload):
    """A tool call ended, in exactly one terminal status, with its output committed (one started early by a speculative
    reply that was dropped: with its record alone, and a ``reason``)."""

    type: ClassVar[Literal["tool.ended"]] = "tool.ended"
    call_id: str
    name: str
    status: ToolStatus
    output: str
    is_error: bool
    error: str | None = None  # why it failed (the exception's message, redacted); the model gets only ``output``
    reply_speech_id: str | None = Field(
        default=None,
        description="The deferred reply this end makes owed (a background call's result), committed with it: its "
        "`speech.created` follows.",
    )
    reason: DropReason | None = Field(
        default=None,
        description="Set when a call started by a speculative reply was dropped with that reply (status "
        "`cancelled`): the user went on speaking (`turn_resumed`), a barge-in changed the context (`barge_in`), "
        "something else did (`context_changed`), or the session closed or stopped (`session_stopped`). No chat "
        "item was committed for it.",
    )


# -- operators --------------------------------------------------------------------------------------------------


class OperatorAction(EventPayload):
    """An operator's command was applied to the session (the audit trail): who, what and under which key.

    Logged once per applied command (a replay under the same ``Idempotency-Key`` logs nothing), after its effect
    (before it for ``close``, whose ``session.closed`` is the last event). It never holds a credential. A media edge's
    final transcript, input as ``POST /input`` is, is logged as ``transcript`` once taken."""

    type: ClassVar[Literal["operator.action"]] = "operator.action"
    action: OperatorActionKind
    actor: str = Field(
        description="Who: the API key's name (a digest of the key when it has none), `token:<session>` for a "
        "session token, `anonymous` when the service runs without keys."
    )
    idempotency_key: str | None = Field(
        default=None,
        description="The command's `Idempotency-Key`, when it had one (a media edge's transcript: its `id`).",
    )
    item_id: str | None = Field(default=None, description="The user message it committed (`input`).")
    speech_id: str | None = Field(default=None, description="The speech it queued or interrupted.")
    call_id: str | None = Field(default=None, description="The tool call it cancelled.")
    scheduled_id: str | None = Field(
        default=None,
        description="The scheduled command or coaching note it created or cancelled (`schedule`, `coach`, "
        "`cancel_scheduled`).",
    )
    force: bool | None = Field(
        default=None,
        description="Whether it was forced past `allow_interruptions` (a takeover or a hand-back: past another "
        "operator's hold).",
    )
    displaced: str | None = Field(default=None, description="The operator a forced takeover displaced.")


class SessionTakenOver(EventPayload):
    """An operator took the session over: the speech under way was interrupted, and the model is asked for nothing
    until it is handed back (input is committed without a reply; the operator's words are spoken as the agent)."""

    type: ClassVar[Literal["session.taken_over"]] = "session.taken_over"
    operator: str = Field(description="Who holds it now (as the audit trail names the caller).")
    since: datetime
    displaced: str | None = Field(default=None, description="The operator a forced takeover displaced.")
    interrupted_speech_id: str | None = Field(default=None, description="The speech the takeover interrupted.")


class SessionHandedBack(EventPayload):
    """The operator handed the session back to the agent: a note in the chat tells the model that a human spoke for
    it from `since` to `until`; when the user's last input (or a tool's result) was unanswered, a reply is queued."""

    type: ClassVar[Literal["session.handed_back"]] = "session.handed_back"
    operator: str = Field(description="Who held it.")
    since: datetime
    until: datetime
    by: str | None = Field(default=None, description="Who handed it back, when not the operator who held it (forced).")
    reply_speech_id: str | None = Field(default=None, description="The reply queued to the unanswered input.")


class OperatorSpoke(EventPayload):
    """What an operator said as the agent was heard and committed (an assistant message, only what was heard)."""

    type: ClassVar[Literal["operator.spoke"]] = "operator.spoke"
    operator: str
    speech_id: str
    item_id: str = Field(description="The assistant message committed with the operator's words.")
    text: str


# -- scheduled commands and coaching ----------------------------------------------------------------------------


class ScheduledCreated(EventPayload):
    """An operator command was accepted to apply at a point of the conversation (it is durable: a drain or a failover
    keeps it). `GET /v1/sessions/{sid}/scheduled/{id}` is its status."""

    type: ClassVar[Literal["scheduled.created"]] = "scheduled.created"
    id: str
    kind: PendingKind = Field(description="The command: `input`, `say` or `interrupt`.")
    at: PendingPoint = Field(description="The point it waits for: `idle`, `after_speech` or `after_tool`.")
    call_id: str | None = Field(default=None, description="`after_tool`: the tool call it waits for.")
    speech_id: str | None = Field(default=None, description="`after_speech`: the speech it waits for.")


class ScheduledApplied(EventPayload):
    """A scheduled command reached its point and was applied (once), or a coaching note was given to the model
    (kind `coach`). Emitted after its effect is durable."""

    type: ClassVar[Literal["scheduled.applied"]] = "scheduled.applied"
    id: str
    kind: PendingKind
    item_id: str | None = Field(default=None, description="`input`: the user message it committed.")
    speech_id: str | None = Field(
        default=None, description="The speech it queued or interrupted (`coach`: the speech whose request carried it)."
    )
    interrupted: bool | None = Field(default=None, description="`interrupt`: whether a speech was interrupted.")


class ScheduledCancelled(EventPayload):
    """A scheduled command or a coaching note will never apply: an operator cancelled it
    (`cancelled_by_operator`), the session closed before its point came (`session_closed`), or applying it failed
    (`failed`, `not_interruptible`)."""

    type: ClassVar[Literal["scheduled.cancelled"]] = "scheduled.cancelled"
    id: str
    kind: PendingKind
    reason: str


class SessionCoached(EventPayload):
    """An operator left a note for the agent's next model request only. The user never sees it: it is no chat item,
    and later requests do not carry it. `scheduled.applied` (kind `coach`) follows when a request carried it."""

    type: ClassVar[Literal["session.coached"]] = "session.coached"
    id: str
    note: str


EVENT_PAYLOADS: tuple[type[EventPayload], ...] = (
    SessionStarted,
    SessionRecovered,
    SessionClosed,
    SessionFailed,
    AgentStateChanged,
    AgentHandedOff,
    UserInput,
    ChatItemAdded,
    SpeechCreated,
    SpeechStarted,
    SpeechInterrupted,
    SpeechDone,
    GenerationStarted,
    GenerationSpeculative,
    GenerationFailed,
    ToolStarted,
    ToolProgress,
    ToolCancelling,
    ToolEnded,
    OperatorAction,
    SessionTakenOver,
    SessionHandedBack,
    OperatorSpoke,
    ScheduledCreated,
    ScheduledApplied,
    ScheduledCancelled,
    SessionCoached,
)

#: Event type -> its payload model: the only types an ``EventLog`` emits.
EVENT_TYPES: Mapping[str, type[EventPayload]] = MappingProxyType({model.type: model for model in EVENT_PAYLOADS})
if len(EVENT_TYPES) != len(EVENT_PAYLOADS):
    raise RuntimeError("two payload models name the same event type")


class UnknownEventType(TypeError):
    """An emitted payload is not the registered model of its event type."""
