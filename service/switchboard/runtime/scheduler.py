"""SpeechScheduler: one speech plays at a time, in the order the speeches were queued; no trigger is dropped."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from .aio import cancel_and_wait
from .reply import ReplyJob
from .speech import SpeechHandle, SpeechSource

logger = logging.getLogger("switchboard.runtime.scheduler")


class SpeechScheduler:
    """A session's speech queue and the loop that plays it.

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
        self._queue: deque[ReplyJob] = deque()
        self._queue_ev = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.current: SpeechHandle | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

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
        return any(job.speech.source == source for job in self._queue)

    def push(self, job: ReplyJob) -> None:
        self._queue.append(job)
        self._queue_ev.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"scheduler:{self.session_id}")

    async def stop(self) -> None:
        """Stop the loop (a speech it was playing is cancelled, then ended)."""
        await cancel_and_wait(self._task)

    async def finish_unstarted(self, job: ReplyJob) -> None:
        await job.preemptive.aclose() if job.preemptive else None
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
            await self.finish_unstarted(self._queue.popleft())

    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._queue_ev.clear()
                await self._queue_ev.wait()
            job = self._queue.popleft()
            if job.speech.interrupted:
                await self.finish_unstarted(job)
                continue
            self.current = job.speech
            task = asyncio.create_task(self._play(job), name=f"speech:{job.speech.id}")
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
            if not task.cancelled() and task.exception() is not None:
                logger.error(
                    "speech %s failed",
                    job.speech.id,
                    exc_info=task.exception(),
                    extra={"session_id": self.session_id},
                )
            self._after_speech()
