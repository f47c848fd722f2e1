"""The reply loop: one task per speech. Generation -> playout -> tools -> (tool reply step) ...

Every wait races the speech's interrupt future (I3). On interruption the loop stops playout at once, cancels the
generation, commits only what was heard, and ends; tools already started run on and commit their own pairs (I1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from . import event_types as ev
from .arguments import parse_arguments
from .chat import ChatItem, ChatMessage, FunctionCall, new_id, utcnow
from .events import EventLog
from .executor import RunningCall
from .generation import Generation
from .llm.base import LLMError, LLMRequest, TextDelta, ToolCallChunk, Usage
from .playout import Playout, PlayoutStream
from .ports import Commit, Completion, completions
from .speech import SpeechHandle, SpeechState
from .status import AgentState
from .tools import FunctionTool

logger = logging.getLogger("switchboard.runtime.reply")


class ReplySession(Protocol):
    """What the reply loop needs from its session (``AgentSession`` implements it)."""

    @property
    def id(self) -> str: ...

    @property
    def events(self) -> EventLog: ...

    @property
    def playout(self) -> Playout: ...

    @property
    def max_tool_steps(self) -> int: ...

    @property
    def max_tool_calls_per_turn(self) -> int: ...

    async def commit(self, commit: Commit, *, then: Callable[[], None] | None = None) -> None:
        """Write durably, in order with the session's other writes, then run ``then`` (one unit)."""
        ...

    def add_to_chat(self, *items: ChatItem) -> None:
        """Add committed items to the live chat context."""
        ...

    def set_agent_state(self, state: AgentState) -> None: ...

    def build_request(
        self,
        *,
        speech: SpeechHandle,
        step: int,
        instructions: str | None = None,
        turn_messages: tuple[ChatMessage, ...] = (),
        tools_off: bool = False,
    ) -> LLMRequest:
        """The request of one step; ``tools_off``: the model may make no tool call in it."""
        ...

    def start_generation(self, request: LLMRequest) -> Generation: ...

    def model_tools(self) -> Mapping[str, FunctionTool]:
        """The tools offered to the model for the next generation step."""
        ...

    def call_id_for(self, model_call_id: str | None) -> str:
        """The id a call the model made is known by (the session's own, not the model's)."""
        ...

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
        """Start executing a call the model made; it commits its own pair when it ends (I1). With a ``refusal`` (a
        cap was reached) it is not run and ends ``rejected`` with that output; so does any call past the session's
        own cap."""
        ...

    async def finish_speech(self, speech: SpeechHandle) -> None:
        """Mark ``speech`` done, durably."""
        ...

    async def confirm_early_call(self, rc: RunningCall, speech: SpeechHandle, step: int) -> bool:
        """Make a call its speculative reply started early one of ``speech``'s calls (False: it was dropped first)."""
        ...

    async def usable_preemptive(self, job: ReplyJob) -> Generation | None:
        """The job's speculative generation if it still fits the context now (else None; it is dropped)."""
        ...

    @property
    def model_error_line(self) -> str | None:
        """What the agent says when its model fails (None: nothing)."""
        ...


@dataclass(eq=False)
class ReplyJob:
    speech: SpeechHandle
    kind: Literal["reply", "say"]
    text: str = ""
    instructions: str | None = None
    add_to_chat: bool = True
    preemptive: Generation | None = None
    context_version: int | None = None  # the chat version the reply was queued on (with its input appended)
    turn_messages: tuple[ChatMessage, ...] = ()  # shown to the model for this reply only (on_user_turn_completed)
    streams: list[PlayoutStream] = field(default_factory=list)


@dataclass(eq=False)
class _Step:
    index: int
    stream: PlayoutStream
    created_at: object = field(default_factory=utcnow)
    text: str = ""
    calls: list[RunningCall] = field(default_factory=list)
    started_playing: bool = False


