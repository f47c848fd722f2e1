"""Tool calls: list and read them per session, cancel one, and list running calls across sessions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from ..runtime.executor import AlreadyEnded, NotCancellable, ToolCallNotFound
from ..runtime.tools import ToolStatus
from . import deps
from .auth import Require
from .idempotency import IdempotencyGuard
from .problems import ProblemError, not_found, problem_responses
from .schemas import ToolCallList, ToolCallRead

router = APIRouter(tags=["tools"])
guard = IdempotencyGuard()

StatusFilter = Literal["running", "completed", "failed", "cancelled", "rejected", "interrupted"]


@router.get(
    "/v1/sessions/{sid}/tool-calls",
    operation_id="listToolCalls",
    responses=problem_responses(404),
    response_model=ToolCallList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_tool_calls(
    request: Request, sid: str, status: Annotated[StatusFilter | None, Query()] = None
) -> ToolCallList:
    """The session's tool calls, optionally filtered by status."""
    live = await deps.known_session(request, sid)
    if live is not None:
        infos = live.tool_calls(ToolStatus(status) if status else None)
        if live.executor.forgotten:  # older ended calls were dropped from memory; the store has them all
            known = {i.call_id for i in infos}
            stored = await deps.store(request).tool_calls(sid, status)
            infos += [i for i in stored if i.call_id not in known]
    else:
        infos = await deps.store(request).tool_calls(sid, status)
    infos = sorted(infos, key=lambda i: i.started_at)
    return ToolCallList(items=[deps.tool_call_read(sid, i) for i in infos])


@router.get(
    "/v1/sessions/{sid}/tool-calls/{call_id}",
    operation_id="getToolCall",
    responses=problem_responses(404),
    response_model=ToolCallRead,
    dependencies=[Depends(Require("sessions:read"))],
)
async def get_tool_call(request: Request, sid: str, call_id: str) -> ToolCallRead:
    """One tool call with its progress updates and output."""
    live = await deps.known_session(request, sid)
    info = live.tool_call(call_id) if live else None
    if info is None:
        info = await deps.store(request).tool_call(sid, call_id)
    if info is None:
        raise not_found("tool_call", call_id)
    return deps.tool_call_read(sid, info)


@router.post(
    "/v1/sessions/{sid}/tool-calls/{call_id}/cancel",
    operation_id="cancelToolCall",
    response_model=ToolCallRead,
    responses=problem_responses(400, 404, 408, (409, "not_cancellable or already_ended"), 413),
    dependencies=[Depends(Require("tools:cancel"))],
)
async def cancel_tool_call(request: Request, sid: str, call_id: str) -> Any:
    """Cancel a running, cancellable tool call. Returns once it has ended `cancelled`."""

    async def handler() -> tuple[int, Any]:
        live = await deps.known_session(request, sid)
        if live is None:
            stored = await deps.store(request).tool_call(sid, call_id)
            if stored is None:
                raise not_found("tool_call", call_id)
            raise ProblemError(409, "already_ended", f"Tool call {call_id!r} already ended ({stored.status.value}).")
        try:
            async with deps.deadline(request):
                info = await live.cancel_tool(call_id)
        except ToolCallNotFound:
            raise not_found("tool_call", call_id) from None
        except NotCancellable as err:
            raise ProblemError(409, "not_cancellable", str(err)) from None
        except AlreadyEnded as err:
            raise ProblemError(
                409, "already_ended", f"Tool call {call_id!r} already ended ({err.info.status.value})."
            ) from None
        return 200, deps.tool_call_read(sid, info).model_dump(mode="json")

    return await guard.run(request, {}, handler)


@router.get(
    "/v1/tool-calls",
    operation_id="listRunningToolCalls",
    response_model=ToolCallList,
    dependencies=[Depends(Require("sessions:read"))],
)
async def list_running_tool_calls(
    request: Request,
    status: Annotated[Literal["running"], Query()] = "running",
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
) -> ToolCallList:
    """Running tool calls across every live session (for backend systems)."""
    host = deps.host(request)
    rows = [
        deps.tool_call_read(sid, info)
        for sid, session in list(host.sessions.items())
        for info in session.tool_calls(ToolStatus.RUNNING)
    ]
    rows.sort(key=lambda r: r.started_at)
    return ToolCallList(items=rows[:limit])
