"""AgentSession: one live conversation — chat context, current agent, speech scheduler, tools and event log."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from . import event_types as ev
from .agent import Agent, complete_user_turn
from .aio import forget_when_done, spawn
from .arguments import parse_arguments
from .chat import FINAL_SUFFIX, ChatContext, ChatItem, ChatMessage, FunctionCall, new_id, order_items
from .coach import CoachNotes
from .commit import CommitPipeline
from .event_types import InputRole as Role
from .events import EventLog, EventSink
from .executor import Outcome, RunningCall, ToolExecutor
from .generation import Generation
from .handoff import HandoffStep
from .lifecycle import SessionEnds
from .llm.base import LLM, LLMRequest, ToolCallChunk
from .options import SessionOptions
from .playout import Playout
from .ports import ChatStore, Commit, Receipt, SessionState, Takeover, completions
from .reply import ReplyJob, run_job
from .scheduled import ScheduledCommands
from .speculative import Speculation
from .speech import (
    SPEECH_PRIORITY_NORMAL,
    NotInterruptible,
    SpeechHandle,
    SpeechInfo,
)
from .speeches import Speeches
from .status import AgentState, SessionClosed, SessionStatus, SessionSuspended
from .takeover import HandBack, OperatorSeat
from .tools import FunctionTool, ToolCallInfo, ToolStatus
from .user_turn import UserTurn

logger = logging.getLogger("switchboard.runtime.session")


T = TypeVar("T")


@dataclass(frozen=True)
class InputResult:
    item_id: str | None
    speech_id: str | None


class AgentSession(SessionEnds):
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
        items: Iterable[ChatItem] | ChatContext = (),
        last_seq: int = 0,
        entered: bool = True,
        takeover: Takeover | None = None,
    ) -> None:
        self.id = session_id
        self.agent = agent
        self.llm = llm
        self.playout = playout
        self.options = options or SessionOptions()
        self.chat = items if isinstance(items, ChatContext) else ChatContext(items)
        # the model's calls so far, restarts included (an async tool's `<call_id>/final` pair is not a call)
        self.tool_calls_made = sum(
            1 for item in self.chat.items if isinstance(item, FunctionCall) and not item.call_id.endswith(FINAL_SUFFIX)
        )
        self.events = EventLog(session_id, events, last_seq=last_seq)
        self.state = SessionStatus.INITIALIZING
        self.agent_state: AgentState = "initializing"
        # the current agent's on_enter has run (or runs): persisted, so that one owed (a session created or handed
        # off just before its process stopped) runs where the session runs next, and one that ran never runs twice
        self.entered = entered
        # being handed over, and past the point where it takes owed input durably (``suspend``)
        self._sealed = False
        self.writes = CommitPipeline(session_id, store=store, events=self.events)
        self.handoff = HandoffStep(self)
        self._hooks: set[asyncio.Task[Any]] = set()  # the agents' on_enter / on_exit, each in a task of its own
        self.executor = ToolExecutor(
            session_id,
            chat=self.chat,
            events=self.events,
            commit=self.writes.commit,
            on_ended=self._on_call_ended,
            on_handoff=self.handoff.request,
            owed_by_end=self._owed_by_end,
            cancel_grace_s=self.options.tool_cancel_grace_s,
            session=self,
        )
        self.speeches = Speeches(
            session_id,
            writes=self.writes,
            events=self.events,
            chat=self.chat,
            state=lambda: self.state,
            play=self._play,
            after_speech=self._after_speech,
            allow_interruptions=self.options.allow_interruptions,
            force_timeout_s=self.options.interrupt_force_timeout_s,
        )
        self.speculation = Speculation(
            llm=llm,
            events=self.events,
            chat=self.chat,
            enabled=self.options.preemptive_generation,
            request_for=self._speculative_request,
            tool_running=self._foreground_tool_running,
            tasks=self.writes.tasks,
            start_early=self._start_early_call,
            drop_call=self.executor.drop,
        )
        # commands, close and suspend take turns: a command runs fully before a close, or finds the session closed
        self._op_lock = asyncio.Lock()
        self._commands: set[asyncio.Task[Any]] = set()
        self._closing: asyncio.Task[None] | None = None
        self._suspending: asyncio.Task[None] | None = None
        # final inputs being taken that ask for a reply: a speech they interrupt yields to thinking, not listening
        self._answering = 0
        self.user_turn = UserTurn()
        self.seat = OperatorSeat(self, takeover)  # an operator's takeover (``runtime.takeover``): held or not
        self.scheduled = ScheduledCommands(self)  # commands that apply at a point of the conversation
        self.coach = CoachNotes(self)  # operators' notes for the next model request
        agent.attach(self)

    def __repr__(self) -> str:
        return f"<AgentSession {self.id} {self.state} agent={self.agent.name}>"

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(self, *, recovered: bool = False, **event_data: Any) -> None:
        if self.speeches.scheduler.started:
            return
        if self.agent.mcp_servers:
            before = self.state
            await self.agent.load_tools()  # its MCP servers' tools, before the model is first asked
            if self.state != before or self.speeches.scheduler.started:
                return  # closed, suspended or started while its servers were listed: nothing starts now
        self.state = SessionStatus.ACTIVE
        # a recovered session's agent that had entered does not greet twice; one whose on_enter was owed (created or
        # handed off just before its process stopped) enters now. Marked in the same write: at most once
        enter, self.entered = not recovered or not self.entered, True
        await self.commit(Commit(session=self.snapshot()))
        if self.state != SessionStatus.ACTIVE:
            # suspended (fenced: another node took it over) or closed while its start was being written: that stop
            # found nothing to stop yet, so nothing may start now, or a ghost of the session plays on here
            return
        self.events.emit(
            ev.SessionRecovered(agent=self.agent.name, **event_data)
            if recovered
            else ev.SessionStarted(agent=self.agent.name, **event_data)
        )
        self.set_agent_state("listening")
        self.speeches.scheduler.start()
        self.scheduled.start()
        if enter:
            self._run_hook(self.agent.on_enter(), f"on_enter:{self.agent.name}")

    async def suspend(self, *, tool_grace: bool = True) -> None:
        """Hand the session over (a drain, a graceful restart): stop its work here without closing it. It stays live
        in the store, and what it owes is durable there for its next owner (``runtime.recovery``): the speech under
        way and the queued ones are not ended but left owed (what was heard of the current one is committed), a call
        that cannot be cancelled gets ``shutdown_tool_grace_s`` to end and commit its result (a deferred reply to it
        owed with it), a handoff under way is done, and input that arrives meanwhile is accepted durably and
        answered by the next owner (I3). A move is not an interruption: it never loses more than a crash.
        ``tool_grace=False``: the session is another process's already (fenced): nothing it does here can be
        written any more, so nothing waits.

        Like a close, it runs to its end even when its caller is cancelled; a close already under way is let
        finish instead (it is bounded), so a shutdown never leaves a session half closed."""
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        if self._suspending is None:
            self._suspending = self._track(self._hand_over(tool_grace=tool_grace), f"suspend:{self.id}")
        await asyncio.shield(self._suspending)

    async def aclose(self, *, reason: str | None = None) -> None:
        """Close: stop speaking, cancel cancellable tools, await the others, emit the final events (with ``reason``
        when the service closes it on its own, e.g. ``idle``).

        A close runs to its end even when its caller is cancelled: a session half closed answers nothing."""
        if self._closing is None:
            self._closing = self._track(self._close(reason), f"close:{self.id}")
        await asyncio.shield(self._closing)

    @property
    def dormant(self) -> bool:
        """Active and doing nothing: no speech playing or queued, not thinking, no tool call running."""
        return (
            self.state == SessionStatus.ACTIVE
            and self.agent_state == "listening"
            and self.idle
            and not self.executor.running()
        )

    def snapshot(self) -> SessionState:
        return SessionState(
            agent=self.agent.name,
            entered=self.entered,
            # a session being handed over is live in the store, for its next owner to recover: ``suspended`` is only
            # what it is here (a handoff done during the hand-over once stored it, and no node ever ran it again)
            state=SessionStatus.ACTIVE if self.state == SessionStatus.SUSPENDED else self.state,
            llm_state=self.llm.save_state(),
            current_speech_id=self.speeches.scheduler.current.id if self.speeches.scheduler.current else None,
            takeover=self.seat.hold,
        )

    # -- queries --------------------------------------------------------------------------------------------

    @property
    def current_speech(self) -> SpeechHandle | None:
        return self.speeches.scheduler.current

    @property
    def idle(self) -> bool:
        """No speech playing and none queued."""
        return self.speeches.scheduler.idle

    @property
    def pending_writes(self) -> int:
        """Writes (and their events) still on their way to the store."""
        return self.writes.pending

    @property
    def write_failures(self) -> int:
        """Writes the store refused for good (an operator should know)."""
        return self.writes.failures

    def speech(self, speech_id: str) -> SpeechHandle | None:
        return self.speeches.get(speech_id)

    def tool_calls(self, status: ToolStatus | None = None) -> list[ToolCallInfo]:
        return [rc.info for rc in self.executor.calls() if rc.info.listed_as(status)]

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

    def tool_call_end_error(self, call_id: str) -> Exception | None:
        """Why the end of a call that ended here is not durable: the store's error on the write that carried it
        (the store's fencing refusal when the session moved to another process meanwhile, and its end never will
        be written here). None while the call runs, once its end is durable, and for a call unknown here."""
        rc = self.executor.get(call_id)
        return rc.end_error if rc is not None else None

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
        receipt: Receipt[InputResult] | None = None,
    ) -> InputResult:
        """Inject input. ``final=False`` is an interim transcript: reported, never committed; it may start a
        speculative reply. A final input interrupts the current speech (if asked and allowed), is committed, and
        queues a reply. Input is never dropped: if the speech cannot be interrupted the reply waits its turn, and
        while the session is being handed over it is committed for the next owner to answer.
        ``receipt`` (an idempotent command's) is completed by the commit of the input and its reply."""
        self._check_open(owed=final)
        if not final:
            self.user_turn.begin()
            self.events.emit(ev.UserInput(item_id=None, text=text, final=False, role=role))
            if not self.seat.held:  # a held session asks the model for nothing, not even speculatively
                self.speculation.on_interim(text)
            return InputResult(None, None)
        return await self._command(
            lambda: self._answered_input(
                text, interrupt=interrupt, force=force, reply=reply, role=role, receipt=receipt
            ),
            "input",
            owed=True,
        )

    async def _answered_input(
        self, text: str, *, interrupt: bool, force: bool, reply: bool, role: Role, receipt: Receipt[InputResult] | None
    ) -> InputResult:
        """A final input; one that asks for a reply takes the agent it interrupts from speaking straight to thinking
        (as LiveKit does): a dashboard never sees it flicker to listening between the two speeches. The user's last
        words, taken while the session closes (``UserTurn``), are recorded and not answered."""
        # held by an operator: committed and shown to them, not answered (the hand-back answers what is left)
        reply = reply and not self.user_turn.last_words and not self.seat.held
        self._answering += int(reply)
        try:
            return await self._final_input(
                text, interrupt=interrupt, force=force, reply=reply, role=role, receipt=receipt
            )
        finally:
            self.user_turn.end()
            self._answering -= int(reply)
            if not self._answering and self.agent_state == "thinking" and self.idle:
                self.set_agent_state("listening")  # no reply was queued after all (the turn hook said so, a failure)

    async def _final_input(
        self, text: str, *, interrupt: bool, force: bool, reply: bool, role: Role, receipt: Receipt[InputResult] | None
    ) -> InputResult:
        spec = self.speculation.take()
        barge_in = False
        if interrupt and self.state == SessionStatus.ACTIVE:  # a move stopped the speech already: nothing to cut
            try:
                barge_in = await self.speeches.interrupt_current(force=force) is not None
            except NotInterruptible:
                pass
        extra: list[ChatMessage] = []
        if reply and role == "user":
            turn = await complete_user_turn(
                self.agent, self.chat.items, text, session_id=self.id, timeout_s=self.options.user_turn_hook_timeout_s
            )
            text, extra, reply = turn.text, turn.extra, turn.reply
            if spec is not None and (extra or not reply):  # the speculative reply was made without the hook's say
                await self.speculation.drop_stale(spec)
                spec = None
        # only now: the interruption may have changed the context the speculative reply was made from
        spec = await self.speculation.use_or_drop(spec, text=text, role=role, barge_in=barge_in)
        item = ChatMessage(id=new_id("item"), role=role, text=text)
        job = self.speeches.new_job("reply", preemptive=spec, turn_messages=extra) if reply else None

        def apply() -> None:
            self.chat.append(item)
            self.events.emit(ev.UserInput(item_id=item.id, text=text, final=True, role=role))
            self.events.emit(ev.ChatItemAdded(item=item))
            if job is not None:
                job.context_version = self.chat.version  # what a speculative reply must still match when used
                self.speeches.enqueue(job)

        result = InputResult(item.id, job.speech.id if job else None)
        commit = Commit(
            items=[item], speeches=[job.speech.info()] if job else [], receipts=completions(result, receipt)
        )
        try:
            await self.commit(commit, then=apply)
        except BaseException:
            if spec is not None:
                await spec.aclose()
            raise
        return result

    def user_speaking(self) -> None:
        """The user is heard talking (a media edge's barge-in): a close waits briefly for the final transcript."""
        self.user_turn.begin()

    def user_gone(self) -> None:
        """No final transcript can come any more (the media edge left): a close waits for none."""
        self.user_turn.end()

    async def say(
        self,
        text: str,
        *,
        allow_interruptions: bool = True,
        add_to_chat: bool = True,
        priority: int = SPEECH_PRIORITY_NORMAL,
        receipt: Receipt[SpeechHandle] | None = None,
    ) -> SpeechHandle:
        """Speak ``text`` as is (no model), after whatever is queued with the same or a higher ``priority``.

        ``allow_interruptions=False`` makes it a barrier: an interrupt stops before it, so it and everything
        queued after it play (``force`` still interrupts it). ``receipt`` is completed by the speech's commit."""
        self._check_open(owed=True)
        job = self.speeches.new_job(
            "say", text=text, add_to_chat=add_to_chat, allow_interruptions=allow_interruptions, priority=priority
        )
        return await self._command(lambda: self.speeches.queue_durably(job, receipt), "say", owed=True)

    async def generate_reply(
        self, *, instructions: str | None = None, priority: int = SPEECH_PRIORITY_NORMAL
    ) -> SpeechHandle:
        """Queue a reply from the model; ``instructions`` are added for this reply only."""
        self._check_open(owed=True)
        job = self.speeches.new_job("reply", instructions=instructions, priority=priority)
        return await self._command(lambda: self.speeches.queue_durably(job), "reply", owed=True)

    async def interrupt(
        self, *, force: bool = False, receipt: Receipt[SpeechHandle] | None = None
    ) -> SpeechHandle | None:
        """Interrupt the current speech and every queued one after it, stopping at the first queued speech that
        does not allow interruptions (``force``: all of them); returns once the current speech's interrupted
        message is committed (that commit completes ``receipt``).

        Returns the interrupted current speech, or None when nothing was speaking. Raises ``NotInterruptible``
        when the current speech does not allow interruptions (then nothing is interrupted).
        """
        self._check_open()
        return await self._command(lambda: self._interrupt(force=force, receipt=receipt), "interrupt")

    async def _interrupt(self, *, force: bool, receipt: Receipt[SpeechHandle] | None) -> SpeechHandle | None:
        speech = await self.speeches.interrupt_current(force=force, receipt=receipt)
        if speech is not None:
            self.speculation.barge_in()
        return speech

    # -- an operator's takeover (``runtime.takeover``) -------------------------------------------------------

    async def take_over(
        self, operator: str, *, force: bool = False, receipt: Receipt[Takeover] | None = None
    ) -> Takeover:
        """Hold the session for ``operator`` (``OperatorSeat.take``); the holder taking it again is a heartbeat."""
        self._check_open()
        return await self._command(lambda: self.seat.take(operator, force=force, receipt=receipt), "takeover")

    async def operator_say(
        self, operator: str, text: str, *, receipt: Receipt[SpeechHandle] | None = None
    ) -> SpeechHandle:
        """Speak ``text`` as the agent, for the operator who holds the session (``OperatorSeat.say``)."""
        self._check_open(owed=True)
        return await self._command(lambda: self.seat.say(operator, text, receipt=receipt), "takeover-say", owed=True)

    async def hand_back(self, by: str, *, force: bool = False) -> HandBack:
        """End an operator's hold (``OperatorSeat.hand_back``)."""
        self._check_open()
        return await self._command(lambda: self.seat.hand_back(by, force=force), "handback")

    async def _command(self, body: Callable[[], Awaitable[T]], what: str, *, owed: bool = False) -> T:
        """Run one operator command to its end, whatever happens to its caller.

        The command runs in a task of its own, in turn with the other commands, close and suspend: what it commits
        is also applied to the live session (I8) even when the caller is cut off (a deadline, a disconnect), and a
        close never slips between its open check and its effect (it runs fully before, or finds the session
        closed). Cancelling the caller only stops the wait. An ``owed`` command (input, say, a reply) is also taken
        while the session is being handed over: it is committed, and played where the session runs next.
        """

        async def run() -> T:
            async with self._op_lock:
                self._check_open(owed=owed)
                return await body()

        return await asyncio.shield(self._track(run(), f"{what}:{self.id}"))

    def _track(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        # the caller receives the task's outcome; when it was cut off, the outcome is already logged where it arose
        task = asyncio.create_task(coro, name=name)
        self._commands.add(task)
        task.add_done_callback(forget_when_done(self._commands))
        return task

    async def cancel_tool(
        self,
        call_id: str,
        *,
        force: bool = False,
        reason: str = "cancelled by an operator",
        receipt: Receipt[ToolCallInfo] | None = None,
    ) -> ToolCallInfo:
        """Cancel a running cancellable call; returns its record once it has ended ``cancelled``. Raises
        ``NotInterruptible`` while the speech that made it does not allow interruptions, unless ``force``.
        ``reason`` says who cancelled it, in its output and in the notice a webhook backend gets; the call's end
        completes ``receipt``."""
        return await self.executor.cancel(call_id, force=force, reason=reason, receipt=receipt)

    # -- persistence ----------------------------------------------------------------------------------------

    async def commit(self, commit: Commit, *, then: Callable[[], None] | None = None) -> None:
        """Write ``commit`` durably, in order with this session's other writes, then run ``then`` (one unit; see
        ``CommitPipeline.commit``)."""
        await self.writes.commit(commit, then=then)

    # -- speeches -------------------------------------------------------------------------------------------

    def _check_open(self, *, owed: bool = False) -> None:
        """Refuse a command unless the session is active; ``owed``: also while it is being handed over, until its
        last writes are settled (input and speeches are then committed for its next owner to play)."""
        if self.state == SessionStatus.SUSPENDED:
            if owed and not self._sealed:
                return
            raise SessionSuspended(f"session {self.id} is being handed over to another node")
        if self.state != SessionStatus.ACTIVE:
            raise SessionClosed(f"session {self.id} is {self.state}")

    async def _play(self, job: ReplyJob) -> None:
        if self.seat.holds_back(job):  # held by an operator: no reply of the model plays
            if job.preemptive is not None:
                await job.preemptive.aclose("barge_in")
            await self.finish_speech(job.speech)
            return
        await run_job(self, job)

    async def usable_preemptive(self, job: ReplyJob) -> Generation | None:
        """The job's speculative generation if it still fits the context now, when it is about to be used (a speech
        that ran before this reply may have changed the context since the input was accepted)."""
        spec, job.preemptive = job.preemptive, None
        if spec is None:
            return None
        if self.speculation.still_fits(spec, job.context_version):
            self.coach.used_by(spec.request)
            return spec
        await self.speculation.drop_stale(spec)
        return None

    def _after_speech(self) -> None:
        self._start_pending_speculative()
        if not self.speeches.scheduler.has_queued:
            self.set_agent_state("listening")
        self.scheduled.wake()

    async def finish_speech(self, speech: SpeechHandle) -> None:
        """Mark ``speech`` done and write its end (``Speeches.finish``)."""
        await self.speeches.finish(speech)

    @property
    def model_error_line(self) -> str | None:
        return self.agent.on_model_error

    def set_agent_state(self, state: AgentState) -> None:
        if state == "listening" and self._answering and self.state == SessionStatus.ACTIVE:
            state = "thinking"  # an input being taken will be answered (``_answered_input``)
        if state != self.agent_state:
            self.agent_state = state
            self.events.emit(ev.AgentStateChanged(state=state))
            self.scheduled.wake()

    # -- what a reply needs (``ReplySession``) --------------------------------------------------------------

    @property
    def max_tool_steps(self) -> int:
        return self.options.max_tool_steps

    @property
    def max_tool_calls_per_turn(self) -> int:
        return self.options.max_tool_calls_per_turn

    def add_to_chat(self, *items: ChatItem) -> None:
        self.chat.append(*items)

    def model_tools(self) -> dict[str, FunctionTool]:
        return self.executor.tools_for_model(self.agent.tools)

    def call_id_for(self, model_call_id: str | None) -> str:
        """The id of a call the model just made: the session's own (see ``trust_model_call_ids``)."""
        if self.options.trust_model_call_ids and model_call_id:
            return model_call_id
        return new_id("call")

    def start_tool_call(
        self,
        item: FunctionCall,
        *,
        tools: Mapping[str, FunctionTool],
        speech: SpeechHandle,
        step: int,
        arguments_error: str | None,
        refusal: str | None = None,
    ) -> RunningCall:
        cap = self.options.max_tool_calls_per_session
        if refusal is None and self.tool_calls_made >= cap:
            refusal = f"this session made its {cap} tool calls, the most it may make; not run"
        self.tool_calls_made += 1
        return self.executor.start(
            item,
            tools=tools,
            speech=speech,
            step=step,
            agent=self.agent.name,
            arguments_error=arguments_error,
            refusal=refusal,
        )

    def build_request(
        self,
        *,
        speech: SpeechHandle | None,
        step: int,
        instructions: str | None = None,
        pending_user_text: str | None = None,
        preemptive: bool = False,
        turn_messages: tuple[ChatMessage, ...] = (),
        tools_off: bool = False,
    ) -> LLMRequest:
        """The model's view (I2): placeholders for calls still running, never a call without its output.
        ``turn_messages`` (added by ``on_user_turn_completed``) are shown in their place, never persisted.
        ``tools_off``: the step answers a progress update, and may call no tool (so the model cannot poll the call);
        the tools are still described (the context holds calls of them)."""
        self.speeches.step_sees_results(speech)
        tools = self.model_tools()
        running: list[FunctionCall] = [rc.item for rc in self.executor.running() if rc.foreground]
        items = self.chat.for_llm(running)
        if turn_messages:
            items = order_items([*items, *turn_messages])
        if pending_user_text is not None:
            items.append(ChatMessage(id=new_id("item"), role="user", text=pending_user_text))
        items.extend(self.coach.messages(take=not preemptive, speech_id=speech.id if speech else None))
        full_instructions = self.agent.instructions
        if instructions:
            full_instructions = f"{full_instructions}\n\n{instructions}"
        return LLMRequest(
            instructions=full_instructions,
            items=items,
            tools=[t.schema() for t in tools.values()],
            tool_choice="none" if tools_off or step >= self.options.max_tool_steps or not tools else "auto",
            speech_id=speech.id if speech else None,
            step=step,
            preemptive=preemptive,
        )

    def start_generation(self, request: LLMRequest) -> Generation:
        gen = Generation(self.llm, request)
        # the scripted model's position moved: persist it in the background, in order with other writes
        self.writes.background(self.commit(Commit(session=self.snapshot())), name=f"state:{self.id}")
        return gen

    # -- preemptive generation (I2) -------------------------------------------------------------------------

    def _speculative_request(self, text: str) -> LLMRequest:
        return self.build_request(speech=None, step=0, pending_user_text=text, preemptive=True)

    def _foreground_tool_running(self) -> bool:
        return any(rc.foreground for rc in self.executor.running())

    def _start_early_call(self, chunk: ToolCallChunk, index: int) -> RunningCall | None:
        """Start the ``index``-th call of the speculative reply now, as a speculative call, if its tool is declared
        free of side effects and the call would run when its reply is confirmed (else it waits for that)."""
        tools = self.model_tools()
        tool = tools.get(chunk.name)
        if tool is None or tool.policy.side_effects or self.state != SessionStatus.ACTIVE:
            return None
        arguments, error = parse_arguments(chunk.arguments)
        caps_reached = index >= self.options.max_tool_calls_per_turn or (
            self.tool_calls_made >= self.options.max_tool_calls_per_session
        )
        if error is not None or caps_reached:  # refused when its reply is confirmed, with the output that says why
            return None
        item = FunctionCall(
            id=new_id("item"), call_id=self.call_id_for(chunk.call_id), name=chunk.name, arguments=arguments
        )
        self.tool_calls_made += 1
        return self.executor.start(item, tools=tools, speech=None, step=0, agent=self.agent.name, speculative=True)

    async def confirm_early_call(self, rc: RunningCall, speech: SpeechHandle, step: int) -> bool:
        return await self.executor.confirm(rc, speech, step)

    def _start_pending_speculative(self) -> None:
        self.speculation.start_pending(quiet=self.state == SessionStatus.ACTIVE and self.speeches.scheduler.idle)

    # -- tool hooks -----------------------------------------------------------------------------------------

    def _owed_by_end(self, rc: RunningCall, outcome: Outcome) -> list[SpeechInfo]:
        return self.speeches.owed_by_end(rc, outcome)

    def _on_call_ended(self, rc: RunningCall, durable: bool) -> None:
        if rc.info.speculative:  # dropped with its reply: never in the conversation, and no call of the model's
            self.tool_calls_made -= 1
        active = self.state == SessionStatus.ACTIVE
        self.speeches.on_tool_result(rc, durable=durable, active=active)
        if active:
            self._start_pending_speculative()
        self.scheduled.wake()

    def requeue(self, info: SpeechInfo) -> None:
        """Queue again a speech the session owes (``Speeches.requeue``): after a move or a crash."""
        self.speeches.requeue(info, operator=self.seat.operator)

    # -- the agents' hooks ------------------------------------------------------------------------------------

    @property
    def runs_hooks(self) -> bool:
        """The agents' hooks run now: the session is active (not being handed over, nor closing)."""
        return self.state == SessionStatus.ACTIVE

    def agent_changed(self, old: Agent, new: Agent) -> None:
        """A handoff was committed: the old agent exits and the new one enters, each hook in a task of its own."""
        new.attach(self)
        self._run_hook(old.on_exit(), f"on_exit:{old.name}")
        self._run_hook(new.on_enter(), f"on_enter:{new.name}")

    def _run_hook(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self.state != SessionStatus.ACTIVE:  # a handoff committed while the session closes: nobody to greet
            coro.close()
            return
        # not awaited: a hook that waits for a speech's playout must not hold up the handoff or the start
        spawn(coro, name=f"{name}:{self.id}", tasks=self._hooks)


__all__ = ["AgentSession", "InputResult"]
