"""A session's two ends here: its close, and its hand-over to whoever runs it next (a drain, a graceful restart).

Both run in a task of their own (``AgentSession.aclose``, ``AgentSession.suspend``), to their end whatever happens to
their caller, and in turn with the session's commands (its operation lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from . import event_types as ev
from .aio import cancel_and_wait
from .coach import CoachNotes
from .commit import CommitPipeline
from .events import EventLog
from .executor import ToolExecutor
from .handoff import HandoffStep
from .llm.base import LLM
from .options import SessionOptions
from .ports import Commit, SessionState
from .scheduled import ScheduledCommands, ended_event
from .speculative import Speculation
from .speeches import Speeches
from .status import AgentState, SessionStatus
from .user_turn import UserTurn

T = TypeVar("T")

logger = logging.getLogger("switchboard.runtime.session")

SUSPEND_SPEECH_TIMEOUT_S = 2.0
SUSPEND_FLUSH_TIMEOUT_S = 5.0  # a shutdown waits this long at most for a session's writes and events to be durable


class SessionEnds:
    """The two ends of a live session here, as a base of ``AgentSession`` (which holds what they use): its close,
    and its hand-over to whoever runs it next (a drain, a graceful restart). Each runs in a task of its own, to its
    end whatever happens to its caller, and in turn with the session's commands (its operation lock)."""

    id: str
    state: SessionStatus
    options: SessionOptions
    llm: LLM
    events: EventLog
    writes: CommitPipeline
    executor: ToolExecutor
    handoff: HandoffStep
    speeches: Speeches
    speculation: Speculation
    _op_lock: asyncio.Lock
    _hooks: set[asyncio.Task[Any]]
    _sealed: bool
    user_turn: UserTurn
    scheduled: ScheduledCommands
    coach: CoachNotes

    def snapshot(self) -> SessionState:
        raise NotImplementedError

    def set_agent_state(self, state: AgentState) -> None:
        raise NotImplementedError

    async def commit(self, commit: Commit, *, then: Any = None) -> None:
        raise NotImplementedError

    def _track(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        raise NotImplementedError

    async def _hand_over(self, *, tool_grace: bool) -> None:
        """The body of ``suspend``: hand the session over to whoever runs it next."""
        async with self._op_lock:
            if self.state in (SessionStatus.CLOSING, SessionStatus.CLOSED, SessionStatus.SUSPENDED):
                return
            self.state = SessionStatus.SUSPENDED
        await self.scheduled.stop()  # what is pending stays so in the store, for the next owner
        await self.speculation.abandon()
        await cancel_and_wait(*self._hooks)
        await self._hand_over_speeches()
        if tool_grace:
            await self.executor.grace_for_uncancellable(self.options.shutdown_tool_grace_s)
            await self.handoff.hand_over()
        else:
            await cancel_and_wait(*self.handoff.tasks)  # fenced: recovery elsewhere ends its call
        await self.executor.abandon()
        await self.llm.aclose()
        if not tool_grace:  # fenced: nothing of this session can be written here any more
            await self.writes.landed()
            return
        async with self._op_lock:  # owed input accepted until now is committed (commands hold the lock)
            self._sealed = True
        # every write under way lands and every event reported so far is durable before the process goes; bounded
        # (the store may be going away: recovery then emits the events a durable change lacks), and never cancelling
        # a write that is still under way
        settled = self._track(self.writes.settled(), f"settle:{self.id}")
        done, _ = await asyncio.wait({settled}, timeout=SUSPEND_FLUSH_TIMEOUT_S)
        if not done:
            logger.warning("session %s: suspended before its last writes and events were durable", self.id)

    async def _hand_over_speeches(self) -> None:
        """Stop the speech under way as a move, not an interruption (``SpeechHandle.hand_over``: what was heard is
        committed, the speech stays owed), and stop the scheduler. Queued speeches stay owed as they are in the
        store; those an interrupt already ended while they waited are ended durably now (nothing owes them)."""
        current = self.speeches.scheduler.current
        if current is not None and not current.done:
            current.hand_over()
            with contextlib.suppress(TimeoutError):  # bounded: the store may be going away
                async with asyncio.timeout(SUSPEND_SPEECH_TIMEOUT_S):
                    await current.wait_done()
        await self.speeches.scheduler.stop()
        for job in self.speeches.scheduler.queued:
            if job.speech.interrupted:
                await self.speeches.scheduler.finish_unstarted(job)
            elif job.preemptive is not None:
                await job.preemptive.aclose()

    async def _close(self, reason: str | None = None) -> None:
        """The body of ``aclose``."""
        if self.state == SessionStatus.ACTIVE:  # the user's last words, when they are talking, are not lost
            await self.user_turn.wait_for_last_words(self.options.close_transcript_timeout_s)
        async with self._op_lock:
            if self.state in (SessionStatus.CLOSING, SessionStatus.CLOSED):
                return
            self.state = SessionStatus.CLOSING
        await self.scheduled.stop()  # one being applied finishes; the others are cancelled with the last write
        await self.speculation.discard()
        await cancel_and_wait(*self._hooks)
        if self.speeches.deferring is not None:  # a deferred reply being committed: queue it, then close it
            await asyncio.shield(self.speeches.deferring)
        await self.speeches.owed_settled()  # so is one a call's end is committing with it
        for job in self.speeches.scheduler.queued:
            job.speech.interrupt(force=True)
        current = self.speeches.scheduler.current
        if current is not None:
            current.interrupt(force=True)
            await current.wait_done()
        await self.speeches.scheduler.stop()
        await self.speeches.scheduler.end_queued()
        await self.executor.aclose(timeout_s=self.options.close_timeout_s)
        if self.handoff.tasks:  # each has ended its call by now (or finds it ended by the teardown)
            await asyncio.gather(*self.handoff.tasks, return_exceptions=True)
        await self.llm.aclose()
        await self.executor.stop_repairs()
        await self.writes.settled()
        self.state = SessionStatus.CLOSED
        self.set_agent_state("listening")
        # a call's end the store kept refusing rides on the last write: the session is stored closed only with every
        # call ended (if that write fails too, the store keeps the session live, and recovery settles the call)
        unwritten = self.executor.unwritten_ends()
        last = Commit(session=self.snapshot())
        for record in unwritten:
            last.items.extend(record.items)
            last.tool_calls.append(record.info)
        # what is still pending never applies: cancelled, durably, with the close (reported before session.closed)
        last.pending.extend([*self.scheduled.closing(), *self.coach.closing()])
        try:
            await self.commit(last, then=lambda: self.executor.report_written(unwritten))
        except Exception:  # logged by the pipeline: the store keeps the session live, and recovery settles it
            logger.error("session %s: its close could not be stored; it stays live there", self.id)
            await self.writes.landed()
            return
        for command in last.pending:
            self.events.emit(ended_event(command))
        await self.events.emit(ev.SessionClosed(reason=reason) if reason else ev.SessionClosed())
        await self.writes.landed()


__all__ = ["SUSPEND_FLUSH_TIMEOUT_S", "SUSPEND_SPEECH_TIMEOUT_S", "SessionEnds"]
