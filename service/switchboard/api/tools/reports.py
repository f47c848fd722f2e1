"""Reports from webhook-tool backends that answered 202: progress while the call runs, then its result.

A report needs the ``tools:report`` scope and the call's own report credential (the ``report_token`` of its delivery,
in the ``X-Switchboard-Report-Token`` header), checked before anything is looked up: without it every report gets the
same 403 ``report_refused``, whether the session and the call exist or not. With it, the backend hears how its call
stands (409 ``already_ended``, ``not_awaiting_report``); the answer is the call's status, nothing more. A report for
a call that goes on, but not here or not yet (its session is being recovered or moved, or this node's copy of it
turned out stale as the report was applied), answers 503 with ``Retry-After``: sent again, it reaches the call where
it runs (``control.webhook_reports``).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from ...control.host import SessionHost
from ...control.webhook_reports import ALREADY_ENDED, NO_CALL, NO_SESSION, apply_result, refusal
from ...integrations.webhooks import REPORT_TOKEN_HEADER, BackendResult, CallAlreadyEnded, NotAwaitingReport
from ...runtime.tools import ToolCallInfo
from .. import deps
from ..auth import Require
from ..deps import ServicesDep
from ..idempotency import Idem, idempotent
from ..openapi_doc import API_KEY, REPORT_TOKEN, security
from ..problems import ProblemError, not_found, problem_responses
from ..schemas import ToolProgressReport, ToolReportRead, ToolResultReport

router = APIRouter(tags=["tools"])

REPORT_RESPONSES = problem_responses(
    400,
    (403, "report_refused: no report credential of this tool call (the same answer whether the call exists or not)"),
    (404, "the call's session is gone"),
    408,
    (409, "already_ended (the call has its result, was cancelled or timed out), or not_awaiting_report"),
    413,
    (
        503,
        "Not taken: not completed in time, the database is unreachable, or the call goes on but not here or not yet "
        "(session_recovering, session_moving, session_moved; session_moved also when this node's copy of the session "
        "turned out stale as the report was applied: nothing of it landed). Retry after `Retry-After` seconds, with "
        "the same Idempotency-Key",
    ),
)


def report_refused() -> ProblemError:
    return ProblemError(
        403,
        "report_refused",
        f"Reports need the report_token of the tool call's delivery, in the {REPORT_TOKEN_HEADER} header.",
    )


async def _reporter(request: Request, sid: str, call_id: str, services: ServicesDep) -> None:
    """The caller holds this call's report credential (checked before anything about the call is looked up)."""
    if not services.webhooks.credentials.check(sid, call_id, request.headers.get(REPORT_TOKEN_HEADER)):
        raise report_refused()


REPORTER = [Depends(Require("tools:report")), Depends(_reporter)]
# both credentials at once (the report token is a security scheme of the document, not a parameter)
REPORTER_SECURITY = security({API_KEY: ["tools:report"], REPORT_TOKEN: []})


def _already_ended(call_id: str, info: ToolCallInfo | None = None) -> ProblemError:
    status = f" ({info.status.value})" if info is not None and info.ended else ""
    return ProblemError(409, "already_ended", f"Tool call {call_id!r} already ended{status}; the report was ignored.")


async def _refused(
    host: SessionHost, sid: str, call_id: str, err: CallAlreadyEnded | NotAwaitingReport
) -> ProblemError:
    """Why the rightful backend's report was refused: the call ended (409), is not a webhook call waiting for one
    (409), its session is gone (404), or the call goes on but not here, or not yet (503: retry)."""
    refused = await refusal(host, sid, call_id, err)
    if refused.retry:
        detail = f"Tool call {call_id!r} is not waiting here now (its session is moving or being recovered); retry."
        return ProblemError(503, refused.code, detail, headers={"Retry-After": "1"})
    if refused.code == NO_SESSION:
        return not_found("session", sid)
    if refused.code == NO_CALL:
        return not_found("tool_call", call_id)
    if refused.code == ALREADY_ENDED:
        return _already_ended(call_id, refused.info)
    name = refused.info.name if refused.info is not None else "?"
    return ProblemError(
        409, "not_awaiting_report", f"Tool call {call_id!r} ({name}) is not a webhook call waiting for a report."
    )


def _reported(info: ToolCallInfo) -> ToolReportRead:
    return ToolReportRead(call_id=info.call_id, status=info.status.value)


async def _read(host: SessionHost, sid: str, call_id: str) -> ToolReportRead:
    session = await deps.known_session(host, sid)
    info = await session.tool_call(call_id)
    if info is None:  # pragma: no cover - a call that took a report is in the session or the store
        raise not_found("tool_call", call_id)
    return _reported(info)


@router.post(
    "/v1/sessions/{sid}/tool-calls/{call_id}/progress",
    operation_id="reportToolProgress",
    response_model=ToolReportRead,
    responses=REPORT_RESPONSES,
    dependencies=REPORTER,
    openapi_extra=REPORTER_SECURITY,
)
@idempotent
async def report_tool_progress(
    sid: str, call_id: str, body: ToolProgressReport, services: ServicesDep, idem: Idem
) -> ToolReportRead:
    """Report progress of a webhook call (its backend answered 202). It streams as `tool.progress`; the first report
    moves the call to the background, exactly like `ctx.update()` in a Python tool. Returns once it is recorded."""
    try:
        async with deps.deadline(services.settings):
            # shielded: a client that goes away must not cut a progress commit in half
            receipt = idem.receipt(_reported)
            await asyncio.shield(
                services.webhooks.broker.progress(
                    sid, call_id, body.message, body.progress, receipt, silent=body.silent
                )
            )
    except (CallAlreadyEnded, NotAwaitingReport) as err:
        raise await _refused(services.host, sid, call_id, err) from None
    return await _read(services.host, sid, call_id)


@router.post(
    "/v1/sessions/{sid}/tool-calls/{call_id}/result",
    operation_id="reportToolResult",
    response_model=ToolReportRead,
    responses=REPORT_RESPONSES,
    dependencies=REPORTER,
    openapi_extra=REPORTER_SECURITY,
)
@idempotent
async def report_tool_result(
    sid: str, call_id: str, body: ToolResultReport, services: ServicesDep, idem: Idem
) -> ToolReportRead:
    """Report the result of a webhook call (its backend answered 202); `is_error` marks a failure. Returns the call's
    status once it has ended and its output is committed. A second result, or one after the call was cancelled or
    timed out, is a 409 `already_ended` and changes nothing. A 503 (`session_moved`, `session_moving`,
    `session_recovering`) means the result was not taken: send it again after `Retry-After`, with the same
    `Idempotency-Key` (its session moved to another node, where the call waits for it)."""
    result = BackendResult(output=body.output, is_error=body.is_error)
    try:
        async with deps.deadline(services.settings):
            # shielded: a client that goes away must not stop the wait for the end it decided
            await asyncio.shield(apply_result(services.webhooks.broker, sid, call_id, result, idem.receipt(_reported)))
    except (CallAlreadyEnded, NotAwaitingReport) as err:
        raise await _refused(services.host, sid, call_id, err) from None
    return await _read(services.host, sid, call_id)
