"""The frames of the media edge protocol (``WS /v1/sessions/{sid}/media``; docs/media-edge.md).

One class per frame type: the AsyncAPI document is generated from them, the server builds what it sends with them and
parses what an edge sends with ``parse_edge_frame``. JSON text frames, each ``{"type": ..., ...}``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

TRANSCRIPT_ID_MAX_CHARS = 200  # as an Idempotency-Key


class _Frame(BaseModel):
    # an edge may send fields a later version defines: ignored, so old servers and new edges get along
    model_config = ConfigDict(extra="ignore", frozen=True)
    type: str
    direction: ClassVar[Literal["server", "edge"]]

    def to_json(self) -> str:
        return self.model_dump_json()


# -- server -> edge ------------------------------------------------------------------------------------------------


class _ServerFrame(_Frame):
    n: int | None = Field(
        default=None,
        description="This frame's position in the edge's stream, counting up from 1 across the connections of one "
        "`edge_id` that resume each other: the `resume` to connect again with (docs/media-edge.md, Resuming). "
        "Not on `pong`, `resumed` and `resume.refused`, which are the connection's own.",
    )


class SpeechStartFrame(_ServerFrame):
    """A speech begins: text to synthesise follows in `speech.text` frames, then `speech.end`.

    A speech with tool steps is played as several segments, each opened by its own `speech.start` with the same
    `speech_id`; `played_chars` counts from the start of the current segment."""

    direction = "server"
    type: Literal["speech.start"] = "speech.start"
    speech_id: str
    allow_interruptions: bool = Field(description="Whether `user.speech_started` interrupts this speech.")


class SpeechTextFrame(_ServerFrame):
    """More text of the speech, streamed as the model produces it (append `delta` to what was sent before)."""

    direction = "server"
    type: Literal["speech.text"] = "speech.text"
    speech_id: str
    delta: str


class SpeechEndFrame(_ServerFrame):
    """No more text for this speech (segment): play the rest, then send `playback.finished`."""

    direction = "server"
    type: Literal["speech.end"] = "speech.end"
    speech_id: str


class SpeechStopFrame(_ServerFrame):
    """The speech was interrupted: stop its audio now. The server does not wait for an answer: what was heard is the
    last `playback.progress` it received before the interruption."""

    direction = "server"
    type: Literal["speech.stop"] = "speech.stop"
    speech_id: str


class ErrorFrame(_ServerFrame):
    """A frame from the edge was refused (the connection stays open and the session goes on). `code` is stable."""

    direction = "server"
    type: Literal["error"] = "error"
    code: str = Field(
        description="`bad_json`, `bad_frame`, `unknown_type`, `unknown_speech`, `played_chars_beyond_text`, "
        "`played_chars_backwards`, `played_ms_backwards`, `speech_not_ended`, `text_too_long`, `session_not_active`, "
        "`command_failed` (the server could not apply it: a transcript is sent again), `transcript_id_reused` (an "
        "`id` sent before with another text), `rate_limited` (a final transcript over its credential's budget: sent "
        "again after `retry_after_s`)."
    )
    detail: str
    frame_type: str | None = Field(default=None, description="The `type` of the refused frame, when it had one.")
    id: str | None = Field(
        default=None,
        description="The `id` of the refused `user.transcript`, when it had one: that transcript was not taken.",
    )
    retry_after_s: float | None = Field(
        default=None, description="With `rate_limited`: the seconds after which the transcript would be taken."
    )


class TranscriptTakenFrame(_ServerFrame):
    """The final `user.transcript` with this `id` is taken: durable as the user's input (`item_id`).

    Sent once the transcript is committed (its reply queued), and again, without applying it twice, each time it is
    sent again with that `id` (its `transcript.taken` was lost with a connection)."""

    direction = "server"
    type: Literal["transcript.taken"] = "transcript.taken"
    id: str
    item_id: str


class PongFrame(_Frame):
    """The server's answer to a `ping`."""

    direction = "server"
    type: Literal["pong"] = "pong"


class ResumedFrame(_Frame):
    """The answer to a connection with `resume`: the edge's stream goes on. The frames after `after` that it missed
    follow (the speech under way from where it was, then queued speeches), with their own `n`, then new ones."""

    direction = "server"
    type: Literal["resumed"] = "resumed"
    after: int


class ResumeRefusedFrame(_Frame):
    """The answer to a connection with `resume` that cannot go on from `after` (another node, too old, held too long):
    the edge starts fresh. The speeches it was playing ended interrupted at their last reported position; drop their
    audio and play what comes next."""

    direction = "server"
    type: Literal["resume.refused"] = "resume.refused"
    after: int
    detail: str


# -- edge -> server ------------------------------------------------------------------------------------------------


class PlaybackStartedFrame(_Frame):
    """The audio of this speech began: the agent is `speaking` from now on (`speech.started`, `agent.state`)."""

    direction = "edge"
    type: Literal["playback.started"] = "playback.started"
    speech_id: StrictStr


