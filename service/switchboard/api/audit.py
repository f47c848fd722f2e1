"""The audit trail: each operator command a live session applies is logged in its events as ``operator.action``.

Who (the API key's name, a session token's subject, ``anonymous`` without keys; never a credential), what, and
the ``Idempotency-Key``; the event's ``at`` says when. Routes call ``record`` inside their idempotent body, so a
replayed answer logs nothing a second time.
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
) -> None:
    """Log ``action`` in ``session``'s events. Nothing is logged once the session is closing: its ``session.closed``
    must stay the last event (the check and the emit run without a suspension point between them)."""
    if session.state != SessionStatus.ACTIVE:
        return
    details = {"item_id": item_id, "speech_id": speech_id, "call_id": call_id, "force": force}
    key = request.headers.get(IDEMPOTENCY_HEADER)
    session.events.emit(
        ev.OperatorAction(
            action=action,
            actor=actor_of(request),
            **({"idempotency_key": key} if key else {}),
            **{name: value for name, value in details.items() if value is not None},
        )
    )
