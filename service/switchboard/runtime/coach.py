"""Coaching: an operator's note to the agent for its next model request only.

The note is durable from the moment it is accepted (a drain or a failover before the next turn keeps it), is given to
the model as a system message at the end of the context of that one request, and is then gone: it is no chat item
(the user never sees it, later requests do not carry it). A speculative request carries it too, and takes it only
if its reply is used. Its use is written right after the request is made: a crash in between gives it to the next
request once more, never loses it.
"""

from __future__ import annotations

from . import event_types as ev
from .chat import ChatMessage, new_id, utcnow
from .llm.base import LLMRequest
from .pending import COACH_FRAME, COACH_PREFIX, PendingCommand, coach_note_text
from .ports import Commit, Receipt
from .scheduled import PendingBook, PendingHost

#: Notes one session may hold unused at once.
MAX_NOTES = 8


class CoachNotes(PendingBook):
    """A session's unused coaching notes, oldest first."""

    def __init__(self, session: PendingHost, *, limit: int = MAX_NOTES) -> None:
        super().__init__(session, limit=limit)

    async def coach(self, note: str, *, receipt: Receipt[PendingCommand] | None = None) -> PendingCommand:
        """Accept ``note`` for the next model request; returns once it is durable (``session.coached`` then)."""
        command = PendingCommand(
            id=new_id(COACH_PREFIX.rstrip("_")), kind="coach", at="next_turn", args={"note": note}, created_at=utcnow()
        )
        session = self._session

        def report() -> None:
            session.events.emit(ev.SessionCoached(id=command.id, note=note))

        return await self.add(command, receipt, report)

    def messages(self, *, take: bool, speech_id: str | None) -> list[ChatMessage]:
        """The messages of the unused notes, for a request; ``take``: this request uses them (they are gone)."""
        notes = list(self.pending)
        if take:
            self._use(notes, speech_id)
        return [ChatMessage(id=n.id, role="system", text=COACH_FRAME + str(n.args.get("note", ""))) for n in notes]

    def used_by(self, request: LLMRequest) -> None:
        """A speculative reply is used: the notes its request carried are used with it."""
        ids = {item.id for item in request.items if item.id.startswith(COACH_PREFIX)}
        self._use([n for n in self.pending if n.id in ids], request.speech_id)

    def _use(self, notes: list[PendingCommand], speech_id: str | None) -> None:
        if not notes:
            return
        for note in notes:
            self.pending.remove(note)
        now = utcnow()
        result = {"speech_id": speech_id} if speech_id else {}
        used = [n.model_copy(update={"state": "applied", "ended_at": now, "result": result}) for n in notes]
        session = self._session
        session.writes.background(
            session.commit(Commit(pending=used), then=lambda: self.report_ended(used)), name=f"coach:{session.id}"
        )


__all__ = ["COACH_FRAME", "COACH_PREFIX", "MAX_NOTES", "CoachNotes", "coach_note_text"]
