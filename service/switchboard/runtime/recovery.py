"""Recovery after a restart: end what the crash left half-done, exactly once, with an output for every call."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

from . import event_types as ev
from .chat import FINAL_SUFFIX, ChatContext, ChatItem, ChatMessage, FunctionCall, FunctionCallOutput, new_id, utcnow
from .events import EventLog
from .executor import resumes
from .pending import PendingCommand
from .ports import ChatStore, Commit, Reported, Takeover, hold_subject
from .scheduled import accepted_event
from .session import AgentSession
from .speech import SpeechInfo, SpeechSource, SpeechState
from .tool_call import dropped_outcome, dropped_reason
from .tools import FunctionTool, ToolCallInfo, ToolStatus

logger = logging.getLogger("switchboard.runtime.recovery")

RESTART_OUTPUT = "The tool call was interrupted by a service restart."


async def recover(
    session: AgentSession,
    *,
    tool_calls: Sequence[ToolCallInfo],
    speeches: Sequence[SpeechInfo] = (),
    reported: Reported | None = None,
    tools_of: Callable[[str], Mapping[str, FunctionTool]] | None = None,
    pending: Sequence[PendingCommand] = (),
) -> dict[str, list[str]]:
    """Start ``session`` as recovered and settle what was in flight when its previous process stopped (a crash, a
    drain, a graceful restart, a lost lease: the same durable obligations, derived from the store alone).

    First the events a crash lost are emitted: each durable change that ``reported`` (what the durable event log
    holds) lacks gets its event, so nothing durable is left without one.

    Calls left ``running`` end ``interrupted`` with an is_error output (one pair, committed with the status in one
    transaction), unless their tool is declared ``on_restart="retry"``: those are run again, or
    ``on_restart="resume"``: those go on (their body runs again told it resumes, and waits for the work under way,
    such as a webhook backend's report, instead of starting it again).

    Speeches that had not finished are owed (``owed_speeches``): each is queued again under its id, in order (a
    reply generated anew from the chat as it is now, a say with its text), since the user is still waiting for it.
    One an interrupt had stopped (durably interrupted) ends interrupted, and a deferred reply another owed reply
    makes redundant ends without playing. Returns the call ids by outcome.

    ``tools_of`` gives the tools of an agent by name: a call that resumes goes on with the tool of the agent that
    made it, also after a handoff that the session's move did at once while that call still ran.

    ``pending`` are the scheduled commands and coaching notes accepted and not yet applied (their effect is not in
    the store: a command is marked applied in the commit of its effect): they are held again, once the owed speeches
    are queued (a command waiting for the end of one of them still waits for it), and apply when their point comes.
    """
    if reported is not None:
        # the hold first: input a crash left unreported was taken after it (a held session's is not answered)
        report_hold(session.events, session.seat.hold, reported)
        report_missing(session.events, session.chat.items, tool_calls, speeches, reported)
    for info in tool_calls:
        session.executor.adopt(info)
    await session.agent.load_tools()  # a call of an MCP tool is re-run or ended by its tool's policy
    interrupted, retry, resume = _split_running(tool_calls, session.agent.tools, tools_of)
    retry_ids = sorted(info.call_id for info in retry)
    resume_ids = sorted(info.call_id for info, _ in resume)
    unfinished = sorted((sp for sp in speeches if sp.state != SpeechState.DONE), key=lambda sp: sp.created_at)
    stopped = [sp for sp in unfinished if sp.interrupted]
    owed = owed_speeches(unfinished)
    owed_ids = {sp.id for sp in owed}
    superseded = [sp for sp in unfinished if not sp.interrupted and sp.id not in owed_ids]

    # the notes first: the first request made here (an owed reply, a hook's) is the one they are for
    session.coach.restore(_notes(pending, notes=True))
    await session.start(
        recovered=True,
        interrupted_calls=[i.call_id for i in interrupted],
        retried_calls=retry_ids,
        resumed_calls=resume_ids,
        interrupted_speeches=[sp.id for sp in stopped],
        resumed_speeches=[sp.id for sp in owed],
    )
    await _end_unfinished(session, stopped, interrupted=True)
    await _end_unfinished(session, superseded, interrupted=False)
    for info in interrupted:
        await _end_interrupted(session, info)
    # owed speeches first: the first one plays before a re-run call can end, so a re-run's result is always answered
    # by a reply of its own (a deferred reply), never by a race with the speech that made the call
    for sp in owed:
        logger.info("session %s: playing %s (%s), owed since before the restart", session.id, sp.id, sp.source)
        session.requeue(sp)
    _hold_pending(session, pending, reported)
    _restart_calls(session, retry, resume)
    return {"interrupted": [i.call_id for i in interrupted], "retried": retry_ids, "resumed": resume_ids}


def _notes(pending: Sequence[PendingCommand], *, notes: bool) -> list[PendingCommand]:
    """The coaching notes among ``pending`` (``notes``), or the scheduled commands."""
    return [c for c in pending if (c.kind == "coach") == notes]


def _hold_pending(session: AgentSession, pending: Sequence[PendingCommand], reported: Reported | None) -> None:
    """Hold again the scheduled commands that were pending (applied when their point comes; the notes are held
    already), each command and note reported as accepted first when a crash lost that event."""
    for command in pending:
        if reported is not None and command.id not in reported.pending:
            session.events.emit(accepted_event(command))
    session.scheduled.restore(_notes(pending, notes=False))
    session.scheduled.wake()


def _restart_calls(
    session: AgentSession, retry: Sequence[ToolCallInfo], resume: Sequence[tuple[ToolCallInfo, FunctionTool]]
) -> None:
    """Run again the calls whose tool asks for it, and resume those whose tool goes on where it was."""
    tools = session.agent.tools
    for info in retry:
        logger.info("session %s: re-running %s (%s) after a restart", session.id, info.name, info.call_id)
        session.executor.rerun(info, tools=tools, agent=session.agent.name)
    for info, tool in resume:
        logger.info("session %s: resuming %s (%s) after a restart", session.id, info.name, info.call_id)
        session.executor.resume(info, tool=tool, tools=tools)


def owed_speeches(unfinished: Sequence[SpeechInfo]) -> list[SpeechInfo]:
    """What a session owes of its speeches that had not finished (oldest first): each one no interrupt stopped.
    A deferred reply only answers results that landed outside of any reply: when a reply to input is owed too, that
    reply sees them (it is generated now), and of several deferred replies one is enough."""
    owed = [sp for sp in unfinished if not sp.interrupted]
    if any(sp.source in ("reply", "tool_reply") for sp in owed):
        return [sp for sp in owed if sp.source != "deferred_reply"]
    deferred = [sp for sp in owed if sp.source == "deferred_reply"]
    return [sp for sp in owed if sp.source != "deferred_reply" or sp is deferred[-1]]


def report_missing(
    events: EventLog,
    items: Sequence[ChatItem],
    tool_calls: Sequence[ToolCallInfo],
    speeches: Sequence[SpeechInfo],
    reported: Reported,
) -> int:
    """Emit the events of durable changes the durable log does not report (a crash came between a commit and its
    events): ``user.input`` for each input message and ``chat.item`` for each item, ``tool.ended`` for each ended
    call, ``speech.created`` for each speech and ``speech.done`` for each finished one. Returns how many."""
    missing = 0
    for it in items:
        if isinstance(it, ChatMessage) and it.role != "assistant" and it.id not in reported.inputs:
            events.emit(ev.UserInput(item_id=it.id, text=it.text, final=True, role=it.role))
            missing += 1
        if it.id not in reported.items:
            events.emit(ev.ChatItemAdded(item=it))
            missing += 1
    for info in tool_calls:
        if info.ended and info.call_id not in reported.ended_calls:
            events.emit(
                ev.ToolEnded(
                    call_id=info.call_id,
                    name=info.name,
                    status=info.status,
                    output=info.output or "",
                    is_error=info.is_error,
                    **({"reason": reason} if (reason := dropped_reason(info)) else {}),
                )
            )
            missing += 1
    for sp in speeches:
        if sp.id not in reported.created_speeches:
            events.emit(ev.SpeechCreated(speech_id=sp.id, source=_source(sp.source)))
            missing += 1
        if sp.state == SpeechState.DONE and sp.id not in reported.done_speeches:
            events.emit(ev.SpeechDone(speech_id=sp.id, interrupted=sp.interrupted))
            missing += 1
    if missing:
        logger.warning(
            "session %s: %d durable change(s) had no event (a crash); emitted them", events.session_id, missing
        )
    return missing


def report_hold(events: EventLog, hold: Takeover | None, reported: Reported) -> int:
    """Emit the hold events a crash lost (between an operator's takeover or hand-back and its event): a hold the log
    reports and the store no longer has is handed back (``until`` is when this is reported: the hand-back's own time
    is not kept), and the store's hold is reported taken over. Returns how many."""
    current = None
    if hold is not None:
        taken = ev.SessionTakenOver(
            operator=hold.operator, since=hold.since, **({"displaced": hold.displaced} if hold.displaced else {})
        )
        current = hold_subject(taken.data()["since"], hold.operator)
    missing = 0
    for subject in sorted(reported.open_holds() - {current}):
        since, _, operator = subject.partition(" ")
        events.emit(ev.SessionHandedBack(operator=operator, since=datetime.fromisoformat(since), until=utcnow()))
        missing += 1
    if hold is not None and current not in reported.taken_over:
        events.emit(taken)
        missing += 1
    if missing:
        logger.warning(
            "session %s: %d takeover event(s) had no event (a crash); emitted them", events.session_id, missing
        )
    return missing


def _source(source: str) -> SpeechSource:
    known: tuple[SpeechSource, ...] = ("reply", "say", "tool_reply", "deferred_reply", "operator")
    return next((s for s in known if s == source), "reply")


def _split_running(
    tool_calls: Sequence[ToolCallInfo],
    tools: Mapping[str, FunctionTool],
    tools_of: Callable[[str], Mapping[str, FunctionTool]] | None,
) -> tuple[list[ToolCallInfo], list[ToolCallInfo], list[tuple[ToolCallInfo, FunctionTool]]]:
    """The calls a restart left running: those to end interrupted, those whose tool asks to be re-run, and those
    whose tool resumes them, each with that tool (``on_restart``: ``fail``, ``retry``, ``resume``; a tool the agent no
    longer has fails, unless the call resumes with the tool of the agent that made it)."""
    interrupted: list[ToolCallInfo] = []
    retry: list[ToolCallInfo] = []
    resume: list[tuple[ToolCallInfo, FunctionTool]] = []
    for info in tool_calls:
        if info.ended:
            continue
        # cancelled, or of a speculative reply that is gone with the process: never run again, whatever its policy
        if info.status == ToolStatus.CANCELLING or info.speculative:
            interrupted.append(info)
            continue
        tool = tools.get(info.name)
        if tool is None and tools_of is not None and info.agent is not None:
            # made by the agent the session handed off from as it moved (a hand-over does a handoff under way at once,
            # leaving that agent's other calls running): one that resumes goes on with its own agent's tool
            theirs = tools_of(info.agent).get(info.name)
            tool = theirs if resumes(theirs) else None
        if tool is not None and resumes(tool):
            resume.append((info, tool))
        elif tool is not None and tool.policy.on_restart == "retry":
            retry.append(info)
        else:
            interrupted.append(info)
    return interrupted, retry, resume


async def _end_unfinished(session: AgentSession, unfinished: Sequence[SpeechInfo], *, interrupted: bool) -> None:
    if not unfinished:
        return
    ended = [sp.model_copy(update={"state": SpeechState.DONE, "interrupted": interrupted}) for sp in unfinished]
    await session.commit(Commit(speeches=ended))
    for sp in ended:
        session.events.emit(ev.SpeechDone(speech_id=sp.id, interrupted=interrupted))


async def _end_interrupted(session: AgentSession, info: ToolCallInfo) -> None:
    items, ended = restart_end(info, session.chat)
    await session.commit(Commit(items=items, tool_calls=[ended]))
    session.chat.append(*items)
    session.executor.adopt(ended)
    _report(session.events, items, ended)


async def end_orphaned_calls(
    session_id: str,
    *,
    tool_calls: Sequence[ToolCallInfo],
    chat: ChatContext,
    store: ChatStore,
    events: EventLog,
) -> list[str]:
    """For a session that cannot be recovered (its agent is gone): end the calls it left running as interrupted,
    each with its output, so that every call still ends exactly once (I5). Returns their call ids."""
    ended_ids: list[str] = []
    for info in tool_calls:
        if info.ended:
            continue
        items, ended = restart_end(info, chat)
        await store.commit(session_id, Commit(items=items, tool_calls=[ended]))
        chat.append(*items)
        _report(events, items, ended)
        ended_ids.append(info.call_id)
    return ended_ids


def restart_end(info: ToolCallInfo, chat: ChatContext) -> tuple[list[ChatItem], ToolCallInfo]:
    """What ends ``info`` as interrupted by the restart: the items ``chat`` still lacks (the call's pair; for a call
    already in the background, a ``<call_id>/final`` pair) and the ended record. Commit them together. A call of a
    speculative reply (never confirmed: that reply is gone) ends ``cancelled`` with its record alone."""
    now = utcnow()
    if info.speculative:
        dropped = dropped_outcome("session_stopped")
        return [], info.model_copy(
            update={
                "status": dropped.status,
                "output": dropped.output,
                "is_error": True,
                "error": "session_stopped",
                "ended_at": now,
            }
        )
    if info.background:
        # its first pair (the "running in the background" output) is already committed; the end gets its own pair
        call_id = f"{info.call_id}{FINAL_SUFFIX}"
        created_at = now
    else:
        call_id, created_at = info.call_id, info.started_at
    items: list[ChatItem] = []
    if chat.find_call(call_id) is None:
        items.append(
            FunctionCall(
                id=new_id("item"), call_id=call_id, name=info.name, arguments=info.arguments, created_at=created_at
            )
        )
    if not chat.has_output(call_id):
        items.append(
            FunctionCallOutput(
                id=new_id("item"), call_id=call_id, name=info.name, output=RESTART_OUTPUT, is_error=True, created_at=now
            )
        )
    ended = info.model_copy(
        update={"status": ToolStatus.INTERRUPTED, "output": RESTART_OUTPUT, "is_error": True, "ended_at": now}
    )
    return items, ended


def _report(events: EventLog, items: Sequence[ChatItem], ended: ToolCallInfo) -> None:
    for it in items:
        events.emit(ev.ChatItemAdded(item=it))
    events.emit(
        ev.ToolEnded(
            call_id=ended.call_id,
            name=ended.name,
            status=ended.status,
            output=ended.output or RESTART_OUTPUT,
            is_error=True,
            **({"reason": "session_stopped"} if ended.speculative else {}),
        )
    )
