"""Tool calls: list and read them per session, cancel one, and list running calls across sessions."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request

from ...control import tool_pages
from ...runtime.tools import ToolCallInfo, ToolStatus
from ...store import InvalidCursor
from .. import audit, deps, traces
from ..auth import Require
from ..deps import HostDep, KnownSession, SettingsDep
from ..idempotency import Idem, idempotent
from ..problems import ProblemError, not_found, problem_responses
from ..schemas import TOOL_CALL_PAGE_DEFAULT, TOOL_CALL_PAGE_MAX, ToolCallCancel, ToolCallList, ToolCallRead

router = APIRouter(tags=["tools"])

StatusFilter = Literal["running", "cancelling", "completed", "failed", "cancelled", "rejected", "interrupted"]
CANCEL_EFFECTS = frozenset({ToolStatus.CANCELLED, ToolStatus.CANCELLING})


@router.get(
    "/v1/sessions/{sid}/tool-calls",
    operation_id="listToolCalls",
    responses=problem_responses(404),
    response_model=ToolCallList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_tool_calls(
    session: KnownSession,
    status: Annotated[StatusFilter | None, Query()] = None,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=TOOL_CALL_PAGE_MAX)] = TOOL_CALL_PAGE_DEFAULT,
) -> ToolCallList:
    """The session's tool calls by start time, optionally filtered by status (`running`: every call not ended yet,
    those `cancelling` included), a page at a time: `next_cursor` is
    where the next page starts (null on the last). The cursor names the last call returned, so a page never repeats
    a call, also when that call no longer matches `status`."""
    try:
        infos, more = await session.tool_call_page(ToolStatus(status) if status else None, cursor, limit)
    except KeyError:
        raise ProblemError(422, "invalid_cursor", "The cursor is not a tool call of this session.") from None
    items = [deps.tool_call_read(session.id, i) for i in infos]
    return ToolCallList(items=items, next_cursor=infos[-1].call_id if more and infos else None)


@router.get(
    "/v1/sessions/{sid}/tool-calls/{call_id}",
    operation_id="getToolCall",
    responses=problem_responses(404),
    response_model=ToolCallRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_tool_call(sid: str, call_id: str, host: HostDep) -> ToolCallRead:
    """One tool call with its progress updates and output."""
    session = await deps.known_session(host, sid)
    info = await session.tool_call(call_id)
    if info is None:
        raise not_found("tool_call", call_id)
    return deps.tool_call_read(session.id, info)


@router.post(
    "/v1/sessions/{sid}/tool-calls/{call_id}/cancel",
    operation_id="cancelToolCall",
    response_model=ToolCallRead,
    responses=problem_responses(
        400,
        404,
        408,
        (
            409,
            "not_cancellable, already_ended, or not_interruptible (the speech that made the call does not allow "
            "interruptions; send force=true)",
        ),
        413,
    ),
    dependencies=[Depends(Require("tools:cancel"))],
)
@idempotent
async def cancel_tool_call(
    sid: str,
    call_id: str,
    host: HostDep,
    settings: SettingsDep,
    request: Request,
    idem: Idem,
    body: ToolCallCancel | None = None,
) -> ToolCallRead:
    """Cancel a running, cancellable tool call. Returns once it has ended `cancelled`, or once it is `cancelling`: its
    tool ignored the cancellation past a grace period, and the call, still running, ends `cancelled` when the tool
    returns (`tool.cancelling`, then `tool.ended`).

    Refused with 409 `not_interruptible` while the speech that made the call is still going on and does not allow
    interruptions, unless `force` is true."""
    body = body or ToolCallCancel()
    session = await deps.known_session(host, sid)
    await deps.owned_here(host, session)
    if session.live is None:
        stored = await session.tool_call(call_id)
        if stored is None:
            raise not_found("tool_call", call_id)
        raise ProblemError(409, "already_ended", f"Tool call {call_id!r} already ended ({stored.status.value}).")
    live = session.live
    traces.note_cancel(request, sid, call_id)
    reason = f"cancelled by the operator {audit.actor_of(request)}" if settings.auth_enabled else None

    def cancelled(info: ToolCallInfo) -> ToolCallRead | None:  # a call that ended otherwise answers 409
        return deps.tool_call_read(sid, info) if info.status in CANCEL_EFFECTS else None

    async with deps.deadline(settings):
        receipt = idem.receipt(cancelled)
        info = await live.cancel_tool(
            call_id, force=body.force, receipt=receipt, **({"reason": reason} if reason else {})
        )
    audit.record(request, live, "cancel_tool", call_id=call_id, force=body.force or None)
    return deps.tool_call_read(sid, info)


@router.get(
    "/v1/tool-calls",
    operation_id="listRunningToolCalls",
    response_model=ToolCallList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_running_tool_calls(
    host: HostDep,
    status: Annotated[Literal["running"], Query()] = "running",
    cursor: Annotated[str | None, Query(max_length=400)] = None,
    limit: Annotated[int, Query(ge=1, le=TOOL_CALL_PAGE_MAX)] = TOOL_CALL_PAGE_DEFAULT,
) -> ToolCallList:
    """Running tool calls across every live session (for backend systems), oldest first, a page at a time:
    `next_cursor` is where the next page starts (null on the last); it stays valid when calls end meanwhile."""
    try:
        calls, next_cursor = tool_pages.running_page(host.sessions, cursor, limit)
    except InvalidCursor:
        raise ProblemError(422, "invalid_cursor", "The cursor is not valid.") from None
    return ToolCallList(items=[deps.tool_call_read(sid, info) for sid, info in calls], next_cursor=next_cursor)
