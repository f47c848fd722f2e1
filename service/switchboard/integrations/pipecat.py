"""A Pipecat pipeline as a Switchboard session's media edge (``pip install "switchboard[pipecat]"``).

:class:`SwitchboardBrain` sits where an LLM would sit in a Pipecat pipeline, and the processor it makes with
:meth:`SwitchboardBrain.playback` sits after the output transport::

    brain = SwitchboardBrain("http://localhost:8000", session_id, api_key=key)
    Pipeline([transport.input(), stt, user_turns, brain, tts, transport.output(), brain.playback()])

The brain connects to the session's media WebSocket (``WS /v1/sessions/{sid}/media``, docs/media-edge.md) and
turns the pipeline's frames into the protocol's and back:

- a ``TranscriptionFrame`` from the STT is a final ``user.transcript`` with an id, sent again on every new connection
  until the session answers ``transcript.taken``; an ``InterimTranscriptionFrame`` an interim one;
- a ``UserStartedSpeakingFrame`` is a barge-in (``user.speech_started``); an ``InterruptionFrame`` that cuts a
  speech in the pipeline ends it interrupted (``playback.finished``);
- a speech of the session goes downstream as an LLM reply (``LLMFullResponseStartFrame``, an ``LLMTextFrame`` per
  ``speech.text`` delta, ``LLMFullResponseEndFrame``), which any TTS speaks sentence by sentence; ``speech.stop``
  becomes an interruption of the pipeline;
- after the output transport, the playback processor reports what the transport played: ``playback.started`` with
  the speech's first audio, ``playback.progress`` as each ``TTSTextFrame`` comes out of the transport (word by word
  from a TTS with word timestamps, sentence by sentence from one without), ``playback.finished`` once the speech's
  last audio has been played.

The brain reconnects after a drop, a restart or a session being moved (close codes 1006, 1011, 1012, 1013, 4008,
4410), as the reference edges do. When the session ends (1000) or the connection is refused for good, it calls its
``on_session_closed`` event handler with the close code and reason (end the pipeline there).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from dataclasses import dataclass

from pipecat.frames.frames import (
    BotStartedSpeakingFrame,
    CancelFrame,
    DataFrame,
    EndFrame,
    Frame,
    InterimTranscriptionFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    StartFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
    UserStartedSpeakingFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

from ..client.edge_memory import DROP_CODES, RESEND_CODE, WAIT_CODE, EdgeIdentity, PendingTranscripts
from ..client.errors import SwitchboardError, Unavailable
from ..client.media import MediaConnection, MediaFrame, media_url

SESSION_CLOSED = 1000
# a dropped connection, a restart, a stall, the database away for a moment, a session being recovered or moved
RETRY_CODES = frozenset({1006, 1011, 1012, 1013, 4008, 4410})
RECONNECT_FIRST_S = 0.25
RECONNECT_MAX_S = 2.0
RESEND_AFTER_S = 1.0  # a transcript the service failed to apply (command_failed) is sent again after this pause
MAX_WAIT_S = 60.0  # the longest pause a rate_limited refusal's retry_after_s is taken at its word for
_WORD = re.compile(r"\S+")


@dataclass(eq=False)
class Segment:
    """One segment of a speech: the text the session sent for it and how much of it has been played."""

    speech_id: str
    allow_interruptions: bool
    text: str = ""
    ended: bool = False  #: ``speech.end`` came: no more text
    started: bool = False  #: ``playback.started`` was sent
    played_chars: int = 0  #: reported as played
    finished: bool = False  #: ``playback.finished`` was sent, or the connection it came on is gone


@dataclass
class SegmentMark(DataFrame):
    """Marks, in the frames that go through the TTS and the output transport, where a segment begins or ends: the
    output transport lets it through once the audio before it has been played."""

    segment: Segment
    end: bool = False


class SwitchboardBrain(FrameProcessor):
    """A Switchboard session as the brain of a Pipecat pipeline: place it where the LLM would be.

    ``url``: the service (``http://host:port``). ``api_key``: a key with the ``media:connect`` scope, or ``token``: a
    session token minted with it. ``retry_for_s``: how long to keep reconnecting after the connection was lost.
    """

    def __init__(
        self,
        url: str,
        session_id: str,
        *,
        api_key: str | None = None,
        token: str | None = None,
        retry_for_s: float = 120.0,
    ) -> None:
        super().__init__()
        self.url = url
        self.session_id = session_id
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._token = token
        self._retry_for_s = retry_for_s
        self._identity = EdgeIdentity()
        self._transcripts = PendingTranscripts()
        self._conn: MediaConnection | None = None
        self._connected = asyncio.Event()  # set while a connection is open
        self._run_task: asyncio.Task[None] | None = None
        self._resends: set[asyncio.Task[None]] = set()
        self._segments: deque[Segment] = deque()  # sent downstream or waiting to be, oldest (playing) first
        self._register_event_handler("on_connected")
        self._register_event_handler("on_session_closed")

    def playback(self) -> SwitchboardPlayback:
        """The processor that reports playback: place it right after the output transport."""
        return SwitchboardPlayback(self)

    @property
    def connected(self) -> bool:
        """Connected to the session's media endpoint now."""
        return self._connected.is_set()

    @property
    def pending_transcripts(self) -> int:
        """Final transcripts sent and not yet taken by the session."""
        return len(self._transcripts)

    # -- the pipeline's frames -------------------------------------------------------------------------------------

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)
            self._run_task = self.create_task(self._run(), "switchboard-media")
            return
        if isinstance(frame, (EndFrame, CancelFrame)):
            await self._stop()
        elif isinstance(frame, TranscriptionFrame):
            await self.say(frame.text)
        elif isinstance(frame, InterimTranscriptionFrame):
            if frame.text.strip():
                await self._send("user.transcript", text=frame.text, final=False)
        elif isinstance(frame, UserStartedSpeakingFrame):
            await self._send("user.speech_started")
        elif isinstance(frame, InterruptionFrame):
            await self.push_frame(frame, direction)  # first: the next speech goes after it, not flushed by it
            await self._interrupted_here()
            return
        await self.push_frame(frame, direction)

    async def say(self, text: str) -> None:
        """Send a final transcript of the user (kept, with its id, until the session says it took it)."""
        if not text.strip():
            return
        kept, _ = self._transcripts.add(text.strip())
        await self._send("user.transcript", text=kept.text, final=True, id=kept.id)

    async def _interrupted_here(self) -> None:
        """The pipeline interrupted itself (a barge-in) and dropped what it had of the speech it was saying: that
        speech ends where it was heard (nothing, if its audio had not begun)."""
        if self._segments:
            await self._finish(self._segments.popleft(), interrupted=True)
            await self._next_segment()

    # -- the session's frames --------------------------------------------------------------------------------------

    async def _run(self) -> None:
        failing_since: float | None = None
        delay_s = RECONNECT_FIRST_S
        while True:
            url = media_url(
                self.url,
                self.session_id,
                token=self._token,
                edge_id=self._identity.edge_id,
                connection=self._identity.next_attempt(),
            )
            code, reason = 1006, "unreachable"
            try:
                async with MediaConnection(url, self._headers) as conn:
                    self._conn = conn
                    failing_since, delay_s = None, RECONNECT_FIRST_S
                    await self._connection(conn)
                code, reason = conn.close_code or 1006, conn.close_reason
            except Unavailable:
                pass  # unreachable: a restart, or a network away for a moment
            except SwitchboardError as err:  # refused: a wrong key, no such session
                code, reason = err.status, err.detail or str(err)
            finally:
                self._conn = None
                self._connected.clear()
            await self._connection_lost()  # not when cancelled: the pipeline is ending, and interrupts nothing
            now = time.monotonic()
            failing_since = failing_since or now
            if code not in RETRY_CODES or now - failing_since > self._retry_for_s:
                await self._call_event_handler("on_session_closed", code, reason)
                return
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, RECONNECT_MAX_S)

    async def _connection(self, conn: MediaConnection) -> None:
        for kept in self._transcripts.pending():  # unanswered on an earlier connection: the session takes it once
            await conn.send_transcript(kept.text, id=kept.id)
        self._connected.set()
        await self._call_event_handler("on_connected")
        async for frame in conn:
            await self._on_frame(frame)

    async def _on_frame(self, frame: MediaFrame) -> None:
        sid = frame.speech_id or ""
        if frame.type == "speech.start":
            self._segments.append(Segment(sid, frame.allow_interruptions is not False))
            if len(self._segments) == 1:
                await self._next_segment()
        elif frame.type == "speech.text" and (segment := self._latest(sid)) is not None:
            segment.text += frame.delta or ""
            if segment is self._segments[0] and frame.delta:
                await self.push_frame(LLMTextFrame(frame.delta))
        elif frame.type == "speech.end" and (segment := self._latest(sid)) is not None:
            segment.ended = True
            if segment is self._segments[0]:
                await self._end_downstream(segment)
        elif frame.type == "speech.stop":
            await self._stop_speech(sid)
        elif frame.type == "transcript.taken" and frame.id:
            self._transcripts.discard(frame.id)
        elif frame.type == "error" and frame.id:
            self._refused(frame.id, frame.code or "", frame.retry_after_s)

    def _latest(self, speech_id: str) -> Segment | None:
        return next((s for s in reversed(self._segments) if s.speech_id == speech_id), None)

    async def _next_segment(self) -> None:
        """Send the oldest segment downstream: its text so far, the rest as it comes."""
        if not self._segments:
            return
        segment = self._segments[0]
        await self.push_frame(SegmentMark(segment=segment))
        await self.push_frame(LLMFullResponseStartFrame())
        if segment.text:
            await self.push_frame(LLMTextFrame(segment.text))
        if segment.ended:
            await self._end_downstream(segment)

    async def _end_downstream(self, segment: Segment) -> None:
        await self.push_frame(LLMFullResponseEndFrame())
        await self.push_frame(SegmentMark(segment=segment, end=True))

    async def _stop_speech(self, speech_id: str) -> None:
        """``speech.stop``: silence the segment playing now, and forget the segments of the speech still waiting."""
        playing = self._segments[0] if self._segments else None
        self._segments = deque(s for s in self._segments if s.speech_id != speech_id or s is playing)
        if playing is not None and playing.speech_id == speech_id:
            self._segments.popleft()
            await self._interrupt_pipeline()
            await self._finish(playing, interrupted=True)
            await self._next_segment()

    async def _connection_lost(self) -> None:
        """The speeches sent on a lost connection ended interrupted there: silence them here too."""
        if not self._segments:
            return
        for segment in self._segments:
            segment.finished = True
        self._segments.clear()
        await self._interrupt_pipeline()

    async def _interrupt_pipeline(self) -> None:
        """Drop what the TTS and the output transport hold of the speech, both ways (Pipecat's interruption)."""
        await self.broadcast_interruption()  # type: ignore[no-untyped-call]

    # -- reports ---------------------------------------------------------------------------------------------------

    async def _played(self, segment: Segment, chars: int) -> None:
        """``chars`` of the segment's text are heard (the first report also says that it started)."""
        if segment.finished:
            return
        if not segment.started:
            segment.started = True
            await self._send("playback.started", speech_id=segment.speech_id)
            await self._send("playback.progress", speech_id=segment.speech_id, played_chars=0)
        if chars > segment.played_chars:
            segment.played_chars = chars
            await self._send("playback.progress", speech_id=segment.speech_id, played_chars=chars)

    async def _played_to_end(self, segment: Segment) -> None:
        if segment.finished or not self._segments or self._segments[0] is not segment:
            return
        await self._played(segment, len(segment.text))
        self._segments.popleft()
        await self._finish(segment, interrupted=False)
        await self._next_segment()

    async def _finish(self, segment: Segment, *, interrupted: bool) -> None:
        if not segment.finished:
            segment.finished = True
            await self._send("playback.finished", speech_id=segment.speech_id, interrupted=interrupted)

    async def _send(self, type: str, **fields: object) -> None:
        if self._conn is not None:
            await self._conn.send(type, **fields)

    def _refused(self, transcript_id: str, code: str, retry_after_s: float | None) -> None:
        """The session did not take a final transcript: send it again in a moment, or give it up."""
        kept = self._transcripts.get(transcript_id)
        if kept is None:
            return
        if code in (RESEND_CODE, WAIT_CODE):
            wait_s = RESEND_AFTER_S
            if code == WAIT_CODE and retry_after_s is not None:
                wait_s = min(max(retry_after_s, 0.0), MAX_WAIT_S)
            task = asyncio.create_task(self._send_again(kept.id, wait_s), name=f"switchboard-resend-{kept.id}")
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)
        elif code in DROP_CODES:
            self._transcripts.discard(transcript_id)

    async def _send_again(self, transcript_id: str, wait_s: float) -> None:
        await asyncio.sleep(wait_s)
        kept = self._transcripts.get(transcript_id)
        if kept is not None and self._conn is not None:  # neither taken nor given up meanwhile
            await self._conn.send_transcript(kept.text, id=kept.id)

    async def _stop(self) -> None:
        if self._run_task is not None:
            await self.cancel_task(self._run_task)
            self._run_task = None
        for task in self._resends:
            task.cancel()
        await asyncio.gather(*self._resends, return_exceptions=True)


