"""Playout: turns text into timed "audio" and reports what was heard.

The default is a simulated clock (``words_per_second``); a real TTS/audio sink would implement the same protocol.
The session never waits for a sink to acknowledge a stop: it reads ``played_text`` at the moment of the
interruption and moves on (I3).
"""

from __future__ import annotations

import asyncio
import re
from typing import Protocol

from .aio import resolve

_WORD = re.compile(r"\S+")
DEFAULT_WORDS_PER_SECOND = 3.0


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


class Playout(Protocol):
    def start(self, speech_id: str) -> PlayoutStream: ...


class SimulatedStream:
    """Plays one word every ``1 / words_per_second`` seconds; a word counts as heard once its time has passed."""

    def __init__(self, words_per_second: float) -> None:
        self._word_s = 1.0 / words_per_second
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
        self._task.cancel()
        resolve(self._done_fut, None)

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
                await asyncio.sleep(self._word_s)
                self._played_chars = match.end()
        finally:
            resolve(self._done_fut, None)


class SimulatedPlayout:
    def __init__(self, words_per_second: float = DEFAULT_WORDS_PER_SECOND) -> None:
        if words_per_second <= 0:
            raise ValueError("words_per_second must be positive")
        self.words_per_second = words_per_second

    def start(self, speech_id: str) -> PlayoutStream:
        return SimulatedStream(self.words_per_second)
