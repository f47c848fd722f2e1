"""One tool call: its live state (``RunningCall``), how it ends (``Outcome``) and what its end writes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from .agent import Agent
from .chat import AgentHandoff, ChatItem, FunctionCall, FunctionCallOutput, new_id, utcnow
from .ports import Commit, SessionState
from .speech import SpeechHandle
from .tools import FunctionTool, ToolCallInfo, ToolStatus, capped_output


class CallOwner(Protocol):
    """What runs a call (the ``ToolExecutor``): the session it belongs to and where its progress goes."""

    session_id: str
    userdata: dict[str, Any]

    async def report_progress(self, rc: RunningCall, message: str, progress: float | None) -> None: ...


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

    def __post_init__(self) -> None:
        # every output goes to the chat, the events, the store and back to the model: none may be unbounded
        self.output = capped_output(self.output)


@dataclass(frozen=True)
class EndRecord:
    """What a call's end writes: its pair (and the handoff committed with it) and its final record."""

    items: list[ChatItem]
    info: ToolCallInfo
    state: SessionState | None

    def commit(self) -> Commit:
        return Commit(items=self.items, tool_calls=[self.info], session=self.state)


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
    item: FunctionCall
    info: ToolCallInfo
    tool: FunctionTool | None
    speech: SpeechHandle | None
    step: int
    arguments_error: str | None = None
    needs_reply: bool = True
    cancel_reason: str | None = None
    task: asyncio.Task[None] | None = None
    tool_task: asyncio.Task[Any] | None = None
    held: Outcome | None = None  # the outcome of a call waiting for its handoff to be performed
    ending: bool = False  # its end is being committed (exactly once, I5)
    cancel_fut: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    settled_fut: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    ended_fut: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # resolved when the body ignored cancellation past its grace: the call ends without waiting for it
    abandoned_fut: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # the call's progress and its end are written one at a time, in order (an update never lands after the end)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def ended(self) -> bool:
        return self.info.ended

    @property
    def foreground(self) -> bool:
        """Still blocking the reply that started it (running and not moved to the background)."""
        return not self.ended and not self.info.background

    @property
    def handoff_to(self) -> Agent | None:
        """The agent this call asked to hand the session to, while its handoff waits to be performed."""
        return self.held.handoff if self.held is not None and not self.ended else None

    # -- CallControl: what the tool's RunContext drives -----------------------------------------------------

    @property
    def call_id(self) -> str:
        return self.info.call_id

    @property
    def session_id(self) -> str:
        return self.executor.session_id

    @property
    def userdata(self) -> dict[str, Any]:
        return self.executor.userdata

    async def report_progress(self, message: str, progress: float | None) -> None:
        await self.executor.report_progress(self, message, progress)

    async def wait_for_playout(self) -> None:
        if self.speech is not None:
            await self.speech.wait_for_step(self.step)


def end_record(rc: RunningCall, outcome: Outcome, handoff: Handoff | None) -> EndRecord:
    """The pair (a ``<call_id>/final`` pair for a call in the background) and the final record of ``rc``."""
    now = utcnow()
    name = rc.info.name
    if rc.info.background:
        final_id = f"{rc.info.call_id}/final"
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
        update={"status": outcome.status, "output": outcome.output, "is_error": outcome.is_error, "ended_at": now}
    )
    return EndRecord([call_item, output, *extra], info, handoff.state if handoff is not None else None)


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
