"""An operator's takeover: a human speaks as the agent, and the model is asked for nothing meanwhile.

``OperatorSeat`` is a session's seat for an operator. ``take`` interrupts the speech under way (what was heard is
committed, as an interrupt does) and every queued one, and holds the session: from then on no reply of the model
plays (a reply queued by anything, an input's, a deferred one's, an agent hook's, a recovered one's, ends unplayed,
interrupted) and input is committed to the chat without a reply. Running tools keep their policies. ``say`` speaks the
operator's words as the agent: a speech of source ``operator`` whose message is committed as an assistant message and
reported as ``operator.spoke``. ``hand_back`` ends the hold: a developer note in the chat tells the model that a human
spoke for it, and when the conversation's last word is not the agent's (the user's input, a tool's result) a reply
is queued, in the same commit (durable: whoever runs the session next owes it).

The hold is part of the session's persisted state (``SessionState.takeover``): a session held when its process
stops is held where it runs next, and recovery plays none of its owed replies until it is handed back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Protocol

from pydantic import BaseModel

from . import event_types as ev
from .chat import AgentHandoff, ChatContext, ChatItem, ChatMessage, FunctionCall, FunctionCallOutput, new_id, utcnow
from .events import EventLog
from .ports import Commit, Receipt, SessionState, Takeover, completions
from .reply import ReplyJob
from .speculative import Speculation
from .speech import SpeechHandle
from .speeches import Speeches

logger = logging.getLogger("switchboard.runtime.takeover")


class TakeoverConflict(Exception):
    """A takeover command that does not fit who holds the session now."""


class HeldByOther(TakeoverConflict):
    """Another operator holds the session (a takeover or a hand-back needs ``force``; a say is refused)."""

    def __init__(self, holder: Takeover) -> None:
        super().__init__(f"the session is held by {holder.operator!r} since {holder.since.isoformat()}")
        self.holder = holder


class NotHeld(TakeoverConflict):
    """No operator holds the session."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"no operator holds session {session_id!r}")


def handback_note(hold: Takeover, until: datetime) -> str:
    """The note the model reads after a hand-back: a human spoke for it, when, and that it carries on."""
    return (
        f"A human operator ({hold.operator}) took over this conversation from {hold.since:%Y-%m-%d %H:%M:%S} to "
        f"{until:%H:%M:%S} UTC and spoke for you: the assistant messages in between are theirs. You are back in "
        "charge now; carry on the conversation coherently from where they left it."
    )


def unanswered(items: list[ChatItem]) -> bool:
    """The conversation's last word is not the agent's: the user's input or a tool's result comes after the agent's
    last message (notes, handoffs and calls still running are no word)."""
    for item in reversed(items):
        if isinstance(item, ChatMessage):
            if item.role == "assistant":
                return False
            if item.role == "user":
                return True
        elif isinstance(item, FunctionCallOutput):
            return True
        elif not isinstance(item, AgentHandoff | FunctionCall):  # pragma: no cover - every item type is above
            return False
    return False


class SeatHost(Protocol):
    """What the seat needs from its session (``AgentSession`` implements it)."""

    @property
    def id(self) -> str: ...

    @property
    def events(self) -> EventLog: ...

    @property
    def chat(self) -> ChatContext: ...

    @property
    def speeches(self) -> Speeches: ...

    @property
    def speculation(self) -> Speculation: ...

    def snapshot(self) -> SessionState: ...

    async def commit(self, commit: Commit, *, then: Callable[[], None] | None = None) -> None: ...

    def add_to_chat(self, *items: ChatItem) -> None: ...


