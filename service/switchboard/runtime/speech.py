"""SpeechHandle: one unit of agent output, as a bundle of futures.

Every wait on a speech races its interrupt future, so an interruption unblocks waiters at once (I3), without any
audio sink having to acknowledge anything. The forced cancel after ``force_timeout_s`` is only a safety net.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from .aio import first_of, resolve
from .chat import new_id, utcnow

if TYPE_CHECKING:
    from .receipt import Receipt

logger = logging.getLogger("switchboard.runtime.speech")

INTERRUPT_FORCE_TIMEOUT_S = 5.0

# a speech of higher priority plays before queued speeches of lower priority; equal ones play in the order queued
SPEECH_PRIORITY_LOW = 0
SPEECH_PRIORITY_NORMAL = 5
SPEECH_PRIORITY_HIGH = 10

SpeechSource = Literal["reply", "say", "tool_reply", "deferred_reply", "operator"]


class SpeechInterrupted(Exception):
    """Raised by a wait on a speech that was interrupted."""

    def __init__(self, speech_id: str) -> None:
        super().__init__(f"speech {speech_id} was interrupted")
        self.speech_id = speech_id


class NotInterruptible(Exception):
    """The speech does not allow interruptions (pass ``force=True`` to interrupt anyway)."""


class CircularWait(RuntimeError):
    """A tool call in the foreground waited for the playout of its own speech, or of one queued after it: that
    speech waits for the call to end, so only an interruption could end the wait."""


class WaitingCall(Protocol):
    """A tool call, as a wait on a speech sees it (the executor's ``RunningCall``)."""

    @property
    def name(self) -> str: ...

    @property
    def speech(self) -> SpeechHandle | None: ...

    @property
    def foreground(self) -> bool: ...

    @property
    def tool_task(self) -> asyncio.Task[Any] | None: ...


#: The tool call whose body runs in this context (set by the executor for the body's task).
RUNNING_CALL: ContextVar[WaitingCall | None] = ContextVar("switchboard_running_call", default=None)


class SpeechState(StrEnum):
    SCHEDULED = "scheduled"
    GENERATING = "generating"
    PLAYING = "playing"
    DONE = "done"


class SpeechUsage(BaseModel):
    """Tokens the model used for a speech, summed over its generation steps."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int = 0
    completion_tokens: int = 0


class SpeechInfo(BaseModel):
    """The persisted / API view of a speech."""

    id: str
    source: str
    state: SpeechState
    interrupted: bool
    allow_interruptions: bool
    text: str
    played_text: str
    created_at: datetime
    usage: SpeechUsage = Field(default_factory=SpeechUsage)
    #: What has been heard so far, the step playing now included: only in a live read (``SessionView.speech``)
    heard_text: str | None = None
    #: The audio played, all segments, as a media edge reported it (``played_ms``): kept while the session runs, not
    #: stored
    audio_played_ms: int | None = None


class SpeechHandle:
    """A handle on one speech. Created by the session; safe to wait on from anywhere."""

    # Counts safety-net firings process-wide; tests assert it stays at zero in normal flows.
    forced_cancels = 0

    def __init__(
        self,
        *,
        source: SpeechSource,
        allow_interruptions: bool = True,
        speech_id: str | None = None,
        force_timeout_s: float = INTERRUPT_FORCE_TIMEOUT_S,
        priority: int = SPEECH_PRIORITY_NORMAL,
    ) -> None:
        self.id = speech_id or new_id("speech")
        self.source = source
        self.allow_interruptions = allow_interruptions
        self.priority = priority
        self.created_at = utcnow()
        self.state = SpeechState.SCHEDULED
        self.text = ""  # generated text, all steps
        self.played_text = ""  # heard text, all steps
        self.audio_played_ms: int | None = None  # all steps, when the sink reports its audio position
        # the step playing now: what was heard before it, and how to read what it has played so far
        self._hearing: tuple[str, Callable[[], str]] | None = None
        self.usage = SpeechUsage()  # model tokens, all steps
        self.force_timeout_s = force_timeout_s
        self.forced = False
        self.started = False  # has begun playing
        # stopped because its session moves to another process (a drain, a graceful restart), not by the user: what
        # was heard is committed, and the speech stays owed (not done in the store) for the next owner to play
        self.moved = False
        self.operator: str | None = None  # an operator's words, said as the agent (``runtime.takeover``)
        loop = asyncio.get_running_loop()
        self._interrupt_fut: asyncio.Future[None] = loop.create_future()
        self._done_fut: asyncio.Future[None] = loop.create_future()
        self._steps: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[Any] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._on_interrupted: list[Callable[[], None]] = []
        # the idempotency receipt of the operator command that interrupted it: answered by its interruption's commit
        self.receipts: list[Receipt[SpeechHandle]] = []

    def __repr__(self) -> str:
        return f"<SpeechHandle {self.id} {self.source} {self.state}{' interrupted' if self.interrupted else ''}>"

    @property
    def interrupted(self) -> bool:
        return self._interrupt_fut.done()

    @property
    def done(self) -> bool:
        return self._done_fut.done()

    @property
    def step(self) -> int:
        """Index of the current generation step (0 is the first reply, 1.. are tool replies)."""
        return max(len(self._steps) - 1, 0)

    def follow_playout(self, played_text: Callable[[], str]) -> None:
        """A step begins to play: ``played_text()`` reads what it has played so far (``heard_text``)."""
        self._hearing = (self.played_text, played_text)

    @property
    def heard_text(self) -> str:
        """What has been heard so far: ``played_text`` of the steps before, and the current step up to now. Read on
        demand (a media edge's or the simulated clock's position): no event per word."""
        if self._hearing is None or self.done:
            return self.played_text
        before, now = self._hearing
        return f"{before} {now()}".strip()

    def info(self) -> SpeechInfo:
        return SpeechInfo(
            id=self.id,
            source=self.source,
            state=self.state,
            interrupted=self.interrupted and not self.moved,  # a move is not an interruption: the speech is owed
            allow_interruptions=self.allow_interruptions,
            text=self.text,
            played_text=self.played_text,
            created_at=self.created_at,
            usage=self.usage,
            audio_played_ms=self.audio_played_ms,
        )

    def add_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.usage = SpeechUsage(
            prompt_tokens=self.usage.prompt_tokens + prompt_tokens,
            completion_tokens=self.usage.completion_tokens + completion_tokens,
        )

    # -- control --------------------------------------------------------------------------------------------

    def interrupt(self, *, force: bool = False) -> bool:
        """Interrupt the speech. Returns False when it had already finished (a no-op).

        Raises ``NotInterruptible`` when the speech disallows interruptions and ``force`` is false.
        """
        if self.done:
            return False
        if self.interrupted:
            return True
        if not self.allow_interruptions and not force:
            raise NotInterruptible(f"speech {self.id} does not allow interruptions")
        callbacks, self._on_interrupted = self._on_interrupted, []
        for callback in callbacks:
            # in this very call, and first: what plays the speech stops (a media edge is sent its stop) before the
            # waiters below wake, so the stop goes out ahead of the work the interruption sets off
            try:
                callback()
            except Exception:
                logger.exception("an interrupt callback of speech %s failed", self.id)
        resolve(self._interrupt_fut, None)
        if self._task is not None and self._watchdog is None:
            loop = asyncio.get_running_loop()
            self._watchdog = loop.call_later(self.force_timeout_s, self._force_cancel)
        return True

    def hand_over(self) -> bool:
        """Stop the speech because its session moves to another process: every wait on it is released at once, as
        by an interrupt (I3), but it is not an interruption. The reply loop commits what was heard and leaves the
        speech unfinished in the store, and the session's next owner plays it (``runtime.recovery``). Returns False
        when it had already finished; a speech the user had already interrupted stays interrupted."""
        if self.done:
            return False
        if not self.interrupted:
            self.moved = True
        return self.interrupt(force=True)

    def on_interrupted(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the speech is interrupted, within ``interrupt()`` (at once if it already was):
        what plays the speech stops at that instant, so nothing it reports later counts as heard. ``interrupted``
        is not yet true while it runs."""
        if self.interrupted:
            callback()
        else:
            self._on_interrupted.append(callback)

    def _force_cancel(self) -> None:
        if self.done or self._task is None or self._task.done():
            return
        SpeechHandle.forced_cancels += 1
        self.forced = True
        logger.error(
            "speech %s did not stop within %.1fs of its interruption; cancelling it",
            self.id,
            self.force_timeout_s,
            extra={"speech_id": self.id},
        )
        self._task.cancel()

    # -- waits ----------------------------------------------------------------------------------------------

    async def wait_for_playout(self) -> None:
        """Wait until the speech has finished playing; raises ``SpeechInterrupted`` at once when interrupted.

        Raises ``CircularWait`` at once when called by a tool in the foreground for its own speech, or for one queued
        after it (that speech waits for the tool): it would wait until something interrupts it. A tool waits for its
        preamble with ``ctx.wait_for_playout()``, or moves to the background (``ctx.update()``) first."""
        self._refuse_circular_wait()
        finished, _ = await first_of(self._done_fut, self._interrupt_fut)
        if not finished or self.interrupted:
            raise SpeechInterrupted(self.id)

    async def wait_done(self) -> None:
        """Wait until the speech is completely done (interrupted or not). Cancelling the waiter is harmless.
        ``CircularWait`` as for ``wait_for_playout``."""
        self._refuse_circular_wait()
        await asyncio.shield(self._done_fut)

    def _refuse_circular_wait(self) -> None:
        call = RUNNING_CALL.get()
        if call is None or call.tool_task is not asyncio.current_task() or self.done or self.interrupted:
            return  # not a tool's own body (a task it spawned is not held up by its speech), or nothing to wait for
        own = call.speech
        if own is None or own.done or own.interrupted or not call.foreground:
            return  # its speech no longer waits for it
        whose = "its own speech" if own is self else f"speech {self.id}, queued after its own"
        raise CircularWait(
            f"tool {call.name} waited, in the foreground, for the playout of {whose}: a circular wait (that speech "
            "waits for the tool). Use ctx.wait_for_playout() for the preamble, or ctx.update() first."
        )

    async def wait_for_interrupt(self) -> None:
        await asyncio.shield(self._interrupt_fut)

    async def wait_for_step(self, step: int) -> None:
        """Wait for the playout of one generation step (what a tool's ``wait_for_playout`` means).

        Raises ``SpeechInterrupted`` as soon as the speech is interrupted, even if that step had played.
        """
        if step >= len(self._steps):
            raise ValueError(f"speech {self.id} has no step {step}")
        finished, _ = await first_of(self._steps[step], self._interrupt_fut)
        if not finished or self.interrupted:
            raise SpeechInterrupted(self.id)

    async def wait_if_not_interrupted(self, aws: Sequence[Awaitable[Any]]) -> bool:
        """Wait for all of ``aws`` unless the speech is interrupted first. Returns True if they all finished.

        Futures passed in are never cancelled; coroutines are run as tasks and cancelled on interruption.
        """
        if not aws:
            return not self.interrupted

        async def _all() -> None:
            await asyncio.gather(*aws)

        return await self.run_unless_interrupted(_all())

    async def run_unless_interrupted(self, aw: Awaitable[Any]) -> bool:
        """Await ``aw`` unless the speech is interrupted first. Returns True if ``aw`` finished first.

        An exception ``aw`` raises propagates. A coroutine is cancelled on interruption; a future is not.
        """
        finished, _ = await first_of(aw, self._interrupt_fut)
        return finished

    # -- driven by the session's scheduler and the reply loop ------------------------------------------------

    def attach_task(self, task: asyncio.Task[Any]) -> None:
        """The task playing this speech: the one the safety net cancels if an interruption is ignored."""
        self._task = task

    def begin_step(self) -> int:
        """Open the next generation step (its playout is what a tool's ``wait_for_playout`` waits for)."""
        self._steps.append(asyncio.get_running_loop().create_future())
        return len(self._steps) - 1

    def end_step(self) -> None:
        """The current step has played: release the tools waiting for it."""
        if self._steps:
            resolve(self._steps[-1], None)

    def mark_generating(self) -> None:
        self.state = SpeechState.GENERATING

    def mark_playing(self) -> bool:
        """The speech plays (again, after a tool step). Returns True the first time, when it starts playing."""
        self.state = SpeechState.PLAYING
        first, self.started = not self.started, True
        return first

    def mark_done(self) -> None:
        self.state = SpeechState.DONE
        for fut in self._steps:
            resolve(fut, None)
        if self._watchdog is not None:
            self._watchdog.cancel()
        resolve(self._done_fut, None)
