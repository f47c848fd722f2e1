"""Pending commands: operator commands that apply at a point of the conversation rather than now (scheduled input,
say and interrupt), and coaching notes for the agent's next model request. Each is durable from the moment it is
accepted until it is applied or cancelled, so a drain or a failover never loses one (``runtime.recovery``).

A leaf module (pydantic only): the ports, the store and the session's managers (``scheduled``, ``coach``) refer to it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .chat import ChatMessage
from .receipt import Completion

PendingKind = Literal["input", "say", "interrupt", "coach"]
#: ``idle``: the session next has no speech playing or queued and is not thinking; ``after_speech``: the speech that
#: was playing (or, with none playing, the first queued) when the command was accepted has ended; ``after_tool``: the
#: named tool call has ended; ``next_turn``: the agent's next model request (a coaching note).
PendingPoint = Literal["idle", "after_speech", "after_tool", "next_turn"]
PendingState = Literal["pending", "applied", "cancelled"]

#: Why a pending command was cancelled (``PendingCommand.reason``).
CANCELLED_BY_OPERATOR = "cancelled_by_operator"
CANCELLED_SESSION_CLOSED = "session_closed"
CANCELLED_FAILED = "failed"

#: The ids of coaching notes' messages in a model request (what tells them from the conversation's own messages).
COACH_PREFIX = "coach_"
#: How a coaching note is framed for the model.
COACH_FRAME = "Note from a human operator for your next reply only (the user does not see it): "


def coach_note_text(message: ChatMessage) -> str | None:
    """The operator's note a request's message carries, or None when it is no coaching note."""
    if message.id.startswith(COACH_PREFIX) and message.text.startswith(COACH_FRAME):
        return message.text[len(COACH_FRAME) :]
    return None


class PendingCommand(BaseModel):
    """One command waiting for its point in the conversation (or a coaching note waiting for the next turn)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    kind: PendingKind
    at: PendingPoint
    args: dict[str, Any] = Field(default_factory=dict)  # the command's body (text, force, ...; a note: ``note``)
    call_id: str | None = None  # ``after_tool``: the call it waits for
    speech_id: str | None = None  # ``after_speech``: the speech it waits for (None: it was due when accepted)
    state: PendingState = "pending"
    created_at: datetime
    ended_at: datetime | None = None
    reason: str | None = None  # cancelled: why
    result: dict[str, Any] = Field(default_factory=dict)  # applied: what it did (item_id, speech_id, interrupted)

    @property
    def pending(self) -> bool:
        return self.state == "pending"


class AppliedReceipt:
    """Marks a pending command applied in the very commit of its effect (the commit that adds the input, queues the
    say, or commits the interrupted message), so that the effect and the mark are durable together or not at all: a
    command found pending after a restart has no effect in the store, and is applied there exactly once.

    Given to the command as its ``receipt`` (``runtime.receipt.Receipt``); ``render`` turns the command's result into
    its ``PendingCommand.result``."""

    def __init__(self, command: PendingCommand, render: Callable[[Any], dict[str, Any]], now: Callable[[], datetime]):
        self.command = command
        self._render = render
        self._now = now
        self.applied: PendingCommand | None = None  # taken: the record its effect's commit carries

    def complete(self, result: Any) -> Completion | None:
        if self.applied is not None:
            return None
        self.applied = self.command.model_copy(
            update={"state": "applied", "ended_at": self._now(), "result": self._render(result)}
        )
        return PendingMark(command=self.applied)


class PendingMark(Completion):
    """A pending command's new record riding in the ``receipts`` of the commit of its effect (``AppliedReceipt``). It
    completes no idempotency key: the store writes ``command`` to the pending commands instead."""

    key: str = ""
    scope: str = ""
    holder_node: str = ""
    holder_incarnation: str = ""
    status_code: int = 0
    command: PendingCommand


def split_marks(receipts: list[Completion]) -> tuple[list[PendingCommand], list[Completion]]:
    """The pending commands ``receipts`` carry (``PendingMark``), and the idempotency completions among them."""
    marks = [r.command for r in receipts if isinstance(r, PendingMark)]
    return marks, [r for r in receipts if not isinstance(r, PendingMark)]


__all__ = [
    "CANCELLED_BY_OPERATOR",
    "CANCELLED_FAILED",
    "CANCELLED_SESSION_CLOSED",
    "COACH_FRAME",
    "COACH_PREFIX",
    "AppliedReceipt",
    "PendingCommand",
    "PendingKind",
    "PendingMark",
    "PendingPoint",
    "PendingState",
    "coach_note_text",
    "split_marks",
]
