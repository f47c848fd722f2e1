"""One tool call: its live state (``RunningCall``), how it ends (``Outcome``, from what its body returned or raised)
and what its end writes."""

from __future__ import annotations

import asyncio
import functools
import logging
import typing
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from .agent import Agent
from .chat import FINAL_SUFFIX, AgentHandoff, ChatItem, FunctionCall, FunctionCallOutput, new_id, utcnow
from .ports import Commit, Completion, Receipt, SessionState
from .redaction import redact
from .speech import SpeechHandle, SpeechInfo, SpeechInterrupted
from .text import valid_text
from .tools import (
    DropReason,
    FunctionTool,
    ProgressUpdate,
    SessionControl,
    StopResponse,
    ToolCallInfo,
    ToolCancelled,
    ToolError,
    ToolStatus,
    UnusableResult,
    capped_output,
    render_output,
)
from .trusted import trusted

logger = logging.getLogger("switchboard.runtime.tools")

INTERNAL_ERROR_OUTPUT = "An internal error occurred"
MOVED_OUTPUT = "The tool was interrupted because the session moved to another server before its speech played."
#: why a call the model cancelled (with a companion tool) was cancelled: its end asks for no reply of its own (the
#: companion's result is what the model answers)
CANCELLED_BY_THE_MODEL = "cancelled at the user's request"
#: why a call past its tool's ``timeout_s`` was stopped (``ctx.cancel_reason``)
TIMED_OUT = "timed out"


class CallOwner(Protocol):
    """What runs a call (the ``ToolExecutor``): the session it belongs to and where its progress goes."""

    session_id: str
    userdata: dict[str, Any]
    session: SessionControl | None

    async def report_progress(
        self,
        rc: RunningCall,
        message: str,
        progress: float | None,
        receipt: Receipt[ToolCallInfo] | None = None,
        *,
        silent: bool = False,
    ) -> None: ...


def _future(*, done: bool = False) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    if done:
        fut.set_result(None)
    return fut


class ToolCallNotFound(LookupError):
    pass


class NotCancellable(Exception):
    """The tool does not allow cancellation."""


class AlreadyEnded(Exception):
    """The tool call has already ended."""

    def __init__(self, info: ToolCallInfo) -> None:
        super().__init__(f"tool call {info.call_id} already ended {info.status}")
        self.info = info


@dataclass
class Outcome:
    status: ToolStatus
    output: str
    is_error: bool = False
    needs_reply: bool = True
    handoff: Agent | None = None  # the agent the tool asked to hand the session to
    # why the tool failed, for observers only (the model gets ``output``): the exception's message, redacted
    error: str | None = None

    def __post_init__(self) -> None:
        # every output goes to the chat, the events, the store and back to the model: none may be unbounded
        self.output = capped_output(self.output)


@dataclass(frozen=True)
class EndRecord:
    """What a call's end writes: its pair (and the handoff committed with it) and its final record."""

    items: list[ChatItem]
    info: ToolCallInfo
    state: SessionState | None

    # speeches owed because of this end (a reply to a result that lands outside of any reply): durable with it
    owed: tuple[SpeechInfo, ...] = ()
    # the call's speculative reply was dropped, and why: it ends with its record alone
    dropped: DropReason | None = None

    def commit(self, receipts: list[Completion] | None = None) -> Commit:
        return Commit(
            items=self.items,
            tool_calls=[self.info],
            speeches=list(self.owed),
            session=self.state,
            receipts=receipts or [],
        )


@dataclass(frozen=True)
class Handoff:
    """A handoff performed for a call that asked for it; committed together with the call's pair."""

    item: AgentHandoff
    state: SessionState


