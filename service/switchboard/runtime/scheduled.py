"""Scheduled commands: an operator's input, say or interrupt that applies at a point of the conversation rather than
now: when the session is next idle, after the speech playing now, or after a named tool call ends.

A scheduled command is durable from the moment it is accepted (``PendingCommand`` in the store) and applied exactly
once: the commit of its effect carries its ``applied`` record (``AppliedReceipt``), so a drain, a failover or a crash
leaves it either applied (with its effect) or pending (without one), and the next owner applies the pending ones
(``runtime.recovery``). Commands due at the same point apply in the order they were accepted. A close cancels every
pending one (``scheduled.cancelled``, reason ``session_closed``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol

from . import event_types as ev
from .aio import cancel_and_wait
from .chat import new_id, utcnow
from .commit import CommitPipeline
from .events import EventLog
from .pending import (
    CANCELLED_BY_OPERATOR,
    CANCELLED_FAILED,
    CANCELLED_SESSION_CLOSED,
    AppliedReceipt,
    PendingCommand,
    PendingKind,
    PendingPoint,
)
from .ports import Commit, Receipt, completions
from .speech import NotInterruptible, SpeechHandle
from .speeches import Speeches
from .status import AgentState, SessionClosed, SessionStatus, SessionSuspended
from .tools import ToolCallInfo

logger = logging.getLogger("switchboard.runtime.scheduled")

#: Scheduled commands one session may hold pending at once (a further one is refused: ``TooManyPending``).
MAX_SCHEDULED = 32
#: How long a close or a hand-over waits for a command being applied to finish.
STOP_TIMEOUT_S = 5.0
#: Ended commands remembered in memory for their status (the store keeps every one).
KEEP_ENDED = 64


class TooManyPending(Exception):
    """The session holds as many pending commands of this sort as it may."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the session already holds {limit} pending commands, the most it may")
        self.limit = limit


class UnknownToolCall(LookupError):
    """``after_tool`` names a call this session does not know."""


class UnknownPending(LookupError):
    """No pending command (or note) of that id on this session."""


class PendingEnded(Exception):
    """The command was already applied or cancelled (``command`` says which)."""

    def __init__(self, command: PendingCommand) -> None:
        super().__init__(f"{command.id} is already {command.state}")
        self.command = command


class PendingHost(Protocol):
    """What the pending commands need of their session (``AgentSession``)."""

    id: str
    state: SessionStatus
    agent_state: AgentState
    events: EventLog
    writes: CommitPipeline
    speeches: Speeches

    @property
    def idle(self) -> bool: ...

    @property
    def current_speech(self) -> SpeechHandle | None: ...

    def _check_open(self, *, owed: bool = False) -> None: ...

    async def commit(self, commit: Commit, *, then: Callable[[], None] | None = None) -> None: ...

    def tool_call(self, call_id: str) -> ToolCallInfo | None: ...

    def speech(self, speech_id: str) -> SpeechHandle | None: ...

    async def input(self, text: str, *, interrupt: bool, force: bool, reply: bool, role: Any, receipt: Any) -> Any: ...

    async def say(self, text: str, *, allow_interruptions: bool, add_to_chat: bool, receipt: Any) -> SpeechHandle: ...

    async def interrupt(self, *, force: bool, receipt: Any) -> SpeechHandle | None: ...


def _input_result(result: Any) -> dict[str, Any]:
    return {"item_id": result.item_id, "speech_id": result.speech_id}


def _speech_result(speech: SpeechHandle | None) -> dict[str, Any]:
    return {"speech_id": speech.id if speech else None}


def _interrupt_result(speech: SpeechHandle | None) -> dict[str, Any]:
    return {"speech_id": speech.id if speech else None, "interrupted": speech is not None}


