"""Speeches: a session's speeches from the job that makes one to its durable end, and the deferred replies.

A speech is queued only once it is durable (``speech.created`` reports what is, I6), plays in turn through the
``SpeechScheduler`` and ends durably (``CommitPipeline.end_speech``). A tool result that lands outside of any reply
(a background call's, or one re-run after a restart) gets a deferred reply of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Literal

from . import event_types as ev
from .chat import ChatContext, ChatMessage
from .commit import CommitPipeline
from .events import EventLog
from .executor import Outcome, RunningCall
from .generation import Generation
from .ports import Commit, Receipt, completions
from .reply import ReplyJob
from .scheduler import SpeechScheduler
from .speech import SPEECH_PRIORITY_NORMAL, NotInterruptible, SpeechHandle, SpeechInfo, SpeechSource
from .status import SessionStatus

KEEP_SPEECHES = 500
_OVER = (SessionStatus.CLOSING, SessionStatus.CLOSED)


class Speeches:
    """The speeches of one session: ``new_job`` makes one, ``queue_durably`` queues it, ``scheduler`` plays the
    queue and ``finish`` ends each one.

    >>> speeches = Speeches("s1", writes=writes, events=log, chat=chat, state=lambda: session.state,
    ...                     play=play, after_speech=after_speech, allow_interruptions=True, force_timeout_s=5.0)
    >>> speech = await speeches.queue_durably(speeches.new_job("say", text="One moment."))
    """

    def __init__(
        self,
        session_id: str,
        *,
        writes: CommitPipeline,
        events: EventLog,
        chat: ChatContext,
        state: Callable[[], SessionStatus],
        play: Callable[[ReplyJob], Coroutine[Any, Any, None]],
        after_speech: Callable[[], None],
        allow_interruptions: bool,
        force_timeout_s: float,
    ) -> None:
        self.session_id = session_id
        self._writes = writes
        self._events = events
        self._chat = chat
        self._state = state
        self._allow_interruptions = allow_interruptions
        self._force_timeout_s = force_timeout_s
        self.scheduler = SpeechScheduler(session_id, play=play, finish=self.finish, after_speech=after_speech)
        self._handles: dict[str, SpeechHandle] = {}
        # speech id -> the chat version a step of it must see to answer the background results that landed during it
        self._unanswered: dict[str, int] = {}
        self.deferring: asyncio.Task[None] | None = None  # a deferred reply being committed, then queued
        # (a call, its deferred reply): made owed by the call's end being written now (``owed_by_end``)
        self._owed: tuple[RunningCall, ReplyJob] | None = None

    def get(self, speech_id: str) -> SpeechHandle | None:
        return self._handles.get(speech_id)

    def new_job(
        self,
        kind: Literal["reply", "say"],
        *,
        source: SpeechSource | None = None,
        text: str = "",
        instructions: str | None = None,
        add_to_chat: bool = True,
        allow_interruptions: bool | None = None,
        preemptive: Generation | None = None,
        speech_id: str | None = None,
        priority: int = SPEECH_PRIORITY_NORMAL,
        turn_messages: list[ChatMessage] | None = None,
    ) -> ReplyJob:
        speech = SpeechHandle(
            speech_id=speech_id,
            source=source or ("say" if kind == "say" else "reply"),
            allow_interruptions=self._allow_interruptions if allow_interruptions is None else allow_interruptions,
            force_timeout_s=self._force_timeout_s,
            priority=priority,
        )
        if kind == "say":
            speech.text = text  # in the store from the start: a say that is owed when its session moves is played
        self._handles[speech.id] = speech
        if len(self._handles) > KEEP_SPEECHES:
            for old_id in list(self._handles)[: len(self._handles) - KEEP_SPEECHES]:
                if self._handles[old_id].done:
                    del self._handles[old_id]
        return ReplyJob(
            speech=speech,
            kind=kind,
            text=text,
            instructions=instructions,
            add_to_chat=add_to_chat,
            preemptive=preemptive,
            turn_messages=tuple(turn_messages or ()),
        )

    def enqueue(self, job: ReplyJob) -> None:
        """Queue a job whose speech is durable, and report it."""
        self.scheduler.push(job)
        self._events.emit(ev.SpeechCreated(speech_id=job.speech.id, source=job.speech.source))

    async def queue_durably(self, job: ReplyJob, receipt: Receipt[SpeechHandle] | None = None) -> SpeechHandle:
        """Commit the job's speech (with ``receipt``'s completion: it is the command's effect), then queue it."""
        commit = Commit(speeches=[job.speech.info()], receipts=completions(job.speech, receipt))
        await self._writes.commit(commit, then=lambda: self.enqueue(job))
        return job.speech

    def requeue(self, info: SpeechInfo, *, operator: str | None = None) -> None:
        """Queue again a speech that is owed: accepted (durable) and never finished by the process that had the
        session (a move, a crash). A reply is generated anew from the chat as it is now; a say plays its text (an
        operator's say is marked as ``operator``'s, the session's holder). It keeps its id; its ``speech.created``
        was reported when it was accepted."""
        if info.source in ("say", "operator"):
            job = self.new_job(
                "say",
                source="operator" if info.source == "operator" else "say",
                text=info.text,
                speech_id=info.id,
                allow_interruptions=info.allow_interruptions,
            )
            if info.source == "operator":
                job.speech.operator = operator or "operator"
        else:
            source: SpeechSource = "deferred_reply" if info.source == "deferred_reply" else "reply"
            job = self.new_job("reply", source=source, speech_id=info.id, allow_interruptions=info.allow_interruptions)
        self.scheduler.push(job)

    async def interrupt_current(
        self, *, force: bool, receipt: Receipt[SpeechHandle] | None = None
    ) -> SpeechHandle | None:
        """Interrupt the current speech and the queued ones after it (see ``SpeechScheduler.interrupt_chain``);
        returns the current speech once it has ended interrupted, else None. The commit of the interruption carries
        ``receipt``'s completion when this call is what interrupted it."""
        speech = self.scheduler.current
        # a protected speech already interrupted (cancelled with ``force``) or done protects nothing any more
        if speech is not None and not (force or speech.allow_interruptions or speech.interrupted or speech.done):
            raise NotInterruptible(f"speech {speech.id} does not allow interruptions")
        already = speech is not None and speech.interrupted
        self.scheduler.interrupt_chain(force=force)
        if speech is None or speech.done or not speech.interrupted:
            return None
        if receipt is not None and not already:  # before any await: its reply commits the interruption later
            speech.receipts.append(receipt)
        await speech.wait_done()
        return speech

    async def finish(self, speech: SpeechHandle) -> None:
        """Mark ``speech`` done and write its end; ``speech.done`` is reported once the end is durable (I6)."""
        if speech.done:
            return
        speech.mark_done()
        if speech.moved:  # handed over: it stays owed in the store, and the next owner plays it
            return
        if self._unanswered.pop(speech.id, None) is not None and self._state() == SessionStatus.ACTIVE:
            self.schedule_deferred_reply()  # background results that landed during it and no step of it saw
        # in its own task: a caller cancelled meanwhile (the scheduler, at close) must not lose the commit and event
        await asyncio.shield(self._writes.background(self._writes.end_speech(speech), name=f"speech-done:{speech.id}"))

    # -- deferred replies -----------------------------------------------------------------------------------

    @staticmethod
    def _detached_result(rc: RunningCall, needs_reply: bool) -> bool:
        """A result that arrives outside of any reply (background, or re-run after a restart) and asks for one."""
        detached = rc.info.background or rc.speech is None
        return detached and needs_reply and rc.cancel_reason not in ("agent handoff", "session closed")

    def owed_by_end(self, rc: RunningCall, outcome: Outcome) -> list[SpeechInfo]:
        """The deferred reply a call's end makes owed, committed with that end (one transaction): once the result is
        durable, so is the obligation to answer it, whoever runs the session next (a drain, a crash). None when a
        reply already queued, or the speech that made the call and still goes on, will answer it."""
        if not self._detached_result(rc, outcome.needs_reply) or self._state() in _OVER:
            return []
        if rc.speech is not None and (not rc.speech.done or rc.speech.moved):
            return []  # the speech answers it: still going on, or handed over (its next owner plays it again)
        if self._owed is not None or self.deferring is not None or self.scheduler.queued_from("deferred_reply"):
            return []
        job = self.new_job("reply", source="deferred_reply")
        self._owed = (rc, job)
        return [job.speech.info()]

    async def owed_settled(self) -> None:
        """Wait until a call's end that carries a deferred reply (``owed_by_end``) has landed and queued it: a close
        ends every queued speech only once nothing more can be queued."""
        if self._owed is not None:
            await asyncio.shield(self._owed[0].ended_fut)

    def on_tool_result(self, rc: RunningCall, *, durable: bool, active: bool) -> None:
        """A call has ended. The deferred reply its end made owed is queued (reported only, while the session is
        being handed over: its next owner plays it). Otherwise, while the session is active, a result that landed
        while the speech that made the call was still going on is answered by that speech's next step, which sees
        it; a deferred reply is queued (when the speech ends) only if no later step of it does."""
        owed, job = self._owed if self._owed is not None else (None, None)
        if owed is rc and job is not None:
            self._owed = None
            if durable:
                if self._state() == SessionStatus.SUSPENDED:  # owed in the store: its next owner plays it
                    self._events.emit(ev.SpeechCreated(speech_id=job.speech.id, source=job.speech.source))
                    return
                if self._state() in _OVER:
                    job.speech.interrupt(force=True)  # queued only to be ended by the close, never started
                self.enqueue(job)
                return
        if not active or not self._detached_result(rc, rc.needs_reply):
            return
        if rc.speech is not None and not rc.speech.done:
            self._unanswered[rc.speech.id] = self._chat.version
        else:
            self.schedule_deferred_reply()

    def step_sees_results(self, speech: SpeechHandle | None) -> None:
        """A step of ``speech`` is about to be generated from the chat as it is now."""
        if speech is not None and self._unanswered.get(speech.id, self._chat.version + 1) <= self._chat.version:
            del self._unanswered[speech.id]  # this step sees the background results that landed during the speech

    def schedule_deferred_reply(self) -> None:
        # one queued (or being queued) deferred reply covers every result that arrives before it starts
        if self.deferring is not None or self.scheduler.queued_from("deferred_reply"):
            return
        job = self.new_job("reply", source="deferred_reply")
        self.deferring = self._writes.background(self._enqueue_durable(job), name=f"deferred:{self.session_id}")

    async def _enqueue_durable(self, job: ReplyJob) -> None:
        # speech.created is published only once the speech is durable (I6)
        def apply() -> None:
            if self._state() in (SessionStatus.CLOSING, SessionStatus.CLOSED):
                job.speech.interrupt(force=True)  # queued only to be ended by the close, never started
            self.enqueue(job)

        try:
            await self._writes.commit(Commit(speeches=[job.speech.info()]), then=apply)
        finally:
            self.deferring = None


__all__ = ["KEEP_SPEECHES", "Speeches"]
