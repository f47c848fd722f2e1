"""CommitPipeline: how a session's changes become durable, in order, before the live session applies them (I8).

Every change a session makes goes through one pipeline: the write is handed to the store at once, and the change is
applied to the live session (and reported) only after the write before it was applied. A speech's end, which must
never stay unfinished in the store, is written again when the store rejects it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from . import event_types as ev
from .aio import forget_when_done, resolve
from .events import EventLog
from .ports import ChatStore, Commit
from .speech import SpeechHandle

logger = logging.getLogger("switchboard.runtime.session")  # a session's write failures are logged as the session's

# A speech's end is written again when the store rejects it, after each of these pauses: the rejection may belong to
# a write that shared its transaction, and a speech left unfinished in the store would disagree with the live session
# (I8). The attempts after the first SPEECH_END_FULL_ATTEMPTS write it without its text, in case the text is what the
# store refuses (the assistant message keeps what was heard).
SPEECH_END_RETRY_BACKOFF_S = (0.1, 0.4, 1.6)
SPEECH_END_FULL_ATTEMPTS = 2


class CommitPipeline:
    """A session's writes to ``store``, applied in the order they were made; ``events`` reports what is durable.

    >>> writes = CommitPipeline("s1", store=MemoryStore(), events=log)
    >>> await writes.commit(Commit(items=[item]), then=lambda: chat.append(item))
    >>> await writes.settled()  # every write landed and every event reported so far is durable
    """

    def __init__(self, session_id: str, *, store: ChatStore, events: EventLog) -> None:
        self.session_id = session_id
        self.store = store
        self.events = events
        self.tasks: set[asyncio.Task[Any]] = set()  # every write under way, each in a task of its own
        self.failures = 0  # writes the store refused for good (an operator should know)
        # resolved once the last write submitted has been applied (or has failed): writes are applied in order
        self._last_write: asyncio.Future[None] | None = None

    @property
    def pending(self) -> int:
        """Writes (and their events) still on their way to the store."""
        return len(self.tasks)

    async def commit(self, commit: Commit, *, then: Callable[[], None] | None = None) -> None:
        """Write ``commit`` durably, in order with this session's other writes, then run ``then`` (which applies the
        change to the live session and reports it): the two are one unit that a cancelled caller cannot split.

        The store rides out an outage itself (see ``ChatStore``); an error it raises is permanent for that write:
        it is logged and raised to the caller, never retried, so it cannot hold up the session's later writes.
        The write runs in its own task, so a caller that is cancelled (a forced speech cancel, say) does not abort
        it.

        Writes are pipelined: each is handed to the store at once, without waiting for the ones before it to be
        durable (the store keeps a session's commits in call order, so they share a group commit), and each is
        applied only after the one before it, so the live session sees changes in the order they were made.
        """
        previous, applied = self._last_write, asyncio.get_running_loop().create_future()
        self._last_write = applied
        task = self.background(self._write(commit, then, previous, applied), name=f"commit:{self.session_id}")
        await asyncio.shield(task)

    async def _write(
        self,
        commit: Commit,
        then: Callable[[], None] | None,
        previous: asyncio.Future[None] | None,
        applied: asyncio.Future[None],
    ) -> None:
        try:
            try:
                await self.store.commit(
                    self.session_id, commit
                )  # the first step of this task: call order is store order
            except Exception:
                self.failures += 1
                logger.exception(
                    "session %s: commit failed for good", self.session_id, extra={"session_id": self.session_id}
                )
                if previous is not None:
                    await previous
                raise
            if previous is not None:
                await previous
            if then is not None:
                self._apply(then)
        finally:
            resolve(applied, None)

    def _apply(self, then: Callable[[], None]) -> None:
        try:
            then()
        except Exception:
            logger.exception(
                "session %s: a durable change could not be applied",
                self.session_id,
                extra={"session_id": self.session_id},
            )
            raise

    def background(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Run a write (or a step that ends in one) in a task of its own, counted among the writes under way: a
        caller cancelled meanwhile does not lose it, and ``settled`` waits for it. A failure is logged where it arose
        and raised to whoever awaits the task; it is retrieved here too, for a caller that was cut off never will."""
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(forget_when_done(self.tasks))
        return task

    async def end_speech(self, speech: SpeechHandle) -> None:
        """Write the end of ``speech`` and report ``speech.done`` once it is durable (I6).

        Never raises: a speech that cannot be ended in the store still ends in memory (its scheduler goes on to the
        next one)."""
        full = speech.info()
        attempts = len(SPEECH_END_RETRY_BACKOFF_S) + 1
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                await asyncio.sleep(SPEECH_END_RETRY_BACKOFF_S[attempt - 2])
            info = (
                full if attempt <= SPEECH_END_FULL_ATTEMPTS else full.model_copy(update={"text": "", "played_text": ""})
            )
            try:
                await self.commit(Commit(speeches=[info]))
            except Exception:
                logger.error(
                    "session %s: the end of speech %s could not be written (attempt %d of %d)",
                    self.session_id,
                    speech.id,
                    attempt,
                    attempts,
                    extra={"session_id": self.session_id, "speech_id": speech.id},
                )
                continue
            self.events.emit(ev.SpeechDone(speech_id=speech.id, interrupted=speech.interrupted))
            return

    async def settled(self) -> None:
        """Wait until every write under way has landed (a speech's end written again after a store error, a state
        write) and every event reported so far is durable. A closed session is never recovered: what is written or
        reported after its close would stay unreported (I6)."""
        while pending := [task for task in self.tasks if not task.done()]:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.events.flushed()

    async def landed(self) -> None:
        """Wait for the writes under way now, whatever they raise (not for the events they report)."""
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)


__all__ = ["SPEECH_END_FULL_ATTEMPTS", "SPEECH_END_RETRY_BACKOFF_S", "CommitPipeline"]
