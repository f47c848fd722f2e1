"""ToolExecutor: runs tool calls and commits each call/output pair the moment the call ends (I1, I5)."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from . import event_types as ev
from .aio import cancel_and_wait, resolve
from .call_ends import CallEnds
from .chat import ChatContext, FunctionCall, new_id, utcnow
from .companions import COMPANION_TOOLS, companion_tools
from .duplicates import duplicate_verdict, validate_arguments
from .events import EventLog
from .ports import Commit, Receipt, completions
from .speech import RUNNING_CALL, NotInterruptible, SpeechHandle, SpeechInfo, SpeechInterrupted
from .tool_call import (
    INTERNAL_ERROR_OUTPUT,
    TIMED_OUT,
    AlreadyEnded,
    EndRecord,
    Handoff,
    NotCancellable,
    Outcome,
    RunningCall,
    ToolCallNotFound,
    cancelled_outcome,
    dropped_outcome,
    outcome_of,
    progress_pair,
    protected_by_speech,
    stopped_outcome,
    without_handoff,
)
from .tools import (
    MAX_PROGRESS_CHARS,
    DropReason,
    FunctionTool,
    ProgressUpdate,
    RunContext,
    SessionControl,
    StopResponse,
    ToolCallInfo,
    ToolCancelled,
    ToolStatus,
    capped_output,
)

logger = logging.getLogger("switchboard.runtime.tools")

TOOL_CANCEL_GRACE_S = 1.0
# a body still running this long after it was cancelled ignores cancellation: its call ends without it
TOOL_ABANDON_GRACE_S = 1.0
KEEP_ENDED_CALLS = 1000  # ended calls kept in memory per session (the store keeps every one)
PROGRESS_KEPT = 50  # progress updates kept on a tool call's record
STOPPING_ERRORS = (ToolCancelled, SpeechInterrupted, StopResponse)


class ToolExecutor(CallEnds):
    """Runs a session's tool calls; each call commits its own pair when it ends (I1, I5).

    A call whose tool asks for a handoff is held, not ended: the executor reports it through ``on_handoff`` and
    the session performs the handoff, then ends the call with ``end_with_handoff`` (or ``end_without_handoff``).
    The executor itself never waits on the session.
    """

    def __init__(
        self,
        session_id: str,
        *,
        chat: ChatContext,
        events: EventLog,
        commit: Callable[[Commit], Awaitable[None]],
        on_ended: Callable[[RunningCall, bool], None],
        on_handoff: Callable[[RunningCall], None] | None = None,
        owed_by_end: Callable[[RunningCall, Outcome], list[SpeechInfo]] | None = None,
        cancel_grace_s: float = TOOL_CANCEL_GRACE_S,
        session: SessionControl | None = None,
    ) -> None:
        self.session_id = session_id
        self.session = session  # what a tool reaches through ``ctx.session``
        self.userdata: dict[str, Any] = {}
        self._chat = chat
        self._events = events
        self._commit = commit
        self._on_ended = on_ended
        self._on_handoff = on_handoff
        self._owed_by_end = owed_by_end
        self._cancel_grace_s = cancel_grace_s
        self._calls: dict[str, RunningCall] = {}
        self._closing = False
        self._abandoning = False
        self.forgotten = 0  # ended calls dropped from memory (read them from the store)
        self._companion_tools: dict[str, FunctionTool] | None = None
        self._abandoned: set[asyncio.Task[Any]] = set()  # tool bodies that ignored cancellation
        # ends the store refused every time (call id -> what to write, and the agent that made the call), and the
        # tasks writing them again: a call never stays `running` in the store while it ended here (I8)
        self._unwritten: dict[str, tuple[EndRecord, str | None]] = {}
        self._repairs: set[asyncio.Task[Any]] = set()

    # -- queries --------------------------------------------------------------------------------------------

    def get(self, call_id: str) -> RunningCall | None:
        return self._calls.get(call_id)

    def _forget_old_calls(self) -> None:
        # a long-lived session keeps its latest ended calls in memory; all of them are in the store
        excess = len(self._calls) - KEEP_ENDED_CALLS
        if excess <= 0:
            return
        for call_id in [cid for cid, rc in self._calls.items() if rc.ended][:excess]:
            del self._calls[call_id]
            self.forgotten += 1

    def calls(self) -> list[RunningCall]:
        return list(self._calls.values())

    def running(self) -> list[RunningCall]:
        return [c for c in self._calls.values() if not c.ended]

    def adopt(self, info: ToolCallInfo) -> None:
        """Remember an ended call from before a restart (so it can be listed and is never run again)."""
        if info.call_id not in self._calls and info.ended:
            self._calls[info.call_id] = RunningCall.adopted_call(self, info)

    # -- starting -------------------------------------------------------------------------------------------

    def start(
        self,
        item: FunctionCall,
        *,
        tools: Mapping[str, FunctionTool],
        speech: SpeechHandle | None,
        step: int,
        agent: str | None,
        arguments_error: str | None = None,
        refusal: str | None = None,
        speculative: bool = False,
    ) -> RunningCall:
        """Start executing ``item`` now. Returns at once; the call commits its own pair when it ends. With a
        ``refusal`` it never runs: it ends ``rejected`` with that output, so the model sees why (I1, I5 hold).

        A ``speculative`` call (made by a speculative reply, of a tool free of side effects) runs at once, but its end
        waits for its reply's verdict: ``confirm`` (it ends as any call, its pair committed: I1) or ``drop`` (it ends
        ``cancelled`` with its record alone: nothing of it reaches the chat)."""
        if item.call_id in self._calls:
            # a model that reuses a call id must not re-run (or overwrite) an earlier call
            item = item.model_copy(update={"call_id": f"{item.call_id}~{new_id('dup')}"})
        tool = tools.get(item.name)
        companion = item.name in COMPANION_TOOLS
        if companion and tool is None and self.has_cancellable(tools):
            tool = self._companions().get(item.name)  # only when they were offered to the model
        info = ToolCallInfo(
            call_id=item.call_id,
            name=item.name,
            arguments=item.arguments,
            cancellable=bool(tool and tool.policy.allow_cancellation),
            scope=tool.policy.scope if tool else "agent",
            speech_id=speech.id if speech else None,
            agent=agent,
            speculative=speculative,
            started_at=utcnow(),
        )
        rc = RunningCall(self, item, info, tool, speech, step, arguments_error=arguments_error, refusal=refusal)
        if tool is not None and arguments_error is None and refusal is None:
            validate_arguments(rc, tool)  # now, in call order: a later duplicate compares against it
        self._calls[item.call_id] = rc
        available = self._available(tools)
        rc.task = asyncio.create_task(self._run(rc, available), name=f"tool:{item.name}:{item.call_id}")
        return rc

    def rerun(self, info: ToolCallInfo, *, tools: Mapping[str, FunctionTool], agent: str | None) -> RunningCall:
        """Run again a call that a restart left running (its tool is declared ``on_restart="retry"``).

        A call that was already in the background stays there: its "running in the background" pair is committed,
        so its updates add no second pair and its result is a ``<call_id>/final`` pair.
        """
        item = self._call_item(info)
        rc = self.start(item, tools=tools, speech=None, step=0, agent=agent)
        if info.background:  # safe: the runner has not started yet
            rc.info = rc.info.model_copy(update={"background": True, "progress": info.progress})
            rc.updates = 1 + self._chat.count_calls(f"{info.call_id}/update/")
        return rc

    def resume(self, info: ToolCallInfo, *, tool: FunctionTool, tools: Mapping[str, FunctionTool]) -> RunningCall:
        """Resume a call that its session left running when it stopped where it ran (a crash, a restart, a move to
        another node), its tool declared ``on_restart="resume"``: the tool's body runs again, told so
        (``ctx.resumed``), to pick up the work under way rather than start it again.

        It goes on as the same call, run by ``tool`` (the tool of the agent that made it; ``tools`` are the session's
        agent's): its record as it was (its start, its agent, a call already in the background stays there, with the
        updates it made), no second ``tool.started``, and no duplicate check (it was admitted when it started).
        """
        item = self._call_item(info)
        rc = RunningCall(self, item, info, tool, None, 0, resumed=True)
        if info.background:
            rc.updates = 1 + self._chat.count_calls(f"{info.call_id}/update/")
        validate_arguments(rc, tool)
        self._calls[info.call_id] = rc
        available = self._available(tools)
        rc.task = asyncio.create_task(self._run(rc, available), name=f"tool:{info.name}:{info.call_id}")
        return rc

    def _call_item(self, info: ToolCallInfo) -> FunctionCall:
        """The chat's item of a call left running by a restart (rebuilt from its record if the chat lacks it)."""
        return self._chat.find_call(info.call_id) or FunctionCall(
            id=new_id("item"),
            call_id=info.call_id,
            name=info.name,
            arguments=info.arguments,
            created_at=info.started_at,
        )

    def _available(self, tools: Mapping[str, FunctionTool]) -> list[str]:
        """The tool names a call's model could use: ``tools``, and the companions when one of them is cancellable."""
        return sorted({*tools, *(self._companions() if self.has_cancellable(tools) else {})})

    @staticmethod
    def has_cancellable(tools: Mapping[str, FunctionTool]) -> bool:
        return any(t.policy.allow_cancellation for t in tools.values())

    def tools_for_model(self, tools: Mapping[str, FunctionTool]) -> dict[str, FunctionTool]:
        """The agent's tools plus the companion tools whenever one of them is cancellable."""
        if not self.has_cancellable(tools):
            return dict(tools)
        return {**self._companions(), **tools}

    # -- running --------------------------------------------------------------------------------------------

    async def _run(self, rc: RunningCall, available: list[str]) -> None:
        try:
            outcome = await self._start_and_execute(rc, available)
            if rc.info.speculative:  # its end waits for its reply's verdict (``_finish`` ends a dropped one)
                await asyncio.shield(rc.verdict_fut)
            if outcome.handoff is not None and not rc.info.speculative:
                await self._hold_for_handoff(rc, outcome)
                return
        except asyncio.CancelledError:
            # only a forced teardown cancels the runner: record the call's end, then re-raise
            await self._stop_body(rc)
            if self._abandoning:
                raise  # shutdown: the call stays `running` in the store and is recovered on the next start
            await asyncio.shield(self._finish(rc, stopped_outcome(rc)))
            raise
        # the end is recorded even if a teardown cancels this task meanwhile (I5: every call ends exactly once)
        await asyncio.shield(self._finish(rc, outcome))

    async def _start_and_execute(self, rc: RunningCall, available: list[str]) -> Outcome:
        if rc.resumed:  # started before, and recorded then: it goes on
            return await self._execute(rc, available)
        try:
            await self._commit(Commit(tool_calls=[rc.info]))
        except Exception:
            # the store refused the call's record for good: it is not run, and its end is written as a whole
            return Outcome(ToolStatus.FAILED, "The tool call could not be recorded, so it was not run.", True)
        self._events.emit(
            ev.ToolStarted(
                call_id=rc.info.call_id,
                name=rc.info.name,
                arguments=rc.info.arguments,
                cancellable=rc.info.cancellable,
                speech_id=rc.info.speech_id,
                **({"speculative": True} if rc.info.speculative else {}),
            )
        )
        return await self._execute(rc, available)

    async def _stop_body(self, rc: RunningCall) -> None:
        """Cancel the tool's body and wait for it, at most ``TOOL_ABANDON_GRACE_S``; a body that ignores
        cancellation is abandoned (still running, never awaited) so that no teardown waits on it forever."""
        task = rc.tool_task
        if task is None:
            return
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=TOOL_ABANDON_GRACE_S)
        if task.done():
            self._body_ended_unheard(rc, task)
        else:
            self._abandon_body(rc)

    async def _hold_for_handoff(self, rc: RunningCall, outcome: Outcome) -> None:
        """Report the requested handoff and wait until the call has been ended by whoever performs it."""
        rc.held = outcome
        if self._on_handoff is None:  # nobody here performs handoffs: the call completes without one
            target = outcome.handoff.name if outcome.handoff is not None else "another agent"
            done = replace(outcome, output=outcome.output or f"Transferred to {target}.", handoff=None)
            await asyncio.shield(self._finish(rc, done))
            return
        self._on_handoff(rc)
        # a forced teardown cancels this wait (never the end itself) and ends the call as stopped
        await asyncio.shield(rc.ended_fut)

    async def _execute(self, rc: RunningCall, available: list[str]) -> Outcome:
        name = rc.info.name
        if rc.refusal is not None:
            return Outcome(ToolStatus.REJECTED, rc.refusal, is_error=True)
        if rc.tool is None:
            return Outcome(
                ToolStatus.FAILED,
                f"Unknown tool '{name}'. Available tools: {', '.join(available) or '(none)'}.",
                is_error=True,
            )
        if rc.arguments_error is not None:
            return Outcome(ToolStatus.FAILED, f"Invalid arguments for {name}: {rc.arguments_error}", True)
        if rc.invalid is not None:
            return Outcome(ToolStatus.FAILED, rc.invalid, is_error=True)
        args = rc.args

        judged = rc.cancel_reason is not None or rc.resumed  # a resumed call was admitted when it started
        refused = await self._apply_duplicate_policy(rc, args) if not judged else None
        if refused is not None:
            return refused
        if rc.cancel_reason is not None:  # cancelled before its body started: it never runs
            return cancelled_outcome(rc)

        ctx = RunContext(rc)
        body_context = contextvars.copy_context()
        body_context.run(RUNNING_CALL.set, rc)  # what a wait on a speech checks (``CircularWait``)
        rc.tool_task = asyncio.create_task(rc.tool.invoke(ctx, args), name=f"tool-body:{name}", context=body_context)
        limit_s = rc.tool.call_timeout_s
        timer = asyncio.get_running_loop().call_later(limit_s, self._time_out, rc) if limit_s is not None else None
        try:
            await self._await_body(rc, rc.tool_task)
        finally:
            if timer is not None:
                timer.cancel()
        return outcome_of(rc, self.session_id)

    def _time_out(self, rc: RunningCall) -> None:
        """The call ran past its tool's ``timeout_s``: its body is cancelled at once (``ctx.cancelled`` too, for a
        tool that checks it) and the call ends `failed`. A body that ignores it makes the call `cancelling` until it
        returns, as for any cancellation. A call cancelled earlier keeps that end."""
        task = rc.tool_task
        if task is None or task.done() or rc.ended or rc.ending or rc.cancel_reason is not None:
            return
        rc.timed_out = True
        rc.cancel_reason = TIMED_OUT
        resolve(rc.cancel_fut, None)
        self._force_cancel(rc)

    async def _await_body(self, rc: RunningCall, body: asyncio.Task[Any]) -> None:
        """Wait for the tool's body. One that ignores an operator's or the model's cancellation past its grace does
        not end its call: the call is `cancelling`, still running and listed, until the body returns (it can still
        act); a drain or a close lets it go (``abandoned_fut``)."""
        await asyncio.wait({body, rc.abandoned_fut, rc.deaf_fut}, return_when=asyncio.FIRST_COMPLETED)
        if body.done() or rc.abandoned_fut.done():
            return
        await asyncio.shield(self._mark_cancelling(rc))
        await asyncio.wait({body, rc.abandoned_fut}, return_when=asyncio.FIRST_COMPLETED)

    async def _mark_cancelling(self, rc: RunningCall) -> None:
        """Record and report that the call is `cancelling` (durable first, I6); the cancel waiting on it returns."""
        try:
            async with rc.write_lock:  # in order with its progress, and never after its end
                if rc.ended or rc.ending:
                    return
                info = rc.info.model_copy(update={"status": ToolStatus.CANCELLING})
                receipts, rc.cancel_receipts = rc.cancel_receipts, []  # the cancel's effect: answered by this record
                try:
                    await self._commit(Commit(tool_calls=[info], receipts=completions(info, *receipts)))
                except Exception:  # it stays `running` in the store and here; its end is written when it comes
                    logger.error(
                        "tool call %s (%s) is cancelling, but that could not be stored",
                        rc.call_id,
                        rc.info.name,
                        extra={"session_id": self.session_id, "call_id": rc.call_id},
                    )
                    return
                rc.info = info
                self._events.emit(ev.ToolCancelling(call_id=rc.call_id, reason=rc.cancel_reason or "cancelled"))
        finally:
            # the reply that made it goes on without it, asking for no tool reply of its own (it was cancelled): its
            # pair lands when its body returns
            rc.needs_reply = False
            resolve(rc.settled_fut, None)
            resolve(rc.cancelling_fut, None)

    async def _apply_duplicate_policy(self, rc: RunningCall, args: dict[str, Any]) -> Outcome | None:
        # only calls started before this one count: duplicates started together must not refuse (or cancel) each other
        calls = list(self._calls.values())
        verdict = duplicate_verdict(rc, args, calls[: calls.index(rc)])
        if verdict.refusal is None and verdict.replaces:
            await asyncio.gather(*(self._cancel(o, f"replaced by {rc.info.call_id}") for o in verdict.replaces))
        return verdict.refusal

    async def end_with_handoff(self, rc: RunningCall, handoff: Handoff) -> bool:
        """End a held call with its handoff, committed together with its pair. False when the call had ended
        meanwhile (a forced teardown): then nothing of the handoff was committed."""
        assert rc.held is not None and rc.held.handoff is not None, "only a call held for its handoff"
        return await asyncio.shield(self._finish(rc, rc.held, handoff))

    async def end_without_handoff(self, rc: RunningCall, reason: str) -> None:
        """End a held call without its handoff, for ``reason``: the tool's result (it did its work) is kept."""
        assert rc.held is not None and rc.held.handoff is not None, "only a call held for its handoff"
        await asyncio.shield(self._finish(rc, without_handoff(rc.held, reason)))

    async def _finish(self, rc: RunningCall, outcome: Outcome, handoff: Handoff | None = None) -> bool:
        if rc.ended or rc.ending:
            return False
        if rc.info.speculative:  # never confirmed: dropped (or stopped with the session before any verdict)
            outcome, handoff = dropped_outcome(rc.dropped or "session_stopped"), None
        rc.ending = True
        try:
            async with rc.write_lock:  # after any update still being written: the end is the call's last write
                await self._commit_end(rc, outcome, handoff)
        except BaseException:
            rc.ending = False
            raise
        return True

    async def report_progress(
        self,
        rc: RunningCall,
        message: str,
        progress: float | None,
        receipt: Receipt[ToolCallInfo] | None = None,
        *,
        silent: bool = False,
    ) -> None:
        """Write and report one update (its message cut at ``MAX_PROGRESS_CHARS``, with a marker); an update once
        the call's end is decided is ignored (it never reopens the call). Shielded: a tool cancelled meanwhile never
        leaves an update durable but not applied. The update's commit completes ``receipt``. A ``silent`` first
        update moves the call to the background asking the reply for no step that answers it."""
        if rc.ended or rc.ending:
            return
        message = capped_output(message, MAX_PROGRESS_CHARS)
        await asyncio.shield(self._report_progress(rc, message, progress, receipt, silent))

    async def _report_progress(
        self,
        rc: RunningCall,
        message: str,
        progress: float | None,
        receipt: Receipt[ToolCallInfo] | None,
        silent: bool,
    ) -> None:
        async with rc.write_lock:  # one at a time: only the first update of a call commits its pair
            if rc.ended or rc.ending:
                return
            first = not rc.info.background
            try:
                await self._write_progress(rc, message, progress, receipt)
            except Exception:
                # progress is best effort: a write the store refuses must not fail the tool's work
                logger.error(
                    "a progress update of tool call %s (%s) could not be stored",
                    rc.call_id,
                    rc.info.name,
                    extra={"session_id": self.session_id, "call_id": rc.call_id},
                )
                return
            if first and silent:
                rc.needs_reply = False  # in the background with no step of the reply to answer it
        self._events.emit(ev.ToolProgress(call_id=rc.info.call_id, message=message, progress=progress))
        resolve(rc.settled_fut, None)

    async def _write_progress(
        self, rc: RunningCall, message: str, progress: float | None, receipt: Receipt[ToolCallInfo] | None
    ) -> None:
        update = ProgressUpdate(message=message, progress=progress, at=utcnow())
        # the record keeps the latest updates (each write stays small); the event log keeps every one of them
        kept = [*rc.info.progress[-(PROGRESS_KEPT - 1) :], update]
        if rc.info.speculative:  # no reply is confirmed to go on without it: recorded, and no pair reaches the chat
            info = rc.info.model_copy(update={"progress": kept})
            await self._commit(Commit(tool_calls=[info], receipts=completions(info, receipt)))
            rc.info = info
            return
        info = rc.info.model_copy(update={"progress": kept, "background": True})
        # the first update moves the call to the background with its own pair; each later one is a pair of its own
        # (``<call_id>/update/<n>``): every update reaches the model, which can narrate progress
        items = progress_pair(rc, update)
        await self._commit(Commit(items=items, tool_calls=[info], receipts=completions(info, receipt)))
        rc.info = info
        rc.updates += 1
        self._chat.append(*items)
        for it in items:
            self._events.emit(ev.ChatItemAdded(item=it))

    # -- cancelling and draining ----------------------------------------------------------------------------

    async def cancel(
        self,
        call_id: str,
        *,
        reason: str = "cancelled by an operator",
        force: bool = False,
        receipt: Receipt[ToolCallInfo] | None = None,
    ) -> ToolCallInfo:
        """Cancel a running cancellable call and return its record once it has ended (``cancelled``), or once it is
        ``cancelling``: its tool ignored the cancellation past the grace, and the call ends when its body returns.

        Refused (``NotInterruptible``) while the speech that made the call is still going on and does not allow
        interruptions, unless ``force``: cancelling its work would interrupt what that speech protects. When this
        call is what cancels it, its end completes ``receipt``.
        """
        rc = self._calls.get(call_id)
        if rc is None:
            raise ToolCallNotFound(call_id)
        if rc.ended:
            raise AlreadyEnded(rc.info)
        if not rc.info.cancellable:
            raise NotCancellable(f"tool call {call_id} ({rc.info.name}) does not allow cancellation")
        if rc.info.speculative:
            raise NotCancellable(f"tool call {call_id} ({rc.info.name}) belongs to a reply not confirmed yet")
        if not force and protected_by_speech(rc):
            assert rc.speech is not None
            raise NotInterruptible(
                f"tool call {call_id} ({rc.info.name}) belongs to speech {rc.speech.id}, which does not allow "
                "interruptions"
            )
        if receipt is not None and rc.cancel_reason is None:
            rc.cancel_receipts.append(receipt)
        await self._cancel(rc, reason)
        if rc.ended and rc.info.status is not ToolStatus.CANCELLED:
            raise AlreadyEnded(rc.info)
        return rc.info

    # -- speculative calls ----------------------------------------------------------------------------------

    async def confirm(self, rc: RunningCall, speech: SpeechHandle, step: int) -> bool:
        """The speculative reply that made ``rc`` is confirmed and plays as ``speech``: the call is one of its calls
        now, and ends as any call does (its pair committed, I1). False when it was dropped first."""
        async with rc.write_lock:  # in order with its progress; its end, waiting for the verdict, comes after
            if rc.verdict_fut.done() or rc.ended or rc.ending:
                return False
            rc.speech, rc.step = speech, step
            rc.item = rc.item.model_copy(update={"created_at": utcnow()})  # it joins the conversation now
            rc.info = rc.info.model_copy(update={"speculative": False, "speech_id": speech.id})
            resolve(rc.verdict_fut, None)
            try:
                await asyncio.shield(self._commit(Commit(tool_calls=[rc.info])))
            except Exception:  # its end carries the same record
                logger.error(
                    "tool call %s (%s) was confirmed, but that could not be stored",
                    rc.call_id,
                    rc.info.name,
                    extra={"session_id": self.session_id, "call_id": rc.call_id},
                )
        return True

    def drop(self, rc: RunningCall, reason: DropReason) -> None:
        """The speculative reply that made ``rc`` was dropped: the call is cancelled (a body that ignores it is let
        go) and ends ``cancelled`` with its record alone, its ``tool.ended`` saying ``reason``."""
        if rc.verdict_fut.done() or not rc.info.speculative:
            return
        resolve(rc.verdict_fut, reason)
        if not rc.ended:
            rc.drained = True
            self._request_cancel(rc, f"its speculative reply was dropped: {reason}")

    def _request_cancel(self, rc: RunningCall, reason: str) -> None:
        if rc.ended or rc.cancel_reason is not None:
            return
        rc.cancel_reason = reason
        resolve(rc.cancel_fut, None)
        # cooperative first; a tool that ignores ctx.cancelled is cancelled after a grace period, and one that
        # ignores that too is `cancelling` (or, for a drain, let go) after another, so that the cancel always returns
        loop = asyncio.get_running_loop()
        loop.call_later(self._cancel_grace_s, self._force_cancel, rc)
        # not started yet: the runner sees cancel_reason before starting the body (cancelling the runner itself
        # could hit its first commit, and the call would then never end)

    async def _cancel(self, rc: RunningCall, reason: str) -> None:
        """Cancel ``rc``; return once it has ended, or is `cancelling` (its tool ignores cancellation)."""
        self._request_cancel(rc, reason)
        if not rc.ended:
            # futures only: cancelling this wait cancels neither
            await asyncio.wait({rc.ended_fut, rc.cancelling_fut}, return_when=asyncio.FIRST_COMPLETED)

    async def _drain_call(self, rc: RunningCall, reason: str) -> None:
        """Cancel ``rc`` for a drain (a handoff, a close) and wait until it has ended: a body that ignores its
        cancellation is let go, so that the drain is bounded."""
        rc.drained = True
        self._request_cancel(rc, reason)
        if rc.deaf_fut.done():  # cancelling already: its body is not waited for
            self._abandon_body(rc)
        await asyncio.shield(rc.ended_fut)

    async def drain(self, *, scope: str | None = None, exclude: Iterable[str] = ()) -> None:
        """Cancel the cancellable running calls (of ``scope``, or all) and wait for the others to end."""
        skip = set(exclude)
        targets = [
            rc for rc in self.running() if rc.info.call_id not in skip and (scope is None or rc.info.scope == scope)
        ]
        for rc in targets:  # a handoff or a close changes what a speculative reply was made from
            self.drop(rc, "context_changed" if scope == "agent" else "session_stopped")
        waits = [
            self._drain_call(rc, "agent handoff" if scope == "agent" else "session closed")
            if rc.info.cancellable
            else asyncio.shield(rc.ended_fut)
            for rc in targets
        ]
        if waits:
            await asyncio.gather(*waits)

    async def aclose(self, *, timeout_s: float) -> None:
        """Drain every call; whatever is still running after ``timeout_s`` is stopped and ends interrupted."""
        self._closing = True
        try:
            async with asyncio.timeout(timeout_s):
                await self.drain()
        except TimeoutError:
            stuck = self.running()
            logger.error(
                "%d tool call(s) still running at close; stopping them: %s",
                len(stuck),
                ", ".join(f"{rc.call_id} ({rc.info.name})" for rc in stuck),
                extra={"session_id": self.session_id},
            )
            await cancel_and_wait(*(rc.task for rc in stuck))
        await asyncio.gather(*(rc.task for rc in self._calls.values() if rc.task), return_exceptions=True)
        await self._ends_written()

    async def _ends_written(self) -> None:
        # an end still being written (or written again after a store error) outlives its cancelled runner: the
        # close or shutdown returns only once it is done, so no write of this session lands after it
        ending = [asyncio.shield(rc.ended_fut) for rc in self._calls.values() if rc.ending and not rc.ended]
        if ending:
            await asyncio.gather(*ending)

    def _force_cancel(self, rc: RunningCall) -> None:
        task = rc.tool_task
        if task is None or task.done() or rc.ended:
            return
        task.cancel()
        asyncio.get_running_loop().call_later(TOOL_ABANDON_GRACE_S, self._ignored_cancel, rc)

    def _ignored_cancel(self, rc: RunningCall) -> None:
        """The body still runs past both graces: a drain or a close lets it go; otherwise the call is `cancelling`
        until it returns (operators never see a call ended while it can still act)."""
        task = rc.tool_task
        if task is None or task.done() or rc.ended:
            return
        if rc.drained or self._closing:
            self._abandon_body(rc)
            return
        logger.error(
            "tool %s ignores cancellation; call %s is cancelling until it returns",
            rc.info.name,
            rc.call_id,
            extra={"session_id": self.session_id, "call_id": rc.call_id},
        )
        resolve(rc.deaf_fut, None)

    def _abandon_body(self, rc: RunningCall) -> None:
        task = rc.tool_task
        if task is None or task.done() or rc.ended:
            return
        logger.error(
            "tool %s ignores cancellation; call %s ends without it",
            rc.info.name,
            rc.call_id,
            extra={"session_id": self.session_id, "call_id": rc.call_id},
        )
        self._abandoned.add(task)  # a reference until it ends (if it ever does); nothing awaits it
        task.add_done_callback(self._abandoned.discard)
        task.add_done_callback(functools.partial(self._body_ended_unheard, rc))
        resolve(rc.abandoned_fut, None)

    def _body_ended_unheard(self, rc: RunningCall, task: asyncio.Task[Any]) -> None:
        # a body stopped at a teardown or abandoned does not decide how its call ends: what it raised is only logged
        # (unless it is how a tool says it stopped)
        if task.cancelled() or (error := task.exception()) is None or isinstance(error, STOPPING_ERRORS):
            return
        logger.warning(
            "tool %s raised after it was stopped; call %s ends without its result: %r",
            rc.info.name,
            rc.call_id,
            error,
            exc_info=error,
            extra={"session_id": self.session_id, "call_id": rc.call_id},
        )

    async def grace_for_uncancellable(self, grace_s: float) -> None:
        """A deploy is not a crash: a call that cannot be cancelled (a booking) gets up to ``grace_s`` to end and
        commit its pair before the process lets go of it (recovery then ends whatever is still running). A call
        whose tool resumes it where the session runs next needs no grace: it goes on there."""
        # a call held for its handoff has its result already: the handoff step ends it (``HandoffStep.hand_over``)
        pending = [
            rc.ended_fut
            for rc in self.running()
            if not rc.info.cancellable and rc.held is None and not resumes(rc.tool)
        ]
        if pending and grace_s > 0:
            await asyncio.wait(pending, timeout=grace_s)

    async def abandon(self) -> None:
        """Stop every running call without recording an end (service shutdown; recovery ends or re-runs them).
        An end the store kept refusing is left to the next owner too: the store has the call `running`."""
        self._abandoning = True
        await cancel_and_wait(*(rc.task for rc in self.running()))
        await self._ends_written()
        await self.stop_repairs()

    def _companions(self) -> dict[str, FunctionTool]:
        # Built once: a tool builds a pydantic model, too costly (and too much garbage) for every model request.
        if self._companion_tools is None:
            self._companion_tools = companion_tools(self)
        return self._companion_tools


def resumes(tool: FunctionTool | None) -> bool:
    """A call of ``tool`` goes on where its session runs next (``on_restart="resume"``)."""
    return tool is not None and tool.can_resume and tool.policy.on_restart == "resume"


__all__ = [
    "COMPANION_TOOLS",
    "INTERNAL_ERROR_OUTPUT",
    "AlreadyEnded",
    "Handoff",
    "NotCancellable",
    "Outcome",
    "RunningCall",
    "ToolCallNotFound",
    "ToolExecutor",
]