@dataclass(eq=False)
class RunningCall:
    """The live state of one tool call. ``settled_fut`` resolves when the call ended or moved to the background.

    It is what the tool's ``RunContext`` drives (``CallControl``).
    """

    executor: CallOwner
    _item: FunctionCall | None  # ``item``; None for an adopted call until it is asked for
    info: ToolCallInfo
    tool: FunctionTool | None
    speech: SpeechHandle | None
    step: int
    arguments_error: str | None = None
    args: dict[str, Any] = field(default_factory=dict)  # the validated arguments the tool runs with
    invalid: str | None = None  # why the arguments do not validate (the model gets it as the output)
    args_key: str | None = None  # the validated arguments, canonical: what "the same arguments" means
    refusal: str | None = None  # the call is not run: it ends `rejected` with this output (a cap was reached)
    resumed: bool = False  # resumes a call an earlier run left running (``on_restart="resume"``)
    needs_reply: bool = True
    updates: int = 0  # progress updates committed (each one a pair the model sees)
    cancel_reason: str | None = None
    timed_out: bool = False  # stopped past its tool's ``timeout_s``: it ends `failed`, whatever its body does
    task: asyncio.Task[None] | None = None
    tool_task: asyncio.Task[Any] | None = None
    held: Outcome | None = None  # the outcome of a call waiting for its handoff to be performed
    ending: bool = False  # its end is being committed (exactly once, I5)
    # why its end, decided here, is not durable: the store's error on the write that carried it (and the commands that
    # decided it), once every attempt failed; None while it runs and once its end is durable
    end_error: Exception | None = None
    # the idempotency receipts of the commands that decide its end (a cancel, a reported result): its end commits them
    end_receipts: list[Receipt[ToolCallInfo]] = field(default_factory=list)
    # the receipts of the cancel commands that cancel it: answered by its end, or by its `cancelling` record
    cancel_receipts: list[Receipt[ToolCallInfo]] = field(default_factory=list)
    drained: bool = False  # cancelled by a drain (a handoff, a close), which lets a body that ignores it go
    # an ended call from before a restart (``RunningCall.adopted_call``): it never runs here, it is settled and ended
    adopted: bool = False

    # The futures and the lock below are made when first used: recovery adopts every ended call of every session,
    # and an ended call needs none of them (most are never asked for).

    @functools.cached_property
    def cancel_fut(self) -> asyncio.Future[None]:
        return _future()

    @functools.cached_property
    def settled_fut(self) -> asyncio.Future[None]:
        """Resolves when the call ended or moved to the background."""
        return _future(done=self.adopted)

    @functools.cached_property
    def ended_fut(self) -> asyncio.Future[None]:
        return _future(done=self.adopted)

    @functools.cached_property
    def abandoned_fut(self) -> asyncio.Future[None]:
        """Resolved when the body ignored cancellation past its grace: the call ends without waiting for it."""
        return _future()

    @functools.cached_property
    def deaf_fut(self) -> asyncio.Future[None]:
        """Resolved when the body ignored an operator's or the model's cancellation past its grace: the call is then
        `cancelling`, still running, until its body returns (``cancelling_fut``: once that is recorded)."""
        return _future()

    @functools.cached_property
    def cancelling_fut(self) -> asyncio.Future[None]:
        return _future()

    @functools.cached_property
    def verdict_fut(self) -> asyncio.Future[DropReason | None]:
        """A call of a speculative reply (``info.speculative``): resolved with None once its reply is confirmed, or
        with why it was dropped; its end waits for it."""
        return _future()

    @functools.cached_property
    def write_lock(self) -> asyncio.Lock:
        """The call's progress and its end are written one at a time, in order (an update never lands after the
        end)."""
        return asyncio.Lock()

    @classmethod
    def adopted_call(cls, executor: CallOwner, info: ToolCallInfo) -> RunningCall:
        """An ended call from before a restart (``info``, as stored), to be listed and never run again."""
        return cls(executor, None, info, None, None, 0, adopted=True)

    @property
    def item(self) -> FunctionCall:
        """The call as the model made it. An adopted call's is built from its stored record when first asked for,
        without validation and without a random id: it is never committed (its pair is in the chat already)."""
        if self._item is None:
            info = self.info
            self._item = trusted(
                FunctionCall,
                {
                    "id": f"adopted:{info.call_id}",
                    "created_at": info.started_at,
                    "type": "function_call",
                    "call_id": info.call_id,
                    "name": info.name,
                    "arguments": info.arguments,
                },
            )
        return self._item

    @item.setter
    def item(self, value: FunctionCall) -> None:
        self._item = value

    @property
    def ended(self) -> bool:
        return self.info.ended

    @property
    def foreground(self) -> bool:
        """Still blocking the reply that started it (running, not moved to the background, and of a reply that was
        confirmed: a speculative call belongs to no reply yet)."""
        return not self.ended and not self.info.background and not self.info.speculative

    @property
    def dropped(self) -> DropReason | None:
        """Why the speculative reply that started this call was dropped, once it was."""
        fut = self.verdict_fut
        return fut.result() if fut.done() and not fut.cancelled() else None

    @property
    def handoff_to(self) -> Agent | None:
        """The agent this call asked to hand the session to, while its handoff waits to be performed."""
        return self.held.handoff if self.held is not None and not self.ended else None

    # -- CallControl: what the tool's RunContext drives -----------------------------------------------------

    @property
    def call_id(self) -> str:
        return self.info.call_id

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def session_id(self) -> str:
        return self.executor.session_id

    @property
    def userdata(self) -> dict[str, Any]:
        return self.executor.userdata

    @property
    def session(self) -> SessionControl | None:
        return self.executor.session

    @property
    def started_at(self) -> datetime:
        return self.info.started_at

    async def report_progress(
        self,
        message: str,
        progress: float | None,
        receipt: Receipt[ToolCallInfo] | None = None,
        *,
        silent: bool = False,
    ) -> None:
        await self.executor.report_progress(self, message, progress, receipt, silent=silent)

    def receipt_on_end(self, receipt: Receipt[ToolCallInfo]) -> None:
        self.end_receipts.append(receipt)

    async def wait_for_playout(self) -> None:
        if self.speech is not None:
            await self.speech.wait_for_step(self.step)