class SwitchboardPlayback(FrameProcessor):
    """Reports to the session what the output transport has played: place it right after ``transport.output()``."""

    def __init__(self, brain: SwitchboardBrain) -> None:
        super().__init__()
        self._brain = brain
        self._segment: Segment | None = None
        self._cursor = 0  # in the segment's text: the end of the last word played

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, SegmentMark):
            if frame.end:
                await self._brain._played_to_end(frame.segment)
            else:
                self._segment, self._cursor = frame.segment, 0
            return  # the marks are the brain's and this processor's own
        segment = self._segment
        if segment is not None and not segment.finished and direction == FrameDirection.DOWNSTREAM:
            if isinstance(frame, (TTSAudioRawFrame, BotStartedSpeakingFrame)):
                await self._brain._played(segment, segment.played_chars)
            elif isinstance(frame, TTSTextFrame):
                self._cursor = heard_to(segment.text, self._cursor, frame.text)
                await self._brain._played(segment, self._cursor)
        await self.push_frame(frame, direction)


def heard_to(text: str, cursor: int, spoken: str) -> int:
    """Where in ``text`` the ``spoken`` words end, looking from ``cursor`` on (a word the TTS changed is skipped).

    >>> heard_to("Your table is booked for eight.", 0, "Your table")
    10
    """
    for word in _WORD.findall(spoken):
        found = text.find(word, cursor)
        if found < 0:
            found = text.lower().find(word.lower(), cursor)
        if found >= 0:
            cursor = found + len(word)
    return cursor
