"""An operator's takeover over HTTP: take a session over, speak as the agent, hand it back (``runtime.takeover``).

The operator is the caller, as the audit trail names them (``audit.actor_of``): the API key's name, a session
token's subject, ``anonymous`` without keys. Every command needs ``sessions:control``, like input and interrupt.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from ...runtime.ports import Takeover
from ...runtime.speech import SpeechHandle
from ...runtime.takeover import HandBack
from .. import audit, deps
from ..auth import Require
from ..deps import HostDep, SettingsDep
from ..idempotency import Idem, idempotent
from ..problems import POST_ERRORS, problem_responses
from ..schemas import HandBackRead, SayAccepted, TakeoverCreate, TakeoverRead, TakeoverSayCreate
from .routes import _check_text

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

_CONFLICT = (
    409,
    "Another operator holds the session (`held_by_other`; `force` takes it), no operator holds it (`not_held`), or "
    "the session is not active",
)


def takeover_read(hold: Takeover) -> TakeoverRead:
    return TakeoverRead(operator=hold.operator, since=hold.since, displaced=hold.displaced)


@router.post(
    "/{sid}/takeover",
    operation_id="takeOver",
    response_model=TakeoverRead,
    responses=problem_responses(400, 404, 408, _CONFLICT, 413),
    dependencies=[Depends(Require("sessions:control"))],
)
@idempotent
async def take_over(
    sid: str, host: HostDep, settings: SettingsDep, request: Request, idem: Idem, body: TakeoverCreate | None = None
) -> TakeoverRead:
    """Take the session over: the speech under way is interrupted (what was heard is committed) and the model is
    asked for nothing until it is handed back; running tools go on under their own policies. Input is committed to
    the chat (and reported) without a reply. Sent again by the operator who holds it, it is a heartbeat. Another
    operator holds it: 409 `held_by_other`, unless `force` (they are displaced, and named in `session.taken_over`)."""
    body = body or TakeoverCreate()
    session = await deps.active_session(host, sid)
    operator = audit.actor_of(request)
    before = session.seat.hold
    async with deps.deadline(settings):
        hold = await session.take_over(operator, force=body.force, receipt=idem.receipt(takeover_read))
    if hold != before:  # a heartbeat changes nothing: not a line in the trail
        audit.record(request, session, "takeover", force=body.force or None, displaced=hold.displaced)
    return takeover_read(hold)


def _said(speech: SpeechHandle) -> SayAccepted:
    return SayAccepted(speech_id=speech.id)


@router.post(
    "/{sid}/takeover/say",
    operation_id="takeoverSay",
    status_code=202,
    response_model=SayAccepted,
    responses=problem_responses(*POST_ERRORS),
    dependencies=[Depends(Require("sessions:control"))],
)
@idempotent
async def takeover_say(
    sid: str, body: TakeoverSayCreate, host: HostDep, settings: SettingsDep, request: Request, idem: Idem
) -> SayAccepted:
    """Speak `text` as the agent, as the operator who holds the session (after what is queued): it plays like a
    `say`, is committed as an assistant message (what was heard) and is reported as `operator.spoke`. 409
    `not_held` when nobody holds the session, `held_by_other` when another operator does."""
    _check_text(settings, body.text)
    session = await deps.active_session(host, sid)
    async with deps.deadline(settings):
        speech = await session.operator_say(audit.actor_of(request), body.text, receipt=idem.receipt(_said))
    audit.record(request, session, "takeover_say", speech_id=speech.id)
    return _said(speech)


def _handed_back(result: HandBack) -> HandBackRead:
    return HandBackRead(
        operator=result.hold.operator,
        since=result.hold.since,
        until=result.until,
        by=result.by,
        speech_id=result.speech_id,
    )


@router.delete(
    "/{sid}/takeover",
    operation_id="handBack",
    response_model=HandBackRead,
    responses=problem_responses(400, 404, 408, _CONFLICT),
    dependencies=[Depends(Require("sessions:control"))],
)
async def hand_back(
    sid: str,
    host: HostDep,
    settings: SettingsDep,
    request: Request,
    force: Annotated[bool, Query(description="Hand back a session another operator holds.")] = False,
) -> HandBackRead:
    """Hand the session back to the agent: a note in its chat tells the model that a human operator spoke for it
    (their words are the assistant messages in between), and when the user's last input (or a tool's result) is
    unanswered, the agent replies to it (`speech_id`). 409 `not_held` when nobody holds it, `held_by_other` when
    another operator does (unless `force`)."""
    session = await deps.active_session(host, sid)
    async with deps.deadline(settings):
        result = await session.hand_back(audit.actor_of(request), force=force)
    audit.record(request, session, "handback", speech_id=result.speech_id, force=force or None)
    return _handed_back(result)
