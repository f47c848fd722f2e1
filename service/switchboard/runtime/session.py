"""AgentSession: one live conversation — chat context, current agent, speech scheduler, tools and event log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from .agent import Agent
from .aio import cancel_and_wait
from .chat import AgentHandoff, ChatContext, ChatItem, ChatMessage, FunctionCall, new_id
from .events import EventLog
from .executor import RunningCall, ToolExecutor
from .generation import Generation
from .llm.base import LLM, LLMRequest
from .playout import Playout
from .ports import ChatStore, Commit, EventSink, SessionState, StoreUnavailable
from .reply import ReplyJob, run_job
from .speech import INTERRUPT_FORCE_TIMEOUT_S, NotInterruptible, SpeechHandle, SpeechSource
from .tools import ToolCallInfo, ToolStatus

logger = logging.getLogger("switchboard.runtime.session")

COMMIT_RETRY_MAX_S = 2.0
SUSPEND_SPEECH_TIMEOUT_S = 2.0
KEEP_SPEECHES = 500
Role = Literal["user", "system", "developer"]
AgentState = Literal["initializing", "listening", "thinking", "speaking"]


class SessionOptions(BaseModel):
    max_tool_steps: int = Field(default=3, ge=0, le=20)
    preemptive_generation: bool = False
    allow_interruptions: bool = True
    interrupt_force_timeout_s: float = Field(default=INTERRUPT_FORCE_TIMEOUT_S, gt=0)
    tool_cancel_grace_s: float = Field(default=1.0, ge=0)
    close_timeout_s: float = Field(default=30.0, gt=0)


class SessionClosed(Exception):
    pass


@dataclass(frozen=True)
class InputResult:
    item_id: str | None
    speech_id: str | None


class AgentSession:
    """A live session. Everything it changes is committed through ``store`` and reported through ``events``.

    >>> session = AgentSession(session_id="s1", agent=MyAgent(), llm=ScriptedLLM(...),
    ...                        playout=SimulatedPlayout(), store=MemoryStore(), events=MemoryEventLog())
    >>> await session.start(); await session.input("hi"); await session.aclose()
    """

    def __init__(
        self,
        *,
        session_id: str,
        agent: Agent,
        llm: LLM,
        playout: Playout,
        store: ChatStore,
        events: EventSink,
        options: SessionOptions | None = None,
        items: Iterable[ChatItem] = (),
        last_seq: int = 0,
    ) -> None:
        self.id = session_id
        self.agent = agent
        self.llm = llm
        self.playout = playout
        self.options = options or SessionOptions()
        self.chat = ChatContext(items)
        self.events = EventLog(session_id, events, last_seq=last_seq)
        self.state: str = "initializing"
        self.agent_state: AgentState = "initializing"
        self._store = store
        self.executor = ToolExecutor(
            session_id,
            chat=self.chat,
            events=self.events,
            commit=self.commit,
            on_ended=self._on_call_ended,
            on_handoff=self._handoff,
            cancel_grace_s=self.options.tool_cancel_grace_s,
        )
        self._queue: deque[ReplyJob] = deque()
        self._queue_ev = asyncio.Event()
        self._current: SpeechHandle | None = None
        self._speeches: dict[str, SpeechHandle] = {}
        self._op_lock = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self._writes: set[asyncio.Task[None]] = set()
        self._scheduler_task: asyncio.Task[None] | None = None
        self._speculative: Generation | None = None
        self._interim_text: str | None = None
        self._preempt_pending = False
        self._deferred_scheduling: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<AgentSession {self.id} {self.state} agent={self.agent.name}>"

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self, *, recovered: bool = False, **event_data: Any) -> None:
        if self._scheduler_task is not None:
            return
        self.state = "active"
        await self.commit(Commit(session=self.snapshot()))
        self.events.emit("session.recovered" if recovered else "session.started", agent=self.agent.name, **event_data)
        self._set_agent_state("listening")
        self._scheduler_task = asyncio.create_task(self._schedule_loop(), name=f"scheduler:{self.id}")

    async def suspend(self) -> None:
        """Stop this session's work without closing it (service shutdown): it stays live in the store and is
        recovered on the next start, exactly as after a crash, but with every pending write flushed."""
        if self.state in ("closing", "closed", "suspended"):
            return
        self.state = "suspended"
        spec, self._speculative = self._speculative, None
        if spec is not None:
            await spec.aclose()
        current = self._current
        if current is not None and not current.done:
            # what the user heard is committed, as with any interruption; bounded, the store may be going away
            current.interrupt(force=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SUSPEND_SPEECH_TIMEOUT_S):
                    await current.wait_done()
        await cancel_and_wait(self._scheduler_task)
        for job in self._queue:
            if job.preemptive is not None:
                await job.preemptive.aclose()
        await self.executor.abandon()
        await self.llm.aclose()
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def aclose(self) -> None:
        """Close: stop speaking, cancel cancellable tools, await the others, emit the final events."""
        if self.state in ("closing", "closed"):
            return
        self.state = "closing"
        await self._discard_speculative()
        if self._deferred_scheduling is not None:  # a deferred reply being committed: queue it, then close it
            await asyncio.shield(self._deferred_scheduling)
        for job in list(self._queue):
            job.speech.interrupt(force=True)
        if self._current is not None:
            self._current.interrupt(force=True)
            await self._current.wait_done()
        await cancel_and_wait(self._scheduler_task)
        while self._queue:
            await self._finish_unstarted(self._queue.popleft())
        await self.executor.aclose(timeout_s=self.options.close_timeout_s)
        await self.llm.aclose()
        self.state = "closed"
        self._set_agent_state("listening")
        await self.commit(Commit(session=self.snapshot()))
        await self.events.emit("session.closed")
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    def snapshot(self) -> SessionState:
        return SessionState(
            agent=self.agent.name,
            state=self.state,
            llm_state=self.llm.save_state(),
            current_speech_id=self._current.id if self._current else None,
        )

    # -- queries --------------------------------------------------------------------------------------------

    @property
    def current_speech(self) -> SpeechHandle | None:
        return self._current

    def speech(self, speech_id: str) -> SpeechHandle | None:
        return self._speeches.get(speech_id)

    def tool_calls(self, status: ToolStatus | None = None) -> list[ToolCallInfo]:
        return [rc.info for rc in self.executor.calls() if status is None or rc.info.status == status]

    def tool_call(self, call_id: str) -> ToolCallInfo | None:
        rc = self.executor.get(call_id)
        return rc.info if rc else None

    @property
    def remembers_every_tool_call(self) -> bool:
        """False once older ended calls were dropped from memory (the store keeps every call)."""
        return self.executor.forgotten == 0

    async def wait_tool_call(self, call_id: str) -> None:
        """Return once the call has ended (at once when it is unknown); cancelling the wait does not cancel it."""
        rc = self.executor.get(call_id)
        if rc is not None:
            await asyncio.shield(rc.ended_fut)

    # -- operator commands ----------------------------------------------------------------------------------

    async def input(
        self,
        text: str,
        *,
        final: bool = True,
        interrupt: bool = True,
        force: bool = False,
        reply: bool = True,
        role: Role = "user",
    ) -> InputResult:
        """Inject input. ``final=False`` is an interim transcript: reported, never committed; it may start a
        speculative reply. A final input interrupts the current speech (if asked and allowed), is committed, and
        queues a reply. Input is never dropped: if the speech cannot be interrupted the reply waits its turn."""
        self._check_open()
        if not final:
            self.events.emit("user.input", item_id=None, text=text, final=False, role=role)
            self._on_interim(text)
            return InputResult(None, None)
        async with self._op_lock:
            self._check_open()  # the session may have started closing while this input waited
            spec, self._speculative = self._speculative, None
            self._interim_text, self._preempt_pending = None, False
            if interrupt and self._current is not None:
                try:
                    await self._interrupt_current(force=force)
                except NotInterruptible:
                    pass
            usable = (
                spec is not None
                and role == "user"
                and spec.user_text == text
                and spec.version == self.chat.version
                and not self._foreground_tool_running()
            )
            if spec is not None and not usable:
                await self._drop_generation(spec)
                self.events.emit("generation.speculative", state="discarded", user_text=spec.user_text)
            elif spec is not None:
                self.events.emit("generation.speculative", state="used", user_text=spec.user_text)
            item = ChatMessage(id=new_id("item"), role=role, text=text)
            job = self._new_job("reply", preemptive=spec if usable else None) if reply else None
            await self.commit(Commit(items=[item], speeches=[job.speech.info()] if job else []))
            self.chat.append(item)
            self.events.emit("user.input", item_id=item.id, text=text, final=True, role=role)
            self.events.emit("chat.item", item=item.model_dump(mode="json"))
            if job is not None:
                self._enqueue(job)
            return InputResult(item.id, job.speech.id if job else None)

    async def say(self, text: str, *, allow_interruptions: bool = True, add_to_chat: bool = True) -> SpeechHandle:
        """Speak ``text`` as is (no model), after whatever is queued."""
        self._check_open()
        job = self._new_job("say", text=text, add_to_chat=add_to_chat, allow_interruptions=allow_interruptions)
        await self.commit(Commit(speeches=[job.speech.info()]))
        self._enqueue(job)
        return job.speech

    async def generate_reply(self, *, instructions: str | None = None) -> SpeechHandle:
        """Queue a reply from the model; ``instructions`` are added for this reply only."""
        self._check_open()
        job = self._new_job("reply", instructions=instructions)
        await self.commit(Commit(speeches=[job.speech.info()]))
        self._enqueue(job)
        return job.speech

    async def interrupt(self, *, force: bool = False) -> SpeechHandle | None:
        """Interrupt the current speech; returns once its interrupted message is committed.

        Returns the interrupted speech, or None when nothing was speaking. Raises ``NotInterruptible``.
        """
        self._check_open()
        async with self._op_lock:
            self._check_open()
            return await self._interrupt_current(force=force)

    async def cancel_tool(self, call_id: str) -> ToolCallInfo:
        return await self.executor.cancel(call_id)

    async def _interrupt_current(self, *, force: bool) -> SpeechHandle | None:
        speech = self._current
        if speech is None or speech.done:
            return None
        if not speech.interrupt(force=force):
            return None
        await speech.wait_done()
        return speech

    # -- persistence ----------------------------------------------------------------------------------------

    async def commit(self, commit: Commit) -> None:
        """Write ``commit`` durably, in order with this session's other writes.

        A store that is unavailable is retried with backoff until it recovers: nothing is dropped. Any other error
        is permanent for that write: it is raised to the caller rather than retried, so it cannot hold up the
        session's later writes. The write runs in its own task, so a caller that is cancelled (a forced speech
        cancel, say) does not abort it.
        """
        task = asyncio.create_task(self._write(commit), name=f"commit:{self.id}")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        await asyncio.shield(task)

    async def _write(self, commit: Commit) -> None:
        delay = 0.05
        async with self._commit_lock:
            while True:
                try:
                    await self._store.commit(self.id, commit)
                    return
                except StoreUnavailable as err:
                    logger.error(
                        "session %s: commit failed (%s); retrying in %.2fs",
                        self.id,
                        err,
                        delay,
                        extra={"session_id": self.id},
                    )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, COMMIT_RETRY_MAX_S)
                except Exception:
                    logger.exception("session %s: commit failed for good", self.id, extra={"session_id": self.id})
                    raise

    # -- scheduling -----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.state != "active":
            raise SessionClosed(f"session {self.id} is {self.state}")

    def _new_job(
        self,
        kind: Literal["reply", "say"],
        *,
        source: SpeechSource | None = None,
        text: str = "",
        instructions: str | None = None,
        add_to_chat: bool = True,
        allow_interruptions: bool | None = None,
        preemptive: Generation | None = None,
    ) -> ReplyJob:
        speech = SpeechHandle(
            source=source or ("say" if kind == "say" else "reply"),
            allow_interruptions=self.options.allow_interruptions
            if allow_interruptions is None
            else allow_interruptions,
            force_timeout_s=self.options.interrupt_force_timeout_s,
        )
        self._speeches[speech.id] = speech
        if len(self._speeches) > KEEP_SPEECHES:
            for old_id in list(self._speeches)[: len(self._speeches) - KEEP_SPEECHES]:
                if self._speeches[old_id].done:
                    del self._speeches[old_id]
        return ReplyJob(
            speech=speech,
            kind=kind,
            text=text,
            instructions=instructions,
            add_to_chat=add_to_chat,
            preemptive=preemptive,
        )

    def _enqueue(self, job: ReplyJob) -> None:
        self._queue.append(job)
        self._queue_ev.set()
        self.events.emit("speech.created", speech_id=job.speech.id, source=job.speech.source)

    async def _schedule_loop(self) -> None:
        while True:
            while not self._queue:
                self._queue_ev.clear()
                await self._queue_ev.wait()
            job = self._queue.popleft()
            if job.speech.interrupted:
                await self._finish_unstarted(job)
                continue
            self._current = job.speech
            task = asyncio.create_task(run_job(self, job), name=f"speech:{job.speech.id}")
            job.speech._attach_task(task)
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                await cancel_and_wait(task)
                raise
            finally:
                if not job.speech.done:  # forced cancel (logged by the speech): still end it properly
                    await self.finish_speech(job.speech)
                self._current = None
            self._start_pending_speculative()
            if not task.cancelled() and task.exception() is not None:
                logger.error(
                    "speech %s failed",
                    job.speech.id,
                    exc_info=task.exception(),
                    extra={"session_id": self.id},
                )
            if not self._queue:
                self._set_agent_state("listening")

    async def _finish_unstarted(self, job: ReplyJob) -> None:
        await job.preemptive.aclose() if job.preemptive else None
        await self.finish_speech(job.speech)

    async def finish_speech(self, speech: SpeechHandle) -> None:
        if speech.done:
            return
        speech._mark_done()
        # in its own task: a caller cancelled meanwhile (the scheduler, at close) must not lose the commit and event
        task = asyncio.create_task(self._speech_done(speech), name=f"speech-done:{speech.id}")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        await asyncio.shield(task)

    async def _speech_done(self, speech: SpeechHandle) -> None:
        await self.commit(Commit(speeches=[speech.info()]))
        self.events.emit("speech.done", speech_id=speech.id, interrupted=speech.interrupted)

    def _set_agent_state(self, state: AgentState) -> None:
        if state != self.agent_state:
            self.agent_state = state
            self.events.emit("agent.state", state=state)

    def set_agent_state(self, state: AgentState) -> None:
        self._set_agent_state(state)

    # -- model requests -------------------------------------------------------------------------------------

    def build_request(
        self,
        *,
        speech: SpeechHandle | None,
        step: int,
        instructions: str | None = None,
        pending_user_text: str | None = None,
        preemptive: bool = False,
    ) -> LLMRequest:
        """The model's view (I2): placeholders for calls still running, never a call without its output."""
        tools = self.executor.tools_for_model(self.agent.tools)
        running: list[FunctionCall] = [rc.item for rc in self.executor.running() if rc.foreground]
        items = self.chat.for_llm(running)
        if pending_user_text is not None:
            items.append(ChatMessage(id=new_id("item"), role="user", text=pending_user_text))
        full_instructions = self.agent.instructions
        if instructions:
            full_instructions = f"{full_instructions}\n\n{instructions}"
        return LLMRequest(
            instructions=full_instructions,
            items=items,
            tools=[t.schema() for t in tools.values()],
            tool_choice="none" if step >= self.options.max_tool_steps or not tools else "auto",
            speech_id=speech.id if speech else None,
            step=step,
            preemptive=preemptive,
        )

    def start_generation(self, request: LLMRequest) -> Generation:
        gen = Generation(self.llm, request)
        # the scripted model's position moved: persist it in the background, in order with other writes
        task = asyncio.create_task(self.commit(Commit(session=self.snapshot())), name=f"state:{self.id}")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return gen

    # -- preemptive generation (I2) -------------------------------------------------------------------------

    def _foreground_tool_running(self) -> bool:
        return any(rc.foreground for rc in self.executor.running())

    def _on_interim(self, text: str) -> None:
        self._interim_text = text
        if not self.options.preemptive_generation:
            return
        if self._foreground_tool_running():
            self._preempt_pending = True  # started when the tool ends, never while it runs
            return
        self._start_speculative(text)

    def _start_speculative(self, text: str) -> None:
        self._preempt_pending = False
        old, self._speculative = self._speculative, None
        if old is not None:
            self._rollback(old)
            self.events.emit("generation.speculative", state="discarded", user_text=old.user_text)
            task = asyncio.create_task(old.aclose())
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
        before = self.llm.save_state()
        request = self.build_request(speech=None, step=0, pending_user_text=text, preemptive=True)
        self._speculative = Generation(
            self.llm, request, version=self.chat.version, user_text=text, llm_state_before=before
        )
        self.events.emit("generation.speculative", state="started", user_text=text)

    def _rollback(self, gen: Generation) -> None:
        # A discarded speculative reply gives its script turn back, unless another generation has used the
        # model since (then its state is no longer ours to rewind).
        if gen.llm_state_before is not None and self.llm.save_state() == gen.llm_state_after:
            self.llm.load_state(gen.llm_state_before)

    async def _drop_generation(self, gen: Generation) -> None:
        self._rollback(gen)
        await gen.aclose()

    async def _discard_speculative(self) -> None:
        spec, self._speculative = self._speculative, None
        if spec is not None:
            await self._drop_generation(spec)

    # -- tool hooks -----------------------------------------------------------------------------------------

    def _on_call_ended(self, rc: RunningCall) -> None:
        if self.state != "active":
            return
        # a result that arrives outside of any reply (background, or re-run after a restart) gets a deferred reply
        detached = rc.info.background or rc.speech is None
        if detached and rc.needs_reply and rc.cancel_reason not in ("agent handoff", "session closed"):
            self._schedule_deferred_reply()
        self._start_pending_speculative()

    def _start_pending_speculative(self) -> None:
        """Start a speculative reply that waited for tools, once nothing is about to change the context: no
        foreground tool running and no speech playing or queued (a tool reply would invalidate it at once)."""
        if (
            self._preempt_pending
            and self._interim_text
            and self.state == "active"
            and self._current is None
            and not self._queue
            and not self._foreground_tool_running()
        ):
            self._start_speculative(self._interim_text)

    def _schedule_deferred_reply(self) -> None:
        # one queued (or being queued) deferred reply covers every result that arrives before it starts
        if self._deferred_scheduling is not None or any(j.speech.source == "deferred_reply" for j in self._queue):
            return
        job = self._new_job("reply", source="deferred_reply")
        task = asyncio.create_task(self._enqueue_durable(job), name=f"deferred:{self.id}")
        self._deferred_scheduling = task
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _enqueue_durable(self, job: ReplyJob) -> None:
        # speech.created is published only once the speech is durable (I6)
        try:
            await self.commit(Commit(speeches=[job.speech.info()]))
        finally:
            self._deferred_scheduling = None
        if self.state in ("closing", "closed"):
            job.speech.interrupt(force=True)  # queued only to be ended by the close, never started
        self._enqueue(job)

    async def _handoff(self, rc: RunningCall, new_agent: Agent) -> tuple[list[ChatItem], SessionState]:
        old = self.agent
        await self.executor.drain(scope="agent", exclude={rc.info.call_id})
        self.agent = new_agent
        item = AgentHandoff(id=new_id("item"), from_agent=old.name, to_agent=new_agent.name)
        logger.info("session %s: handoff %s -> %s", self.id, old.name, new_agent.name, extra={"session_id": self.id})
        return [item], self.snapshot()


__all__ = ["AgentSession", "InputResult", "SessionClosed", "SessionOptions"]
