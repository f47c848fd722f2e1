"""Scheduled commands and coaching: `POST /input`, `/say` and `/interrupt` with `when` (applied by the routes in
``routes``, through ``schedule`` here), the list and status of what is scheduled, its cancellation, and
`POST /coach`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ...runtime.pending import COACH_PREFIX, PendingCommand, PendingKind
from ...runtime.scheduled import PendingEnded, TooManyPending, UnknownPending, UnknownToolCall
from ...runtime.session import AgentSession
from ...store import Store
from .. import audit, deps
from ..auth import Require
from ..deps import HostDep, KnownSession, SettingsDep
from ..idempotency import Idem, idempotent
from ..problems import POST_ERRORS, ProblemError, not_found, problem_responses
from ..schemas import CoachCreate
from ..schemas_scheduled import CoachAccepted, ScheduledList, ScheduledRead, WhenAfterTool, WhenNow

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])


def check_text(max_chars: int, text: str, field: str = "text") -> None:
    if len(text) > max_chars:
        raise ProblemError(413, "text_too_long", f"{field} is {len(text)} characters; the limit is {max_chars}.")


def scheduled_at(when: Any) -> bool:
    """Whether a command's ``when`` schedules it (absent, or ``now``: it applies now, as ever)."""
    return when is not None and not isinstance(when, WhenNow)


async def _ended_in_store(store: Store, session: AgentSession, call_id: str) -> bool:
    info = await store.tool_call(session.id, call_id)
    return info is not None and info.ended


async def schedule(
    request: Request,
    store: Store,
    session: AgentSession,
    kind: PendingKind,
    args: dict[str, Any],
    when: Any,
    idem: Idem,
    render: Any,
) -> ScheduledRead:
    """Accept a command to apply at ``when`` (durable before it answers); problems: 422 ``unknown_tool_call``, 409
    ``too_many_scheduled``."""
    call_id = when.call_id if isinstance(when, WhenAfterTool) else None
    # a call the live session no longer remembers (it keeps the latest ones) may have ended long ago: the store knows
    ended = (
        call_id is not None and session.tool_call(call_id) is None and await _ended_in_store(store, session, call_id)
    )
    try:
        command = await session.scheduled.schedule(
            kind,
            args,
            at=when.at,
            call_id=call_id,
            receipt=idem.receipt(lambda c: render(ScheduledRead.of(c))),
            ended_call=ended,
        )
    except UnknownToolCall:
        raise ProblemError(
            422, "unknown_tool_call", f"Session {session.id!r} has no tool call {call_id!r} to wait for."
        ) from None
    except TooManyPending as err:
        raise ProblemError(
            409, "too_many_scheduled", f"The session already holds {err.limit} pending commands; cancel one first."
        ) from None
    audit.record(request, session, "schedule", scheduled_id=command.id)
    return ScheduledRead.of(command)


@router.post(
    "/{sid}/coach",
    operation_id="coachAgent",
    responses=problem_responses(*POST_ERRORS),
    status_code=202,
    response_model=CoachAccepted,
    dependencies=[Depends(Require("sessions:control"))],
)
@idempotent
async def coach(
    sid: str, body: CoachCreate, host: HostDep, settings: SettingsDep, request: Request, idem: Idem
) -> CoachAccepted:
    """Leave a note for the agent's next model request only: it is given to the model as a system message at the end
    of that request's context, then gone. The user never sees it (no chat item, no `chat.item` event); watchers see
    `session.coached`, then `scheduled.applied` (kind `coach`) once a request carried it. Durable until used (a drain
    or a failover keeps it); listed and cancellable with the scheduled commands. At most 8 unused notes (409
    `too_many_scheduled`)."""
    check_text(settings.max_text_chars, body.note, "note")
    session = await deps.active_session(host, sid)
    async with deps.deadline(settings):
        try:
            note = await session.coach.coach(body.note, receipt=idem.receipt(_coached))
        except TooManyPending as err:
            raise ProblemError(
                409, "too_many_scheduled", f"The session already holds {err.limit} unused notes."
            ) from None
    audit.record(request, session, "coach", scheduled_id=note.id)
    return _coached(note)


def _coached(note: PendingCommand) -> CoachAccepted:
    return CoachAccepted(id=note.id, state=note.state)


@router.get(
    "/{sid}/scheduled",
    operation_id="listScheduled",
    responses=problem_responses(404),
    response_model=ScheduledList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_scheduled(session: KnownSession, pending_only: bool = False) -> ScheduledList:
    """The session's scheduled commands and coaching notes, oldest first, whatever their state (`pending_only`: the
    pending ones alone)."""
    commands = await session.store.pending_commands(session.id)
    return ScheduledList(items=[ScheduledRead.of(c) for c in commands if c.pending or not pending_only])


@router.get(
    "/{sid}/scheduled/{scheduled_id}",
    operation_id="getScheduled",
    responses=problem_responses(404),
    response_model=ScheduledRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_scheduled(session: KnownSession, scheduled_id: str) -> ScheduledRead:
    """One scheduled command or coaching note: its state (`pending`, `applied` with its `result`, or `cancelled`
    with its `reason`)."""
    found = next((c for c in await session.store.pending_commands(session.id) if c.id == scheduled_id), None)
    if found is None:
        raise not_found("scheduled_command", scheduled_id)
    return ScheduledRead.of(found)


@router.delete(
    "/{sid}/scheduled/{scheduled_id}",
    operation_id="cancelScheduled",
    responses=problem_responses(404, (409, "Already applied or cancelled, or the session is not active")),
    response_model=ScheduledRead,
    dependencies=[Depends(Require("sessions:control"))],
)
async def cancel_scheduled(sid: str, scheduled_id: str, host: HostDep, request: Request) -> ScheduledRead:
    """Cancel a pending scheduled command or coaching note (`scheduled.cancelled`, reason `cancelled_by_operator`);
    returns its cancelled record once durable. 409 `already_ended` when it was applied or cancelled already."""
    session = await deps.active_session(host, sid)
    book = session.coach if scheduled_id.startswith(COACH_PREFIX) else session.scheduled
    try:
        cancelled = await book.cancel(scheduled_id)
    except UnknownPending:
        stored = next((c for c in await host.store.pending_commands(sid) if c.id == scheduled_id), None)
        if stored is None or stored.pending:
            raise not_found("scheduled_command", scheduled_id) from None
        raise ProblemError(409, "already_ended", f"{scheduled_id!r} is already {stored.state}.") from None
    except PendingEnded as err:
        raise ProblemError(409, "already_ended", f"{scheduled_id!r} is already {err.command.state}.") from None
    audit.record(request, session, "cancel_scheduled", scheduled_id=scheduled_id)
    return ScheduledRead.of(cancelled)