async def run_job(session: ReplySession, job: ReplyJob) -> None:
    try:
        if job.kind == "say":
            await _say(session, job)
        else:
            await _reply(session, job)
    finally:
        for stream in job.streams:
            stream.stop()  # idempotent; covers a cancelled speech task
        if job.preemptive is not None:  # its calls the reply never reached are dropped with it
            await job.preemptive.aclose("barge_in" if job.speech.interrupted else "session_stopped")
    await session.finish_speech(job.speech)


async def _commit_message(
    session: ReplySession,
    speech: SpeechHandle,
    step: _Step,
    text: str,
    *,
    interrupted: bool,
    report: ev.EventPayload | None = None,
    receipts: list[Completion] | None = None,
    last: bool = False,
) -> None:
    """Commit the assistant message of one step (what was heard, never an empty message) with the speech (and the
    ``receipts`` of the commands it answers), then add it to the live chat and report it, and ``report`` after it:
    one unit a cancelled speech cannot split.

    The ``last`` step of a speech heard whole commits the speech as done with it: a process that dies (or a session
    that moves) before the speech's own end is written must not leave it owed, or the next owner would say it, or
    answer the input, a second time."""
    text = text.strip()
    item = (
        ChatMessage(id=new_id("item"), role="assistant", text=text, interrupted=interrupted, created_at=step.created_at)
        if text
        else None
    )
    if item is None and report is None:
        return

    def apply() -> None:
        if item is not None:
            session.add_to_chat(item)
            session.events.emit(ev.ChatItemAdded(item=item))
            if speech.operator is not None:  # an operator's words said as the agent (``runtime.takeover``)
                session.events.emit(
                    ev.OperatorSpoke(operator=speech.operator, speech_id=speech.id, item_id=item.id, text=item.text)
                )
        if report is not None:
            session.events.emit(report)

    items = [item] if item is not None else []
    info = speech.info()
    if last:
        info = info.model_copy(update={"state": SpeechState.DONE})
    await session.commit(Commit(items=items, speeches=[info], receipts=receipts or []), then=apply)


def _interrupt_receipts(speech: SpeechHandle) -> list[Completion]:
    """The completions of the commands that interrupted ``speech``: its interruption's commit is their effect."""
    receipts, speech.receipts = speech.receipts, []
    return completions(speech, *receipts)


async def _on_interrupted(session: ReplySession, speech: SpeechHandle, step: _Step | None) -> None:
    # the agent yields the floor: a barge-in before any audio goes thinking -> listening, never through speaking
    session.set_agent_state("listening")
    played = ""
    if step is not None:
        played = step.stream.played_text  # read now: the sink is never waited on to acknowledge the stop
        step.stream.stop()
        speech.played_text = (speech.played_text + " " + played).strip()
    if speech.moved:
        await _on_moved(session, speech, step, played)
        return
    # the event reports the interruption only once it is durable (I6)
    report = _interrupted_report(speech)
    receipts = _interrupt_receipts(speech)
    if step is None:
        commit = Commit(speeches=[speech.info()], receipts=receipts)
        await session.commit(commit, then=lambda: _emit(session, report))
        return
    await _commit_message(session, speech, step, played, interrupted=True, report=report, receipts=receipts)


async def _on_moved(session: ReplySession, speech: SpeechHandle, step: _Step | None, played: str) -> None:
    """The session moves to another process (``SpeechHandle.hand_over``): the speech is not ended nor reported
    interrupted: it stays owed in the store, and the next owner plays it again. A reply is generated anew from the
    chat as it is then, so what this step played is committed (a message cut short: the model knows what was said);
    a say is said again whole and committed once, then."""
    if step is not None and played.strip() and speech.source not in ("say", "operator"):
        await _commit_message(session, speech, step, played, interrupted=True)


