"""Playout: turns text into timed "audio" and reports what was heard.

The default is a simulated clock (``words_per_second``, after ``first_audio_s`` of time to first audio); a real
TTS/audio sink (a media edge) implements the same protocol. The session never waits for a sink to acknowledge a
stop: it reads ``played_text`` at the moment of the interruption and moves on (I3).

A stream reports when its audio actually starts (``on_playback_started``): the agent is "speaking" from then on,
not from the model's first token. ``PlaybackReport`` is that report for any sink: the simulated clock calls
``started()`` at its first word; a media edge calls it when its ``playback.started`` frame arrives.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Protocol

from .aio import resolve

logger = logging.getLogger("switchboard.runtime.playout")

_WORD = re.compile(r"\S+")
DEFAULT_WORDS_PER_SECOND = 3.0
DEFAULT_FIRST_AUDIO_S = 0.0


class PlaybackReport:
    """Whether a stream's audio has started, and who is told when it does (once, in the order they asked).

    ``started()`` is called by whatever knows audio began; after ``stop()`` it is ignored: audio that never played
    before a stop never started.
    """

    def __init__(self) -> None:
        self._started = False
        self._stopped = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def is_started(self) -> bool:
        return self._started

    def on_started(self, callback: Callable[[], None]) -> None:
        if self._started:
            callback()
        elif not self._stopped:
            self._callbacks.append(callback)

    def started(self) -> None:
        if self._started or self._stopped:
            return
        self._started = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a playback-started callback failed")

    def stop(self) -> None:
        self._stopped = True
        self._callbacks.clear()


class PlayoutStream(Protocol):
    def push(self, text: str) -> None:
        """Queue more text to play."""
        ...

    def end_input(self) -> None:
        """No more text will be pushed; ``wait_done`` resolves once everything queued has played."""
        ...

    @property
    def played_text(self) -> str: ...

    async def wait_done(self) -> None: ...

    def stop(self) -> None:
        """Stop at once. Implementations may acknowledge late or never; callers must not wait for it."""
        ...

    def on_playback_started(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when the first audio of this stream is heard (at once if it already was);
        never for a stream stopped before any audio played."""
        ...


class Playout(Protocol):
    def start(self, speech_id: str) -> PlayoutStream: ...


class ReportedStream:
    """A stream played by an outside sink (a media edge) that reports its playback: ``playback_started()``,
    ``playback_progress(chars)`` and ``playback_finished()`` are what its frames call. What the session pushes goes
    to ``on_text`` (to be sent to the sink); ``on_stop`` is told to stop, and never waited on (I3).

    The heard text is what the sink reported, up to its last position. A sink that reports no positions (no word
    timings; ``reports_positions`` stays false until its first ``playback_progress``) says only that its audio
    started: from then on, what it was sent is the best known heard text (LiveKit commits the generated text the
    same way), so a reply cut after its audio started is not lost from the context."""

    def __init__(
        self,
        *,
        on_text: Callable[[str], None] | None = None,
        on_stop: Callable[[], None] | None = None,
        reports_positions: bool = False,
    ) -> None:
        self._text = ""
        self._played_chars = 0
        self.reports_positions = reports_positions
        self._heard: str | None = None  # settled when the stream stops
        self.input_ended = False
        self._on_text = on_text
        self._on_stop = on_stop
        self._report = PlaybackReport()
        self._done_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def played_text(self) -> str:
        if self._heard is not None:
            return self._heard
        if self._report.is_started and not self.reports_positions:
            return self._text
        return self._text[: self._played_chars]

    @property
    def text(self) -> str:
        """Everything pushed so far (what the sink was sent)."""
        return self._text

    @property
    def played_chars(self) -> int:
        return self._played_chars

    @property
    def ended(self) -> bool:
        """Stopped, or played to its end: later reports change nothing."""
        return self._done_fut.done()

    def push(self, text: str) -> None:
        self._text += text
        if self._on_text is not None:
            self._on_text(text)

    def end_input(self) -> None:
        self.input_ended = True

    async def wait_done(self) -> None:
        await asyncio.shield(self._done_fut)

    def stop(self) -> None:
        if self._done_fut.done():
            return
        self._heard = self.played_text  # text pushed after the stop was never heard
        self._report.stop()
        resolve(self._done_fut, None)
        if self._on_stop is not None:
            self._on_stop()

    def on_playback_started(self, callback: Callable[[], None]) -> None:
        self._report.on_started(callback)

    # -- reports from the sink ------------------------------------------------------------------------------

    def playback_started(self) -> None:
        self._report.started()

    def playback_progress(self, played_chars: int) -> None:
        """The sink has played the first ``played_chars`` characters of the text (never moves back). Ignored once
        the stream ended: the heard text is what was reported before the stop."""
        if self._done_fut.done():
            return
        self.reports_positions = True
        self._played_chars = max(self._played_chars, min(played_chars, len(self._text)))

    def playback_finished(self) -> None:
        """Everything pushed so far has played (ignored once the stream ended)."""
        if self._done_fut.done():
            return
        self._played_chars = len(self._text)
        resolve(self._done_fut, None)


class SimulatedStream:
    """Plays one word every ``1 / words_per_second`` seconds; a word counts as heard once its time has passed.

    Audio starts ``first_audio_s`` after the first text arrives (a TTS's time to first audio)."""

    def __init__(self, words_per_second: float, first_audio_s: float = DEFAULT_FIRST_AUDIO_S) -> None:
        self._word_s = 1.0 / words_per_second
        self._first_audio_s = first_audio_s
        self._report = PlaybackReport()
        self._text = ""
        self._played_chars = 0
        self._input_ended = False
        self._changed = asyncio.Event()
        self._done_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._run(), name="playout")

    @property
    def played_text(self) -> str:
        return self._text[: self._played_chars]

    def push(self, text: str) -> None:
        if self._input_ended:
            raise RuntimeError("push after end_input")
        self._text += text
        self._changed.set()

    def end_input(self) -> None:
        self._input_ended = True
        self._changed.set()

    async def wait_done(self) -> None:
        await asyncio.shield(self._done_fut)

    def stop(self) -> None:
        self._report.stop()
        self._task.cancel()
        resolve(self._done_fut, None)

    def on_playback_started(self, callback: Callable[[], None]) -> None:
        self._report.on_started(callback)

    async def _run(self) -> None:
        try:
            while True:
                match = _WORD.search(self._text, self._played_chars)
                if match is None:
                    if self._input_ended:
                        break
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                if not self._report.is_started:
                    if self._first_audio_s > 0:
                        await asyncio.sleep(self._first_audio_s)
                    self._report.started()  # the first word begins now
                await asyncio.sleep(self._word_s)
                self._played_chars = match.end()
        finally:
            resolve(self._done_fut, None)


class SimulatedPlayout:
    def __init__(
        self, words_per_second: float = DEFAULT_WORDS_PER_SECOND, *, first_audio_s: float = DEFAULT_FIRST_AUDIO_S
    ) -> None:
        if words_per_second <= 0:
            raise ValueError("words_per_second must be positive")
        if first_audio_s < 0:
            raise ValueError("first_audio_s must not be negative")
        self.words_per_second = words_per_second
        self.first_audio_s = first_audio_s

    def start(self, speech_id: str) -> PlayoutStream:
        return SimulatedStream(self.words_per_second, self.first_audio_s)