def protected_by_speech(rc: RunningCall) -> bool:
    """The speech that made the call is still going on and does not allow interruptions (one cancelled with
    ``force`` protects nothing any more)."""
    speech = rc.speech
    return speech is not None and not (speech.allow_interruptions or speech.interrupted or speech.done)


def cancel_refusal(rc: RunningCall) -> str | None:
    """Why ``rc`` cannot be cancelled now (without force), or None when it can."""
    if not rc.info.cancellable:
        return "that call cannot be cancelled"
    if protected_by_speech(rc):
        return "the speech it belongs to does not allow interruptions"
    return None


def dropped_reason(info: ToolCallInfo) -> DropReason | None:
    """Why the speculative reply of an ended call was dropped (kept as its ``error``), or None for any other call."""
    if not (info.speculative and info.ended):
        return None
    return next((r for r in typing.get_args(DropReason) if r == info.error), "session_stopped")


def dropped_outcome(reason: DropReason) -> Outcome:
    """How a call ends when the speculative reply that started it is dropped: nothing of it reaches the chat."""
    return Outcome(
        ToolStatus.CANCELLED,
        f"The call was dropped with the speculative reply that made it ({reason}).",
        is_error=True,
        needs_reply=False,
    )


def end_record(rc: RunningCall, outcome: Outcome, handoff: Handoff | None) -> EndRecord:
    """The pair (a ``<call_id>/final`` pair for a call in the background) and the final record of ``rc``; a call
    whose speculative reply was never confirmed ends with its record alone (it never was in the conversation)."""
    now = utcnow()
    if rc.info.speculative:  # whatever its body did: a teardown before any verdict stops it with the session
        reason = rc.dropped or "session_stopped"
        dropped = dropped_outcome(reason)
        info = rc.info.model_copy(
            update={
                "status": dropped.status,
                "output": dropped.output,
                "is_error": True,
                "error": reason,
                "ended_at": now,
            }
        )
        return EndRecord([], info, None, dropped=reason)
    name = rc.info.name
    if rc.info.background:
        final_id = f"{rc.info.call_id}{FINAL_SUFFIX}"
        call_item = FunctionCall(
            id=new_id("item"), call_id=final_id, name=name, arguments=rc.item.arguments, created_at=now
        )
    else:
        final_id, call_item = rc.info.call_id, rc.item
    output = FunctionCallOutput(
        id=new_id("item"),
        call_id=final_id,
        name=name,
        output=outcome.output,
        is_error=outcome.is_error,
        created_at=now,
    )
    extra: list[ChatItem] = [handoff.item] if handoff is not None else []
    info = rc.info.model_copy(
        update={
            "status": outcome.status,
            "output": outcome.output,
            "is_error": outcome.is_error,
            "error": outcome.error,
            "ended_at": now,
        }
    )
    return EndRecord([call_item, output, *extra], info, handoff.state if handoff is not None else None)


