"""The audit trail: each operator command a live session applies is logged in its events as ``operator.action``.

Who (the API key's name, a session token's subject, ``anonymous`` without keys; never a credential), what, and
the ``Idempotency-Key``; the event's ``at`` says when. Routes call ``record`` inside their idempotent body, so a
replayed answer logs nothing a second time. A media edge's final transcript is input as a `POST /input` is, and is
logged the same way (``record_as``, action ``transcript``, its ``id`` as the key) once taken.
"""

from __future__ import annotations

from fastapi import Request

from ..runtime import event_types as ev
from ..runtime.session import AgentSession
from ..runtime.status import SessionStatus
from .auth import principal_of

IDEMPOTENCY_HEADER = "idempotency-key"


def actor_of(request: Request) -> str:
    """Who sent the request, as the audit trail names them."""
    return principal_of(request).name


def record(
    request: Request,
    session: AgentSession,
    action: ev.OperatorActionKind,
    *,
    item_id: str | None = None,
    speech_id: str | None = None,
    call_id: str | None = None,
    force: bool | None = None,
    displaced: str | None = None,
    scheduled_id: str | None = None,
) -> None:
    """Log ``action`` in ``session``'s events, by the request's caller under its ``Idempotency-Key``."""
    details = {
        "item_id": item_id,
        "speech_id": speech_id,
        "call_id": call_id,
        "force": force,
        "displaced": displaced,
        "scheduled_id": scheduled_id,
    }
    record_as(actor_of(request), session, action, request.headers.get(IDEMPOTENCY_HEADER), **details)


def record_as(
    actor: str, session: AgentSession, action: ev.OperatorActionKind, key: str | None = None, **details: object
) -> None:
    """Log ``action`` by ``actor`` under ``key``, with the ``details`` that are set. Nothing is logged once the
    session is closing: its ``session.closed`` must stay the last event (the check and the emit run without a
    suspension point between them)."""
    if session.state != SessionStatus.ACTIVE:
        return
    session.events.emit(
        ev.OperatorAction(
            action=action,
            actor=actor,
            **({"idempotency_key": key} if key else {}),
            **{name: value for name, value in details.items() if value is not None},
        )
    )