def _interrupted_report(speech: SpeechHandle) -> ev.SpeechInterrupted:
    if speech.audio_played_ms is None:  # no edge reported its audio position
        return ev.SpeechInterrupted(speech_id=speech.id, played_text=speech.played_text)
    return ev.SpeechInterrupted(
        speech_id=speech.id, played_text=speech.played_text, audio_played_ms=speech.audio_played_ms
    )


def _emit(session: ReplySession, payload: ev.EventPayload) -> None:
    session.events.emit(payload)


def _open_step(session: ReplySession, job: ReplyJob, index: int) -> _Step:
    """A step's playout stream; the speech is "speaking" once the stream reports that its audio started."""
    step = _Step(index, session.playout.start(job.speech.id))
    job.streams.append(step.stream)
    job.speech.follow_playout(lambda: step.stream.played_text)
    step.stream.on_playback_started(lambda: _begin_playing(session, job.speech, step))
    return step


def _begin_playing(session: ReplySession, speech: SpeechHandle, step: _Step) -> None:
    if step.started_playing or speech.interrupted or speech.done:
        return  # a report that lands after an interruption is stale: that audio was cut
    step.started_playing = True
    if speech.mark_playing():
        session.events.emit(ev.SpeechStarted(speech_id=speech.id))
    session.set_agent_state("speaking")


async def _say(session: ReplySession, job: ReplyJob) -> None:
    speech = job.speech
    step = _open_step(session, job, speech.begin_step())
    speech.text = job.text
    step.stream.push(job.text)
    step.stream.end_input()
    finished = await speech.run_unless_interrupted(step.stream.wait_done())
    if not finished or speech.interrupted:
        if job.add_to_chat:
            await _on_interrupted(session, speech, step)
        elif not speech.moved:  # a moved say is played again by the next owner: nothing to write here
            speech.played_text = step.stream.played_text
            step.stream.stop()
            report = _interrupted_report(speech)
            commit = Commit(speeches=[speech.info()], receipts=_interrupt_receipts(speech))
            await session.commit(commit, then=lambda: _emit(session, report))
        return
    speech.played_text = step.stream.played_text
    if job.add_to_chat:
        await _commit_message(session, speech, step, speech.played_text, interrupted=False, last=True)
    speech.end_step()


async def _consume(session: ReplySession, speech: SpeechHandle, gen: Generation, step: _Step) -> None:
    """Stream the model's output: text to playout, each tool call to the executor as soon as it is complete (a call
    a speculative generation started early is confirmed instead)."""
    tools = session.model_tools()
    calls_seen = 0
    async for chunk in gen:
        if isinstance(chunk, TextDelta):
            if not chunk.text:
                continue
            step.text += chunk.text
            speech.text += chunk.text
            step.stream.push(chunk.text)
        elif isinstance(chunk, ToolCallChunk):
            if gen.request.tool_choice == "none" and gen.request.tools:
                # the last step: tools are off, the reply ends here
                logger.warning("model called %s although tools were off; ignored", chunk.name)
                continue
            early = gen.early.get(calls_seen)
            calls_seen += 1
            if early is not None and await session.confirm_early_call(early, speech, step.index):
                step.calls.append(early)
                continue
            # a call made when the agent offers no tools is answered with an error output (unknown tool)
            arguments, error = parse_arguments(chunk.arguments)  # repaired when a model broke it
            refusal = None
            if len(step.calls) >= session.max_tool_calls_per_turn:  # committed as an error output, never run
                refusal = f"too many tool calls in one turn (at most {session.max_tool_calls_per_turn}); not run"
            item = FunctionCall(
                id=new_id("item"),
                call_id=session.call_id_for(chunk.call_id),
                name=chunk.name,
                arguments=arguments,
            )
            rc = session.start_tool_call(
                item, tools=tools, speech=speech, step=step.index, arguments_error=error, refusal=refusal
            )
            step.calls.append(rc)
        elif isinstance(chunk, Usage):
            speech.add_usage(chunk.prompt_tokens, chunk.completion_tokens)