def progress_pair(rc: RunningCall, update: ProgressUpdate) -> list[ChatItem]:
    """The pair one progress update commits: for the first, the call itself with a "running in the background"
    output; for the n-th after it, a ``<call_id>/update/<n>`` pair that reports it (see ``UPDATE_PAIRS_SHOWN``)."""
    done = f", {round(update.progress * 100)}% done" if update.progress is not None else ""
    if not rc.info.background:
        output = FunctionCallOutput(
            id=new_id("item"),
            call_id=rc.info.call_id,
            name=rc.info.name,
            output=f"Started and running in the background ({update.message}{done}). The result will be shared when "
            "it is ready; do not call this tool again for it.",
            created_at=update.at,
        )
        return [rc.item, output]
    call_id = f"{rc.info.call_id}/update/{rc.updates + 1}"
    call = FunctionCall(
        id=new_id("item"), call_id=call_id, name=rc.info.name, arguments=rc.item.arguments, created_at=update.at
    )
    output = FunctionCallOutput(
        id=new_id("item"),
        call_id=call_id,
        name=rc.info.name,
        output=f"Progress of the call running in the background: {update.message}{done}. Still running.",
        created_at=update.at,
    )
    return [call, output]


#: The most of an exception's message an observer is shown.
MAX_ERROR_CHARS = 2_000


def error_text(exc: BaseException) -> str:
    """What observers are told of why a tool failed: the exception's type and message, with credentials removed as
    in logs, bounded."""
    message = str(exc)
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return capped_output(redact(valid_text(text)), MAX_ERROR_CHARS)


def without_handoff(
    held: Outcome, reason: str, status: ToolStatus = ToolStatus.FAILED, *, needs_reply: bool = True
) -> Outcome:
    """A call whose handoff was not done: its result is kept (the tool did its work), with a note; without a
    result it ends ``status``."""
    assert held.handoff is not None
    note = f"The handoff to {held.handoff.name} was not done: {reason}."
    if held.output:
        return Outcome(ToolStatus.COMPLETED, f"{held.output}\n\n({note})", needs_reply=needs_reply)
    return Outcome(status, note, is_error=True, needs_reply=needs_reply)


def cancelled_outcome(rc: RunningCall, output: str = "", *, is_error: bool = True) -> Outcome:
    """How a cancelled call ends (with ``output``, or a note saying who cancelled it). A call the model cancelled
    asks for no reply: the model already answers its cancel tool's result (no second inference for one cancel)."""
    return Outcome(
        ToolStatus.CANCELLED,
        output or f"The tool call was cancelled ({rc.cancel_reason or 'cancelled'}).",
        is_error=is_error,
        needs_reply=rc.cancel_reason != CANCELLED_BY_THE_MODEL,
    )


def timed_out_outcome(rc: RunningCall) -> Outcome:
    """How a call stopped past its tool's ``timeout_s`` ends, whatever its body did after: ``failed``, answered."""
    limit = rc.tool.call_timeout_s if rc.tool is not None else None
    after = f" after {limit:g} s" if limit is not None else ""
    return Outcome(
        ToolStatus.FAILED,
        f"{rc.info.name} failed: it timed out{after} and was stopped.",
        is_error=True,
        error=f"timed out{after}",
    )


def stopped_outcome(rc: RunningCall) -> Outcome:
    """How a call ends when a teardown stops it."""
    if rc.held is not None and rc.held.handoff is not None:
        return without_handoff(rc.held, "the tool was stopped first", ToolStatus.INTERRUPTED, needs_reply=False)
    if rc.timed_out:
        return timed_out_outcome(rc)
    if rc.cancel_reason is not None:
        return cancelled_outcome(rc)
    return Outcome(ToolStatus.INTERRUPTED, "The tool was stopped.", True, False)


