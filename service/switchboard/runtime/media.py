"""The media edge: a session's speeches played by an outside edge (a browser, a phone gateway, a LiveKit room agent)
that reports what it played, and drives the session with the user's barge-ins and transcripts (docs/media-edge.md).

``EdgePlayout`` is a session's playout: through the connected edge while there is one, else the configured playout
(the simulated clock). ``MediaEdge`` is one connection's side of the protocol, with no transport: the frames it
sends go to ``send`` (which must not block), the frames it receives are handed to ``handle``.

The session never waits on the edge (I3): an interruption sends ``speech.stop`` and freezes the heard text at the
last ``playback.progress`` received before it; whatever the edge reports about that speech later changes nothing.

An edge that connects with ``resume`` is held for a while when its connection drops (``EdgePlayout.hold``): its
speeches play on, what is sent meanwhile is kept (each frame numbered ``n``), and its next connection (``resume``
with the last ``n`` it consumed) is sent what it missed and goes on where it was.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .media_frames import (
    EdgeFrame,
    FrameRefused,
    PingFrame,
    PlaybackFinishedFrame,
    PlaybackProgressFrame,
    PlaybackStartedFrame,
    PongFrame,
    ResumedFrame,
    SpeechEndFrame,
    SpeechStartFrame,
    SpeechStopFrame,
    SpeechTextFrame,
    UserSpeechStartedFrame,
    UserTranscriptFrame,
    _Frame,
    _ServerFrame,
)
from .playout import Playout, PlayoutStream, ReportedStream
from .receipt import Receipt
from .session import InputResult
from .speech import NotInterruptible, SpeechHandle

logger = logging.getLogger("switchboard.runtime.media")

# the speeches an edge was sent that it may still report on (late reports of older ones are "unknown")
REMEMBERED_STREAMS = 64
# the frames kept for an edge that may resume (about a dozen replies' worth of text deltas): a resume from further
# back is refused, and the edge starts fresh
REPLAY_FRAMES = 1024
# `played_ms` without `played_chars`: a typical speaking rate (150 words a minute of ~6 characters with their space).
# Voices run from ~12 to ~20 characters a second and pause at punctuation: after a few seconds the estimate may be off
# by a word or two either way, so an edge that has word timings sends `played_chars`.
ESTIMATED_CHARS_PER_S = 15.0
_WORD_END = re.compile(r"\S(?=\s|$)")


def chars_at_ms(text: str, played_ms: int) -> int:
    """How many characters of ``text`` a voice has said after ``played_ms`` at ``ESTIMATED_CHARS_PER_S``, back to the
    end of the last whole word (a word cut in its middle is not heard)."""
    estimate = min(len(text), int(played_ms * ESTIMATED_CHARS_PER_S / 1000))
    if estimate == len(text):
        return estimate
    ends = [m.end() for m in _WORD_END.finditer(text, 0, estimate + 1) if m.end() <= estimate]
    return ends[-1] if ends else 0


class EdgeSession(Protocol):
    """What an edge drives (``AgentSession`` implements it)."""

    id: str

    def speech(self, speech_id: str) -> SpeechHandle | None: ...

    @property
    def current_speech(self) -> SpeechHandle | None: ...

    async def interrupt(self, *, force: bool = False) -> SpeechHandle | None: ...

    def user_speaking(self) -> None: ...

    def user_gone(self) -> None: ...

    async def input(
        self, text: str, *, final: bool = True, receipt: Receipt[InputResult] | None = None
    ) -> InputResult: ...


class EdgeStream(ReportedStream):
    """One speech (segment) played by an edge: what is pushed goes out as ``speech.text``, the end of input as
    ``speech.end``, a stop as ``speech.stop``; the edge's ``playback.*`` frames report on it. ``send`` is told which
    stream each frame is about."""

    def __init__(
        self, speech_id: str, send: Callable[[_Frame, EdgeStream], None], *, reports_positions: bool = False
    ) -> None:
        self.speech_id = speech_id
        self._send = send
        self.audio_played_ms: int | None = None  # as the edge reported it (`played_ms`)
        self.audio_before_ms = 0  # the audio of the speech's segments before this one
        super().__init__(
            on_text=lambda delta: send(SpeechTextFrame(speech_id=speech_id, delta=delta), self),
            on_stop=lambda: send(SpeechStopFrame(speech_id=speech_id), self),
            reports_positions=reports_positions,
        )

    def end_input(self) -> None:
        if not self.input_ended:
            super().end_input()
            self._send(SpeechEndFrame(speech_id=self.speech_id), self)

    def mute(self) -> None:
        """Send no ``speech.stop`` when stopped (the edge is gone, or it cut the audio itself)."""
        self._on_stop = None


class MediaEdge:
    """One edge's side of the protocol for one session: one connection's, or several that resume each other."""

    def __init__(
        self,
        session: EdgeSession,
        send: Callable[[_Frame], None],
        *,
        max_text_chars: int = 8000,
        on_close: Callable[[], None] | None = None,
        replay_frames: int = 0,
    ) -> None:
        self.session = session
        self._send: Callable[[_Frame], None] | None = send  # None while held (no connection)
        self._on_close = on_close
        self._n = 0  # the last frame's position
        # what was sent, for a resume (the last ``replay_frames``; none for an edge that does not resume): each frame
        # with the stream it is about (a speech segment), if any
        self._sent: deque[tuple[_ServerFrame, EdgeStream | None]] = deque(maxlen=replay_frames)
        self._max_text_chars = max_text_chars
        self._streams: OrderedDict[str, EdgeStream] = OrderedDict()
        # it has sent a `playback.progress`: it reports what was heard, so a speech cut before its first position of
        # its own was heard up to nothing (not everything it was sent, as for an edge with no word timings)
        self._reports_positions = False
        self.gone = False

    @property
    def held(self) -> bool:
        """Its connection dropped and it waits for the next one (``EdgePlayout.hold``)."""
        return self._send is None and not self.gone

    def send(self, frame: _Frame, about: EdgeStream | None = None) -> None:
        """Send ``frame`` (numbered and kept for a resume; ``about``: the stream it is about)."""
        if self.gone:
            return
        if isinstance(frame, _ServerFrame):  # not a pong: the answer to a ping is for the connection that sent it
            self._n += 1
            frame = frame.model_copy(update={"n": self._n})
            if self._sent.maxlen:
                self._sent.append((frame, about))
        if self._send is not None:
            self._send(frame)

    def sends_to(self, send: Callable[[_Frame], None]) -> bool:
        """Whether its frames go to ``send`` (the connection it was resumed on last)."""
        return self._send == send

    def suspend(self) -> None:
        """Its connection dropped: what is sent from now on is only kept, for the next connection to resume."""
        self._send = None

    def resume(self, after: int, send: Callable[[_Frame], None], on_close: Callable[[], None] | None) -> bool:
        """Go on over another connection (``send``) from the frame after ``after``: it is sent ``resumed`` and the
        frames it missed that still matter (not the segments that both began and were stopped since). False when the
        frames after ``after`` are no longer all kept (or ``after`` was never sent): nothing is sent then."""
        first = self._sent[0][0].n if self._sent else self._n + 1
        assert first is not None
        if not self._sent.maxlen or not first - 1 <= after <= self._n:
            return False
        missed = [(frame, stream) for frame, stream in self._sent if frame.n is not None and frame.n > after]
        unseen = {id(s) for f, s in missed if isinstance(f, SpeechStartFrame) and s is not None and s.ended}
        replaced, self._send, self._on_close = self._on_close, send, on_close
        if replaced is not None:
            replaced()  # an earlier connection not yet seen to be gone: it sees that it was replaced
        send(ResumedFrame(after=after))
        for frame, stream in missed:
            if stream is None or id(stream) not in unseen:
                send(frame)
        return True

    # -- server -> edge ---------------------------------------------------------------------------------------

    def open_stream(self, speech_id: str) -> EdgeStream:
        speech = self.session.speech(speech_id)
        allow = speech.allow_interruptions if speech is not None else True
        stream = EdgeStream(speech_id, self.send, reports_positions=self._reports_positions)
        if speech is not None:
            stream.audio_before_ms = speech.audio_played_ms or 0
        self._streams.pop(speech_id, None)  # a further segment of the same speech replaces the one before
        self._streams[speech_id] = stream
        while len(self._streams) > REMEMBERED_STREAMS:
            self._streams.popitem(last=False)
        self.send(SpeechStartFrame(speech_id=speech_id, allow_interruptions=allow), stream)
        if speech is not None:
            # stopped at the moment of the interruption: progress that arrives after it is not heard text
            speech.on_interrupted(stream.stop)
        return stream

    # -- edge -> server ---------------------------------------------------------------------------------------

    async def handle(self, frame: EdgeFrame) -> None:
        """Apply one frame from the edge; ``FrameRefused`` when it is wrong (the session is unharmed)."""
        if isinstance(frame, PlaybackProgressFrame):
            self._progress(frame)
        elif isinstance(frame, PlaybackStartedFrame):
            stream = self._stream(frame.speech_id, frame.type)
            stream.playback_started()
        elif isinstance(frame, PlaybackFinishedFrame):
            self._finished(frame)
        elif isinstance(frame, UserSpeechStartedFrame):
            await self._barge_in()
        elif isinstance(frame, UserTranscriptFrame):
            await self._transcript(frame)
        elif isinstance(frame, PingFrame):
            self.send(PongFrame())

    def _stream(self, speech_id: str, frame_type: str) -> EdgeStream:
        stream = self._streams.get(speech_id)
        if stream is None:
            raise FrameRefused("unknown_speech", f"speech {speech_id[:80]!r} was not sent to this edge", frame_type)
        return stream

    def _progress(self, frame: PlaybackProgressFrame) -> None:
        stream = self._stream(frame.speech_id, frame.type)
        self._reports_positions = True
        if stream.ended:
            return  # stopped or finished: what was heard is settled
        last_ms = stream.audio_played_ms
        if frame.played_ms is not None and last_ms is not None and frame.played_ms < last_ms:
            raise FrameRefused(
                "played_ms_backwards",
                f"played_ms {frame.played_ms} is before {last_ms}, already reported",
                frame.type,
            )
        played_chars = frame.played_chars
        if played_chars is None:  # a player's position only: estimated, never backwards
            played_chars = max(stream.played_chars, chars_at_ms(stream.text, frame.played_ms or 0))
        if played_chars > len(stream.text):
            raise FrameRefused(
                "played_chars_beyond_text",
                f"played_chars {played_chars} is beyond the {len(stream.text)} characters sent",
                frame.type,
            )
        if played_chars < stream.played_chars:
            raise FrameRefused(
                "played_chars_backwards",
                f"played_chars {played_chars} is before {stream.played_chars}, already reported",
                frame.type,
            )
        if frame.played_ms is not None:
            stream.audio_played_ms = frame.played_ms
            speech = self.session.speech(stream.speech_id)
            if speech is not None:
                speech.audio_played_ms = stream.audio_before_ms + frame.played_ms
        if played_chars > 0 or (frame.played_ms or 0) > 0:
            stream.playback_started()  # heard audio: an edge that skipped playback.started is speaking
        stream.playback_progress(played_chars)

    def _finished(self, frame: PlaybackFinishedFrame) -> None:
        stream = self._stream(frame.speech_id, frame.type)
        if stream.ended:
            return  # after a speech.stop: changes nothing committed
        if frame.interrupted:
            self._cut(stream)
            return
        if not stream.input_ended:
            raise FrameRefused(
                "speech_not_ended", "playback.finished before speech.end: more text is coming", frame.type
            )
        stream.playback_finished()

    def stops_current(self) -> bool:
        """Whether a barge-in now stops a speech this edge is playing (it is sent ``speech.stop``)."""
        current = self.session.current_speech
        if current is None or current.done or current.interrupted or not current.allow_interruptions:
            return False
        stream = self._streams.get(current.id)
        return stream is not None and not stream.ended

    async def _barge_in(self) -> None:
        self.session.user_speaking()  # a close now waits briefly for the final transcript
        current = self.session.current_speech
        if current is not None and current.allow_interruptions and not current.done:
            # at once, before the command's turn comes: its audio stops and its waits are released now (I3); the
            # command then interrupts the queued speeches after it and returns once the heard text is committed
            current.interrupt()
        try:
            await self.session.interrupt()
        except NotInterruptible:
            pass  # the speech said so in its speech.start: it plays on

    async def _transcript(self, frame: UserTranscriptFrame) -> None:
        await self.transcript(frame)

    async def transcript(self, frame: UserTranscriptFrame, receipt: Receipt[InputResult] | None = None) -> InputResult:
        """Apply a transcript; ``receipt`` (the service's, for a final transcript's ``id``) is completed by the commit
        of the input, which makes the transcript taken at most once."""
        self.check_text(frame)
        return await self.session.input(frame.text, final=frame.final, receipt=receipt)

    def check_text(self, frame: UserTranscriptFrame) -> None:
        """``FrameRefused`` (``text_too_long``) for a transcript longer than the session takes."""
        if len(frame.text) > self._max_text_chars:
            raise FrameRefused(
                "text_too_long", f"text: at most {self._max_text_chars} characters", frame.type, frame.id
            )

    # -- the end of the connection ----------------------------------------------------------------------------

    def _cut(self, stream: EdgeStream) -> None:
        """The audio of ``stream`` ended early: its speech ends interrupted at the last reported position."""
        stream.mute()
        speech = self.session.speech(stream.speech_id)
        if speech is not None and not speech.done:
            speech.interrupt(force=True)  # first: the reply must see an interruption, not a finished playout
        stream.stop()

    def close(self) -> None:
        """The edge is gone (disconnected or replaced): a speech it was playing ends interrupted where it was last
        reported; nothing more is sent to it."""
        if self.gone:
            return
        self.gone = True
        self.session.user_gone()  # no transcript comes from an edge that left: a close waits for none
        for stream in list(self._streams.values()):
            if not stream.ended:
                logger.info(
                    "session %s: the media edge left during speech %s; it ends interrupted",
                    self.session.id,
                    stream.speech_id,
                    extra={"session_id": self.session.id, "speech_id": stream.speech_id},
                )
                self._cut(stream)
        self._streams.clear()
        if self._on_close is not None:
            self._on_close()


@dataclass(frozen=True)
class EdgeConnection:
    """Which edge a connection comes from (an id the edge chose for its run) and its number among that edge's
    connections, counting up from 1."""

    edge_id: str
    number: int


class StaleConnection(Exception):
    """An edge's connection older than one of its own already taken: an attempt it gave up on (its node was paused,
    or the network held it), delivered late. Taken, it would replace the edge's live connection."""


