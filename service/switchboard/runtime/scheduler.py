"""SpeechScheduler: one speech plays at a time, by priority and then in the order queued; no trigger is dropped."""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .aio import cancel_and_wait
from .reply import ReplyJob
from .speech import SpeechHandle, SpeechSource

logger = logging.getLogger("switchboard.runtime.scheduler")


class SpeechScheduler:
    """A session's speech queue and the loop that plays it.

    A speech of higher ``priority`` plays before those of lower priority queued earlier; equal priorities play in
    the order queued. An interrupt walks the same order (``interrupt_chain``).

    ``play`` runs one speech to its end; ``finish`` marks a speech done durably (also one that never started, or
    whose task was force-cancelled); ``after_speech`` runs each time a speech has ended.
    """

    def __init__(
        self,
        session_id: str,
        *,
        play: Callable[[ReplyJob], Coroutine[Any, Any, None]],
        finish: Callable[[SpeechHandle], Awaitable[None]],
        after_speech: Callable[[], None],
    ) -> None:
        self.session_id = session_id
        self._play = play
        self._finish = finish
        self._after_speech = after_speech
        self._queue: list[ReplyJob] = []  # in playout order
        # the loop runs only while there is something to play: an idle session holds no task (nor its frame)
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self._stopped = False
        self.current: SpeechHandle | None = None

    @property
    def started(self) -> bool:
        return self._started

    @property
    def queued(self) -> tuple[ReplyJob, ...]:
        return tuple(self._queue)

    @property
    def has_queued(self) -> bool:
        return bool(self._queue)

    @property
    def idle(self) -> bool:
        """No speech playing and none queued."""
        return self.current is None and not self._queue

    def queued_from(self, source: SpeechSource) -> bool:
        """Whether a speech from ``source`` is queued and will play (one an interrupt ended only waits to leave)."""
        return any(job.speech.source == source and not job.speech.interrupted for job in self._queue)

    def push(self, job: ReplyJob) -> None:
        # after every queued speech of the same or a higher priority
        at = bisect.bisect_right([-j.speech.priority for j in self._queue], -job.speech.priority)
        self._queue.insert(at, job)
        self._wake()

    def _wake(self) -> None:
        """Run the loop if something is queued and it is not running (it ends once the queue is empty)."""
        if self._started and not self._stopped and self._queue and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._run(), name=f"scheduler:{self.session_id}")

    def interrupt_chain(self, *, force: bool) -> list[SpeechHandle]:
        """Interrupt the current speech and every queued one after it, in playout order, stopping at the first that
        does not allow interruptions (it plays, and so does all that follows it: no hole in the conversation).
        A speech already interrupted (cancelled by its caller) or done never plays, so it is no barrier.
        ``force`` interrupts the whole chain. Returns the speeches interrupted."""
        chain = [job.speech for job in self._queue]
        if self.current is not None and not self.current.done:
            chain.insert(0, self.current)
        interrupted: list[SpeechHandle] = []
        for speech in chain:
            if speech.interrupted or speech.done:
                continue
            if not (speech.allow_interruptions or force):
                break
            if speech.interrupt(force=force):
                interrupted.append(speech)
        return interrupted

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._wake()

    async def stop(self) -> None:
        """Stop the loop (a speech it was playing is cancelled, then ended); nothing queued later plays."""
        self._stopped = True
        await cancel_and_wait(self._task)

    async def finish_unstarted(self, job: ReplyJob) -> None:
        if job.preemptive is not None:
            await job.preemptive.aclose("barge_in" if job.speech.interrupted else "session_stopped")
        await self._finish_safely(job.speech)

    async def _finish_safely(self, speech: SpeechHandle) -> None:
        # the loop outlives any error in ending one speech: a session that stops playing is deaf to every later input
        try:
            await self._finish(speech)
        except Exception:
            logger.exception(
                "speech %s could not be ended", speech.id, extra={"session_id": self.session_id, "speech_id": speech.id}
            )

    async def end_queued(self) -> None:
        """End every queued speech without playing it (at close, once the loop is stopped)."""
        while self._queue:
            await self.finish_unstarted(self._queue.pop(0))

    async def _run(self) -> None:
        # returns when the queue is empty: nothing can be pushed between that check and the task's end (no await)
        while self._queue:
            job = self._queue.pop(0)
            if job.speech.interrupted:  # ended by an interrupt while it waited (an interrupt walks the queue)
                await self.finish_unstarted(job)
                self._after_speech()
                continue
            self.current = job.speech
            task = asyncio.create_task(self._play(job), name=f"speech:{job.speech.id}")
            # reported by the task itself: a close that stops this loop while it ends the speech must not hide it
            task.add_done_callback(functools.partial(self._report_failure, job.speech))
            job.speech.attach_task(task)
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                await cancel_and_wait(task)
                raise
            finally:
                if not job.speech.done:  # forced cancel (logged by the speech): still end it properly
                    await self._finish_safely(job.speech)
                self.current = None
            self._after_speech()

    def _report_failure(self, speech: SpeechHandle, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "speech %s failed", speech.id, exc_info=task.exception(), extra={"session_id": self.session_id}
            )
