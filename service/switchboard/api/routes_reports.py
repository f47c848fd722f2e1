"""Reports from webhook-tool backends that answered 202: progress while the call runs, then its result."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request

from ..runtime.tools import ToolCallInfo
from ..webhooks import BackendResult, CallAlreadyEnded, NotAwaitingReport, Webhooks
from . import deps
from .auth import Require
from .idempotency import IdempotencyGuard
from .problems import ProblemError, not_found, problem_responses
from .schemas import ToolCallRead, ToolProgressReport, ToolResultReport

router = APIRouter(tags=["tools"])
guard = IdempotencyGuard()

REPORT_RESPONSES = problem_responses(
    400,
    (404, "unknown session or tool call"),
    408,
    (409, "already_ended (the call has its result, was cancelled or timed out), or not_awaiting_report"),
    413,
)


def _webhooks(request: Request) -> Webhooks:
    return request.app.state.webhooks  # type: ignore[no-any-return]


def _already_ended(call_id: str, info: ToolCallInfo | None = None) -> ProblemError:
    status = f" ({info.status.value})" if info is not None and info.ended else ""
    return ProblemError(409, "already_ended", f"Tool call {call_id!r} already ended{status}; the report was ignored.")


async def _not_awaiting(request: Request, sid: str, call_id: str) -> ProblemError:
    """Why no webhook call is waiting under this id: 404 if it never existed, else 409."""
    live = await deps.known_session(request, sid)
    info = live.tool_call(call_id) if live is not None else None
    if info is None and live is None:
        info = await deps.store(request).tool_call(sid, call_id)
    if info is None:
        return not_found("tool_call", call_id)
    if info.ended:
        return _already_ended(call_id, info)
    return ProblemError(
        409, "not_awaiting_report", f"Tool call {call_id!r} ({info.name}) is not a webhook call waiting for a report."
    )


async def _read(request: Request, sid: str, call_id: str) -> dict[str, Any]:
    live = deps.host(request).live(sid)
    info = live.tool_call(call_id) if live is not None else None
    if info is None:
        info = await deps.store(request).tool_call(sid, call_id)
    if info is None:  # pragma: no cover - a call that took a report is in the session or the store
        raise not_found("tool_call", call_id)
    return deps.tool_call_read(sid, info).model_dump(mode="json")


@router.post(
    "/v1/sessions/{sid}/tool-calls/{call_id}/progress",
    operation_id="reportToolProgress",
    response_model=ToolCallRead,
    responses=REPORT_RESPONSES,
    dependencies=[Depends(Require("tools:report"))],
)
async def report_tool_progress(request: Request, sid: str, call_id: str, body: ToolProgressReport) -> Any:
    """Report progress of a webhook call (its backend answered 202). It streams as `tool.progress`; the first report
    moves the call to the background, exactly like `ctx.update()` in a Python tool. Returns once it is recorded."""

    async def handler() -> tuple[int, Any]:
        try:
            async with deps.deadline(request):
                # shielded: a client that goes away must not cut a progress commit in half
                await asyncio.shield(_webhooks(request).broker.progress(sid, call_id, body.message, body.progress))
        except CallAlreadyEnded:
            live = deps.host(request).live(sid)
            raise _already_ended(call_id, live.tool_call(call_id) if live else None) from None
        except NotAwaitingReport:
            raise await _not_awaiting(request, sid, call_id) from None
        return 200, await _read(request, sid, call_id)

    return await guard.run(request, body.model_dump(mode="json"), handler)


@router.post(
    "/v1/sessions/{sid}/tool-calls/{call_id}/result",
    operation_id="reportToolResult",
    response_model=ToolCallRead,
    responses=REPORT_RESPONSES,
    dependencies=[Depends(Require("tools:report"))],
)
async def report_tool_result(request: Request, sid: str, call_id: str, body: ToolResultReport) -> Any:
    """Report the result of a webhook call (its backend answered 202); `is_error` marks a failure. Returns the call
    once it has ended and its output is committed. A second result, or one after the call was cancelled or timed
    out, is a 409 `already_ended` and changes nothing."""

    async def handler() -> tuple[int, Any]:
        try:
            _webhooks(request).broker.result(sid, call_id, BackendResult(output=body.output, is_error=body.is_error))
        except CallAlreadyEnded:
            live = deps.host(request).live(sid)
            raise _already_ended(call_id, live.tool_call(call_id) if live else None) from None
        except NotAwaitingReport:
            raise await _not_awaiting(request, sid, call_id) from None
        live = deps.host(request).live(sid)
        running = live.executor.get(call_id) if live is not None else None
        if running is not None:
            async with deps.deadline(request):
                await asyncio.shield(running.ended_fut)
        return 200, await _read(request, sid, call_id)

    return await guard.run(request, body.model_dump(mode="json"), handler)