class EdgePlayout:
    """A session's playout: through the connected edge, else ``fallback`` (the configured playout)."""

    def __init__(self, fallback: Playout) -> None:
        self.fallback = fallback
        self.edge: MediaEdge | None = None
        self.latest: EdgeConnection | None = None  # the last numbered connection taken
        self._edge_id: str | None = None  # the connected edge's, when it numbers its connections
        self._hold: asyncio.TimerHandle | None = None  # when the held edge is let go

    def start(self, speech_id: str) -> PlayoutStream:
        if self.edge is not None:
            return self.edge.open_stream(speech_id)
        return self.fallback.start(speech_id)

    def _check(self, connection: EdgeConnection | None) -> None:
        latest = self.latest
        if connection is None or latest is None:
            return
        if latest.edge_id == connection.edge_id and connection.number <= latest.number:
            raise StaleConnection

    def attach(self, edge: MediaEdge, connection: EdgeConnection | None = None) -> MediaEdge | None:
        """Play through ``edge`` from now on; returns the edge it replaces (the caller closes it). Another edge, or
        one that does not number its connections, replaces the edge connected; a connection of the same edge is taken
        only if newer than the last one taken (else ``StaleConnection``), whether that one is still connected or not."""
        self._check(connection)
        if connection is not None:
            self.latest = connection
        self._let_go()
        self._edge_id = connection.edge_id if connection is not None else None
        previous, self.edge = self.edge, edge
        return previous

    def resume(
        self,
        connection: EdgeConnection,
        after: int,
        send: Callable[[_Frame], None],
        on_close: Callable[[], None] | None = None,
    ) -> MediaEdge | None:
        """The edge ``connection`` comes from goes on over it from the frame after ``after`` (``MediaEdge.resume``),
        held or still connected (its earlier connection, not yet seen to be gone, is dropped); None when it cannot (not
        this session's edge here, or ``after`` too old): the caller attaches a new one. ``StaleConnection`` as
        ``attach``."""
        self._check(connection)
        edge = self.edge
        if edge is None or edge.gone or self._edge_id != connection.edge_id or not edge.resume(after, send, on_close):
            return None
        self.latest = connection
        self._let_go()
        return edge

    def hold(self, edge: MediaEdge, hold_s: float) -> bool:
        """``edge``'s connection dropped: keep playing through it for ``hold_s`` (its speeches stay under way, what is
        sent is kept) for a connection that resumes it; then it is closed, as an edge that left. False when ``edge``
        is not this session's numbered edge any more (the caller closes it)."""
        if self.edge is not edge or self._edge_id is None or edge.gone:
            return False
        edge.suspend()
        self._let_go()
        self._hold = asyncio.get_running_loop().call_later(hold_s, self._expire, edge)
        return True

    def _expire(self, edge: MediaEdge) -> None:
        self._hold = None
        if self.edge is edge and edge.held:
            self.edge = None
            edge.close()

    def _let_go(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    def detach(self, edge: MediaEdge) -> None:
        """``edge`` left: back to the fallback, unless another edge already replaced it."""
        if self.edge is edge:
            self.edge = None


__all__ = ["EdgeConnection", "EdgePlayout", "EdgeSession", "EdgeStream", "MediaEdge", "StaleConnection"]