class OperatorSeat:
    """The operator's seat of one session (``session.seat``); its commands run through the session's command
    turn (``AgentSession.take_over``, ``operator_say``, ``hand_back``)."""

    def __init__(self, session: SeatHost, hold: Takeover | None = None) -> None:
        self._session = session
        self.hold = hold
        # the last sign of the operator (a takeover, a say, a heartbeat); a recovered hold counts from its recovery
        self.last_seen: datetime = utcnow()
        self._taking = 0  # takeovers between their interruption and their commit: no reply starts meanwhile
        self._skipped = False  # a reply was held back during such a window

    @property
    def held(self) -> bool:
        """No reply of the model may play now."""
        return self.hold is not None or self._taking > 0

    @property
    def operator(self) -> str | None:
        return self.hold.operator if self.hold is not None else None

    def quiet_for_s(self, now: datetime) -> float | None:
        """How long the holding operator has given no sign (None when the session is not held)."""
        if self.hold is None:
            return None
        return (now - self.last_seen).total_seconds()

    # -- the gate of the reply loop -------------------------------------------------------------------------

    def holds_back(self, job: ReplyJob) -> bool:
        """Whether ``job`` must not play: a reply of the model while the session is held. It is ended unplayed,
        interrupted; the hand-back answers whatever is left unanswered then."""
        if job.kind != "reply" or not self.held:
            return False
        self._skipped = True
        job.speech.interrupt(force=True)
        return True

    # -- commands (each in the session's command turn) ------------------------------------------------------

    async def take(self, operator: str, *, force: bool, receipt: Receipt[Takeover] | None) -> Takeover:
        """Hold the session for ``operator``. The holder taking it again is a heartbeat (nothing changes); another
        operator holds it: ``HeldByOther`` unless ``force`` (then they are displaced, and named)."""
        current = self.hold
        if current is not None and current.operator == operator:
            self.last_seen = utcnow()
            return current
        if current is not None and not force:
            raise HeldByOther(current)
        session = self._session
        self._taking += 1
        self._skipped = False
        taken = False
        try:
            await session.speculation.discard()
            interrupted = await session.speeches.interrupt_current(force=True)
            hold = Takeover(operator=operator, since=utcnow(), displaced=current.operator if current else None)

            def apply() -> None:
                self.hold, self.last_seen = hold, utcnow()
                session.events.emit(
                    ev.SessionTakenOver(
                        operator=operator,
                        since=hold.since,
                        **({"displaced": hold.displaced} if hold.displaced else {}),
                        **({"interrupted_speech_id": interrupted.id} if interrupted else {}),
                    )
                )

            state = session.snapshot().model_copy(update={"takeover": hold})
            await session.commit(Commit(session=state, receipts=completions(hold, receipt)), then=apply)
            taken = True
            return hold
        finally:
            self._taking -= 1
            if not taken:
                self._owe_skipped()

    async def say(self, operator: str, text: str, *, receipt: Receipt[SpeechHandle] | None) -> SpeechHandle:
        """Speak ``text`` as the agent, for the operator who holds the session (after what is queued)."""
        self._check_holder(operator, force=False)
        self.last_seen = utcnow()
        job = operator_job(self._session.speeches, text, operator)
        return await self._session.speeches.queue_durably(job, receipt)

    async def hand_back(self, by: str, *, force: bool) -> HandBack:
        """End the hold: the note in the chat, and a reply when the conversation's last word is not the agent's."""
        hold = self._check_holder(by, force=force)
        session = self._session
        until = utcnow()
        note = ChatMessage(id=new_id("item"), role="developer", text=handback_note(hold, until), created_at=until)
        job = session.speeches.new_job("reply") if unanswered(session.chat.items) else None
        result = HandBack(hold=hold, until=until, by=by, speech_id=job.speech.id if job else None)

        def apply() -> None:
            self.hold = None
            session.add_to_chat(note)
            session.events.emit(ev.ChatItemAdded(item=note))
            session.events.emit(
                ev.SessionHandedBack(
                    operator=hold.operator,
                    since=hold.since,
                    until=until,
                    **({"by": by} if by != hold.operator else {}),
                    **({"reply_speech_id": job.speech.id} if job else {}),
                )
            )
            if job is not None:
                session.speeches.enqueue(job)

        state = session.snapshot().model_copy(update={"takeover": None})
        await session.commit(
            Commit(items=[note], speeches=[job.speech.info()] if job else [], session=state), then=apply
        )
        return result

    # -- helpers --------------------------------------------------------------------------------------------

    def _check_holder(self, operator: str, *, force: bool) -> Takeover:
        if self.hold is None:
            raise NotHeld(self._session.id)
        if self.hold.operator != operator and not force:
            raise HeldByOther(self.hold)
        return self.hold

    def _owe_skipped(self) -> None:
        """A takeover failed after holding back a reply: that reply is owed again (a deferred one answers)."""
        if self._skipped and not self.held:
            self._skipped = False
            logger.warning("session %s: a takeover failed; replying to what it held back", self._session.id)
            self._session.speeches.schedule_deferred_reply()


class HandBack(BaseModel):
    """What a hand-back did: whose hold it ended, when, by whom, and the reply it queued (if any)."""

    hold: Takeover
    until: datetime
    by: str
    speech_id: str | None = None


def operator_job(speeches: Speeches, text: str, operator: str) -> ReplyJob:
    """A speech of the operator's: ``text`` said as is, committed as the agent's message, marked as theirs."""
    job = speeches.new_job("say", source="operator", text=text)
    job.speech.operator = operator
    return job


__all__ = [
    "HandBack",
    "HeldByOther",
    "NotHeld",
    "OperatorSeat",
    "SeatHost",
    "Takeover",
    "TakeoverConflict",
    "handback_note",
    "operator_job",
    "unanswered",
]
