"""UserTurn: whether the user is in the middle of a turn, so that a close can wait briefly for its last words."""

from __future__ import annotations

import asyncio
import contextlib

#: how long a close waits for the final transcript of a user turn under way (LiveKit's
#: ``session_close_transcript_timeout``)
CLOSE_TRANSCRIPT_TIMEOUT_S = 2.0


class UserTurn:
    """A user turn is under way from the moment the user is heard talking (a media edge's barge-in, an interim
    transcript) until its final transcript. A close that finds one under way waits up to ``timeout_s`` for that
    transcript (it arrives just after the user stopped, and often just after the caller hung up): it is committed,
    and not answered, since the session is closing (``last_words``)."""

    def __init__(self) -> None:
        # set while a turn is under way, made at its first begin: an idle session (most of them) holds no event
        self._ended_ev: asyncio.Event | None = None
        self.last_words = False  # a close waits for the turn's final transcript: it is recorded, not answered

    @property
    def under_way(self) -> bool:
        return self._ended_ev is not None and not self._ended_ev.is_set()

    def begin(self) -> None:
        if self._ended_ev is None:
            self._ended_ev = asyncio.Event()
        self._ended_ev.clear()

    def end(self) -> None:
        if self._ended_ev is not None:
            self._ended_ev.set()

    async def wait_for_last_words(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for the end of the turn under way; at once when there is none."""
        if self._ended_ev is None or not self.under_way:
            return
        self.last_words = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._ended_ev.wait()


__all__ = ["CLOSE_TRANSCRIPT_TIMEOUT_S", "UserTurn"]