class PendingBook:
    """The pending commands of one sort (scheduled commands, coaching notes) of a session, in arrival order, with the
    ones ended lately; every change durable before it is applied here and reported (I6, I8)."""

    def __init__(self, session: PendingHost, *, limit: int) -> None:
        self._session = session
        self.limit = limit
        self.pending: list[PendingCommand] = []
        # made at the first end: an empty bounded deque is most of what an idle session's two books would hold
        self._ended: deque[PendingCommand] | None = None

    @property
    def ended(self) -> Sequence[PendingCommand]:
        """The ones ended lately, oldest first (at most ``KEEP_ENDED``)."""
        return self._ended if self._ended is not None else ()

    def get(self, command_id: str) -> PendingCommand | None:
        return next((c for c in [*self.pending, *self.ended] if c.id == command_id), None)

    def listed(self) -> list[PendingCommand]:
        """The pending ones (in arrival order), then those ended lately (oldest first)."""
        return [*self.pending, *self.ended]

    def restore(self, commands: Iterable[PendingCommand]) -> None:
        """Take over the commands that were pending in the store (recovery), oldest first."""
        self.pending = sorted((c for c in commands if c.pending), key=lambda c: (c.created_at, c.id))

    async def add(
        self, command: PendingCommand, receipt: Receipt[PendingCommand] | None, report: Callable[[], None]
    ) -> PendingCommand:
        """Store ``command`` (its receipt's answer in the same commit), then hold it and ``report`` it."""
        self._session._check_open(owed=True)
        if len(self.pending) >= self.limit:
            raise TooManyPending(self.limit)

        def apply() -> None:
            self.pending.append(command)
            report()

        await self._session.commit(Commit(pending=[command], receipts=completions(command, receipt)), then=apply)
        return command

    def take(self, command_id: str) -> PendingCommand:
        """Remove a pending command, to end it (raises ``UnknownPending``, ``PendingEnded``)."""
        found = self.get(command_id)
        if found is None:
            raise UnknownPending(command_id)
        if not found.pending:
            raise PendingEnded(found)
        self.pending.remove(found)
        return found

    async def end(self, commands: list[PendingCommand], *, state: str, reason: str | None = None) -> None:
        """Write the end of ``commands`` (taken already), then remember them and report it."""
        if not commands:
            return
        now = utcnow()
        ended = [c.model_copy(update={"state": state, "ended_at": now, "reason": reason}) for c in commands]
        await self._session.commit(Commit(pending=ended), then=lambda: self.report_ended(ended))

    def report_ended(self, ended: list[PendingCommand]) -> None:
        kept = self._ended
        if kept is None:
            kept = self._ended = deque(maxlen=KEEP_ENDED)
        for command in ended:
            kept.append(command)
            self._session.events.emit(ended_event(command))

    async def cancel(self, command_id: str, reason: str = CANCELLED_BY_OPERATOR) -> PendingCommand:
        """Cancel a pending command; returns its cancelled record once durable."""
        self._session._check_open()
        command = self.take(command_id)
        try:
            await self.end([command], state="cancelled", reason=reason)
        except BaseException:
            self.pending.append(command)  # not cancelled after all: it stays pending, in its place
            self.pending.sort(key=lambda c: (c.created_at, c.id))
            raise
        return self.get(command_id) or command

    def closing(self) -> list[PendingCommand]:
        """The session closes: every pending command is cancelled in its last write (``session_closed``)."""
        now = utcnow()
        taken, self.pending = self.pending, []
        return [
            c.model_copy(update={"state": "cancelled", "ended_at": now, "reason": CANCELLED_SESSION_CLOSED})
            for c in taken
        ]


def accepted_event(command: PendingCommand) -> ev.ScheduledCreated | ev.SessionCoached:
    """The event that reports ``command`` accepted."""
    if command.kind == "coach":
        return ev.SessionCoached(id=command.id, note=str(command.args.get("note", "")))
    return ev.ScheduledCreated(
        id=command.id,
        kind=command.kind,
        at=command.at,
        **({"call_id": command.call_id} if command.call_id else {}),
        **({"speech_id": command.speech_id} if command.speech_id else {}),
    )


def ended_event(command: PendingCommand) -> ev.ScheduledApplied | ev.ScheduledCancelled:
    if command.state == "applied":
        data = {k: v for k, v in command.result.items() if k in ("item_id", "speech_id", "interrupted")}
        return ev.ScheduledApplied(id=command.id, kind=command.kind, **data)
    return ev.ScheduledCancelled(id=command.id, kind=command.kind, reason=command.reason or CANCELLED_FAILED)