class PlaybackProgressFrame(_Frame):
    """How much of the speech (segment) has been heard: the first `played_chars` characters of what was sent (from the
    synthesiser's word timings), and/or `played_ms` of its audio. At least one of the two; never more than was sent,
    never backwards. With `played_ms` alone the server estimates the characters from a typical speaking rate."""

    direction = "edge"
    type: Literal["playback.progress"] = "playback.progress"
    speech_id: StrictStr
    played_chars: Annotated[StrictInt, Field(ge=0)] | None = None
    played_ms: Annotated[StrictInt, Field(ge=0)] | None = Field(
        default=None, description="Milliseconds of the segment's audio played so far."
    )

    @model_validator(mode="after")
    def _a_position(self) -> PlaybackProgressFrame:
        if self.played_chars is None and self.played_ms is None:
            raise ValueError("played_chars or played_ms is required")
        return self


class PlaybackFinishedFrame(_Frame):
    """The audio of this speech ended: all of it (after `speech.end`), or cut by the edge (`interrupted`: the speech
    ends interrupted at the last `playback.progress`). After a `speech.stop` it changes nothing."""

    direction = "edge"
    type: Literal["playback.finished"] = "playback.finished"
    speech_id: StrictStr
    interrupted: StrictBool = False


class UserSpeechStartedFrame(_Frame):
    """The user started talking (barge-in): the current speech is interrupted when it allows it, like
    `POST /interrupt`."""

    direction = "edge"
    type: Literal["user.speech_started"] = "user.speech_started"


class UserTranscriptFrame(_Frame):
    """What the user said, like `POST /input`: `final=false` is an interim transcript (reported, may start a
    speculative reply), `final=true` the user's turn (interrupts, is committed, queues a reply).

    A final transcript with an `id` is taken at most once, whatever node or connection it is sent on, and answered
    `transcript.taken` once durable: an edge keeps it until then and sends it again, with the same `id`, on each new
    connection (like an `Idempotency-Key`)."""

    direction = "edge"
    type: Literal["user.transcript"] = "user.transcript"
    text: Annotated[StrictStr, Field(min_length=1)]
    final: StrictBool = True
    id: Annotated[StrictStr, Field(min_length=1, max_length=TRANSCRIPT_ID_MAX_CHARS)] | None = Field(
        default=None, description="Unique per final transcript of the session: it is taken at most once."
    )


class PingFrame(_Frame):
    """Keep-alive from the edge; answered with a `pong`."""

    direction = "edge"
    type: Literal["ping"] = "ping"


SERVER_FRAMES: tuple[type[_Frame], ...] = (
    SpeechStartFrame,
    SpeechTextFrame,
    SpeechEndFrame,
    SpeechStopFrame,
    ErrorFrame,
    PongFrame,
    TranscriptTakenFrame,
    ResumedFrame,
    ResumeRefusedFrame,
)
EDGE_FRAMES: tuple[type[_Frame], ...] = (
    PlaybackStartedFrame,
    PlaybackProgressFrame,
    PlaybackFinishedFrame,
    UserSpeechStartedFrame,
    UserTranscriptFrame,
    PingFrame,
)
EdgeFrame = (
    PlaybackStartedFrame
    | PlaybackProgressFrame
    | PlaybackFinishedFrame
    | UserSpeechStartedFrame
    | UserTranscriptFrame
    | PingFrame
)
_EDGE_TYPES = {model.model_fields["type"].default: model for model in EDGE_FRAMES}
_ADAPTERS: dict[str, TypeAdapter[Any]] = {name: TypeAdapter(model) for name, model in _EDGE_TYPES.items()}


class FrameRefused(Exception):
    """A frame the edge sent was refused; ``error_frame()`` says why."""

    def __init__(
        self,
        code: str,
        detail: str,
        frame_type: str | None = None,
        transcript_id: str | None = None,
        *,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.frame_type = frame_type
        self.transcript_id = transcript_id
        self.retry_after_s = retry_after_s

    def error_frame(self) -> ErrorFrame:
        return ErrorFrame(
            code=self.code,
            detail=self.detail,
            frame_type=self.frame_type,
            id=self.transcript_id,
            retry_after_s=self.retry_after_s,
        )


def parse_edge_frame(data: Any) -> EdgeFrame:
    """The frame ``data`` (decoded JSON) is, or ``FrameRefused``."""
    if not isinstance(data, dict):
        raise FrameRefused("bad_frame", "a frame is a JSON object with a `type`")
    kind = data.get("type")
    adapter = _ADAPTERS.get(kind) if isinstance(kind, str) else None
    if adapter is None:
        shown = kind if isinstance(kind, str) and len(kind) <= 40 else None
        raise FrameRefused("unknown_type", f"unknown frame type {shown!r}; expected one of {sorted(_EDGE_TYPES)}")
    try:
        frame: EdgeFrame = adapter.validate_python(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "frame"
        raise FrameRefused("bad_frame", f"{where}: {first['msg']}", kind) from None
    return frame


__all__ = [
    "EDGE_FRAMES",
    "SERVER_FRAMES",
    "TRANSCRIPT_ID_MAX_CHARS",
    "EdgeFrame",
    "ErrorFrame",
    "FrameRefused",
    "PingFrame",
    "PlaybackFinishedFrame",
    "PlaybackProgressFrame",
    "PlaybackStartedFrame",
    "PongFrame",
    "ResumeRefusedFrame",
    "ResumedFrame",
    "SpeechEndFrame",
    "SpeechStartFrame",
    "SpeechStopFrame",
    "SpeechTextFrame",
    "TranscriptTakenFrame",
    "UserSpeechStartedFrame",
    "UserTranscriptFrame",
    "parse_edge_frame",
]