async def _reply(session: ReplySession, job: ReplyJob) -> None:
    speech = job.speech
    answers_update = False  # the step answers a progress update: it may call no tool (the model cannot poll it)
    while True:
        index = speech.begin_step()
        preemptive = await session.usable_preemptive(job) if index == 0 else None
        job.preemptive = preemptive  # closed by run_job however this reply ends
        if preemptive is not None:
            gen = preemptive
        else:
            request = session.build_request(
                speech=speech,
                step=index,
                instructions=job.instructions,
                turn_messages=job.turn_messages,
                tools_off=answers_update,
            )
            gen = session.start_generation(request)
        speech.mark_generating()
        session.set_agent_state("thinking")
        session.events.emit(ev.GenerationStarted(speech_id=speech.id, step=index, preemptive=preemptive is not None))
        step = _open_step(session, job, index)

        consume = _consume(session, speech, gen, step)
        try:
            finished = await speech.run_unless_interrupted(consume)
        except LLMError as err:
            logger.error(
                "session %s: the model failed for speech %s: %s",
                session.id,
                speech.id,
                err,
                extra={"session_id": session.id, "speech_id": speech.id},
            )
            await _on_generation_failed(session, job, step, err)
            return
        except Exception as err:
            logger.exception("generation failed", extra={"session_id": session.id, "speech_id": speech.id})
            await _on_generation_failed(session, job, step, err)
            return
        finally:
            if gen is not preemptive:
                await gen.aclose()
        if not finished:
            await _on_interrupted(session, speech, step)
            return
        if not await _play_out(session, speech, step):
            return

        if not step.calls:
            return
        session.set_agent_state("thinking")
        settled = await speech.wait_if_not_interrupted([rc.settled_fut for rc in step.calls])
        if not settled or speech.interrupted:
            await _on_interrupted(session, speech, None)
            return
        if not any(rc.needs_reply for rc in step.calls):
            return
        if index >= session.max_tool_steps:
            return
        # a call that asks for a reply and moved to the background: the next step answers its update (and its result
        # too if it ended meanwhile; whether it did is a race, so it does not decide)
        answers_update = any(rc.needs_reply and rc.info.background for rc in step.calls)


async def _on_generation_failed(session: ReplySession, job: ReplyJob, step: _Step, err: BaseException) -> None:
    speech = job.speech
    played = step.stream.played_text
    step.stream.stop()
    await _commit_message(session, speech, step, played, interrupted=True)
    session.events.emit(ev.GenerationFailed(speech_id=speech.id, step=step.index, error=str(err) or type(err).__name__))
    line = session.model_error_line
    if line and not speech.interrupted:
        await _speak_line(session, job, line)


async def _speak_line(session: ReplySession, job: ReplyJob, text: str) -> None:
    """Say ``text`` as a further step of the job's speech (committed like a reply: only what was heard)."""
    speech = job.speech
    step = _Step(speech.begin_step(), session.playout.start(speech.id))
    job.streams.append(step.stream)
    speech.follow_playout(lambda: step.stream.played_text)
    speech.text = (speech.text + " " + text).strip()
    _begin_playing(session, speech, step)
    step.stream.push(text)
    await _play_out(session, speech, step)


async def _play_out(session: ReplySession, speech: SpeechHandle, step: _Step) -> bool:
    """Play the rest of the step's text and commit what was heard; False when it was interrupted."""
    step.stream.end_input()
    finished = await speech.run_unless_interrupted(step.stream.wait_done())
    if not finished or speech.interrupted:
        await _on_interrupted(session, speech, step)
        return False
    speech.played_text = (speech.played_text + " " + step.stream.played_text).strip()
    last = not step.calls  # a step that called no tool is the reply's last (an error line is one too)
    await _commit_message(session, speech, step, step.stream.played_text, interrupted=False, last=last)
    speech.end_step()
    return True


__all__ = ["ReplyJob", "ReplySession", "run_job"]