class ScheduledCommands(PendingBook):
    """A session's scheduled commands, and the task that applies each when its point comes. Woken by the session
    when a speech ends, a tool call ends or the agent goes back to listening (``wake``)."""

    def __init__(self, session: PendingHost, *, limit: int | None = None) -> None:
        super().__init__(session, limit=MAX_SCHEDULED if limit is None else limit)
        self._wake_ev = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = False  # the session started: its commands may apply
        self._stopped = False

    async def schedule(
        self,
        kind: PendingKind,
        args: dict[str, Any],
        *,
        at: PendingPoint,
        call_id: str | None = None,
        receipt: Receipt[PendingCommand] | None = None,
        ended_call: bool = False,
    ) -> PendingCommand:
        """Accept ``kind`` (``input``, ``say``, ``interrupt`` with its ``args``) to apply at ``at``. Returns once it
        is durable. Raises ``UnknownToolCall`` (``after_tool`` naming a call unknown here), ``TooManyPending``. A
        call that has already ended, or no speech playing for ``after_speech``: it applies at once. ``ended_call``: the
        caller found the call ended in the store (one this process no longer remembers): it applies at once too."""
        session = self._session
        if at == "after_tool" and (call_id is None or (session.tool_call(call_id) is None and not ended_call)):
            raise UnknownToolCall(call_id or "")
        command = PendingCommand(
            id=new_id("sched"),
            kind=kind,
            at=at,
            args=args,
            call_id=call_id if at == "after_tool" else None,
            speech_id=self._speech_now() if at == "after_speech" else None,
            created_at=utcnow(),
        )

        def report() -> None:
            session.events.emit(accepted_event(command))
            self.wake()

        return await self.add(command, receipt, report)

    def _speech_now(self) -> str | None:
        """The speech an ``after_speech`` command waits for: the one playing, else the first queued."""
        current = self._session.current_speech
        if current is not None and not current.done:
            return current.id
        queued = self._session.speeches.scheduler.queued
        return queued[0].speech.id if queued else None

    # -- applying ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start applying (the session started, or was recovered with commands pending)."""
        self._started = True
        self.wake()

    def wake(self) -> None:
        """Something the commands may wait for happened: look again. A session with nothing pending runs no task
        for them (an idle session costs nothing more, and its commands' absence changes nothing of its timing)."""
        if not self._started or self._stopped or not self.pending:
            return
        self._wake_ev.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"scheduled:{self._session.id}")

    async def stop(self) -> None:
        """Stop applying (a close, a hand-over): a command being applied is let finish (its effect and its mark land
        together or not at all); the others stay pending (a close then cancels them, a hand-over leaves them to the
        next owner)."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            self._wake_ev.set()
            # bounded (a close is): a command whose effect is still being written lands or not on its own (its
            # task runs on), and its record is in the store either way (applied with it, or still pending)
            await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
            await cancel_and_wait(task)

    async def _run(self) -> None:
        try:
            while not self._stopped and self.pending:
                await self._wake_ev.wait()
                self._wake_ev.clear()
                await self._apply_due()
        finally:
            if self._task is asyncio.current_task():
                self._task = None  # nothing pending: the next command starts it again

    async def _apply_due(self) -> None:
        # every command due now applies, in arrival order (one may make the next no longer "due": it still is)
        for command in [c for c in self.pending if self._due(c)]:
            if self._stopped or self._session.state != SessionStatus.ACTIVE:
                return
            try:
                await self._apply(command)
            except Exception:  # its mark could not be written: logged; the others still apply
                logger.exception("session %s: scheduled %s was not settled", self._session.id, command.id)

    def _due(self, command: PendingCommand) -> bool:
        session = self._session
        if command.at == "after_tool":
            info = session.tool_call(command.call_id or "")
            return info is None or info.ended
        if command.at == "after_speech":
            speech = session.speech(command.speech_id) if command.speech_id else None
            return speech is None or speech.done
        return session.idle and session.agent_state == "listening"

    async def _apply(self, command: PendingCommand) -> None:
        if command not in self.pending:  # cancelled meanwhile
            return
        self.pending.remove(command)
        run, render = self._runner(command)
        receipt = AppliedReceipt(command, render, utcnow)
        try:
            result = await run(receipt)
        except (SessionClosed, SessionSuspended):
            self.pending.insert(0, command)  # the close cancels it, or the next owner applies it
            self._stopped = True
            return
        except NotInterruptible:
            await self._failed(command, "not_interruptible")
            return
        except Exception:
            logger.exception("session %s: scheduled %s (%s) failed", self._session.id, command.id, command.kind)
            await self._failed(command, CANCELLED_FAILED)
            return
        applied = receipt.applied or command.model_copy(
            update={"state": "applied", "ended_at": utcnow(), "result": render(result)}
        )
        if receipt.applied is None:  # no commit carried it (an interrupt with nothing playing): its own write
            await self._session.commit(Commit(pending=[applied]))
        self.report_ended([applied])

    async def _failed(self, command: PendingCommand, reason: str) -> None:
        try:
            await self.end([command], state="cancelled", reason=reason)
        except Exception:
            logger.exception("session %s: the end of scheduled %s was not stored", self._session.id, command.id)

    def _runner(
        self, command: PendingCommand
    ) -> tuple[Callable[[AppliedReceipt], Awaitable[Any]], Callable[[Any], dict[str, Any]]]:
        session, args = self._session, command.args
        if command.kind == "input":
            return (
                lambda receipt: session.input(
                    args["text"],
                    interrupt=args.get("interrupt", True),
                    force=args.get("force", False),
                    reply=args.get("reply", True),
                    role=args.get("role", "user"),
                    receipt=receipt,
                ),
                _input_result,
            )
        if command.kind == "say":
            return (
                lambda receipt: session.say(
                    args["text"],
                    allow_interruptions=args.get("allow_interruptions", True),
                    add_to_chat=args.get("add_to_chat", True),
                    receipt=receipt,
                ),
                _speech_result,
            )
        return lambda receipt: session.interrupt(force=args.get("force", False), receipt=receipt), _interrupt_result


__all__ = [
    "KEEP_ENDED",
    "MAX_SCHEDULED",
    "PendingBook",
    "PendingEnded",
    "PendingHost",
    "ScheduledCommands",
    "TooManyPending",
    "UnknownPending",
    "UnknownToolCall",
    "accepted_event",
    "ended_event",
]