def outcome_of(rc: RunningCall, session_id: str) -> Outcome:
    """How a call whose body has returned, raised, or was abandoned ends."""
    assert rc.tool_task is not None
    name = rc.info.name
    if not rc.tool_task.done():  # abandoned: it ignored cancellation
        return stopped_outcome(rc)
    if rc.timed_out:  # what the body did once stopped does not matter: the call failed
        if not rc.tool_task.cancelled():
            _body_ended_after_timeout(rc, session_id)
        return timed_out_outcome(rc)
    if rc.tool_task.cancelled():
        if rc.cancel_reason is not None:
            return cancelled_outcome(rc)
        return Outcome(ToolStatus.INTERRUPTED, "The tool was stopped.", is_error=True, needs_reply=False)
    exc = rc.tool_task.exception()
    if exc is None:
        result = rc.tool_task.result()
        if rc.cancel_reason is not None:
            try:
                partial = render_output(result) if not _holds_agent(result) else ""
            except UnusableResult:
                partial = ""
            return cancelled_outcome(rc, partial, is_error=not partial)
        return _completed(rc, result, session_id)
    if isinstance(exc, ToolCancelled):
        return cancelled_outcome(rc)
    if isinstance(exc, StopResponse):
        return Outcome(ToolStatus.COMPLETED, "", needs_reply=False)
    if isinstance(exc, SpeechInterrupted) and rc.speech is not None and rc.speech.moved:
        return Outcome(ToolStatus.INTERRUPTED, MOVED_OUTPUT, is_error=True, needs_reply=False)
    if isinstance(exc, SpeechInterrupted):
        return Outcome(
            ToolStatus.INTERRUPTED,
            "The tool was interrupted because the user interrupted the agent.",
            is_error=True,
            needs_reply=False,
        )
    if isinstance(exc, ToolError):
        logger.warning(
            "tool %s failed: %s",
            name,
            exc,
            extra={"session_id": session_id, "call_id": rc.info.call_id},
        )
        return Outcome(ToolStatus.FAILED, str(exc) or "The tool failed.", is_error=True, error=error_text(exc))
    logger.error(
        "tool %s raised an unexpected exception",
        name,
        exc_info=exc,
        extra={"session_id": session_id, "call_id": rc.info.call_id},
    )
    # the model gets the generic text; observers (tool.ended, the call's record) see why, redacted as logs are
    return Outcome(ToolStatus.FAILED, INTERNAL_ERROR_OUTPUT, is_error=True, error=error_text(exc))


def _body_ended_after_timeout(rc: RunningCall, session_id: str) -> None:
    assert rc.tool_task is not None
    error = rc.tool_task.exception()
    if error is not None and not isinstance(error, (ToolCancelled, StopResponse, SpeechInterrupted)):
        logger.warning(
            "tool %s raised after it timed out: %r",
            rc.info.name,
            error,
            extra={"session_id": session_id, "call_id": rc.info.call_id},
        )


def _completed(rc: RunningCall, result: Any, session_id: str) -> Outcome:
    handoff: Agent | None = None
    if isinstance(result, Agent):
        handoff, result = result, None
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Agent):
        handoff, result = result
    try:
        if _holds_agent(result):
            raise UnusableResult("a tool hands off to one agent at most; it returned several")
        output = render_output(result)
    except UnusableResult as err:
        return _unusable(rc, err, session_id)
    if handoff is None:
        # a tool that returns nothing asks the model for nothing: no tool reply is generated for it alone
        return Outcome(ToolStatus.COMPLETED, output, needs_reply=result is not None)
    # a bare handoff answers with an empty output and asks for no tool reply: the new agent speaks (on_enter)
    held = Outcome(ToolStatus.COMPLETED, output, needs_reply=result is not None, handoff=handoff)
    if rc.speech is not None and rc.speech.interrupted and not rc.speech.moved:
        return without_handoff(held, "the agent was interrupted", ToolStatus.INTERRUPTED, needs_reply=False)
    return held


def _unusable(rc: RunningCall, err: UnusableResult, session_id: str) -> Outcome:
    logger.error(
        "tool %s returned a result that cannot be given to the model: %s",
        rc.info.name,
        err,
        extra={"session_id": session_id, "call_id": rc.info.call_id},
    )
    return Outcome(
        ToolStatus.FAILED,
        f"The tool returned a result that cannot be used: {err}.",
        is_error=True,
        error=error_text(err),
    )


def _holds_agent(value: Any) -> bool:
    """An agent inside a result (several agents, or one nested in a list or dict): no handoff can be made of it."""
    if isinstance(value, Agent):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_agent(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_agent(v) for v in value.values())
    return False
