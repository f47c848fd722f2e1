"""A session as an AG-UI event stream over Server-Sent Events, resumable with ``Last-Event-ID``.

The log is the same as the WebSocket event stream's (``routes_events.session_log``: replay from the store, then live,
gap-free); each session event becomes AG-UI events (``agui``) and the last of them carries ``id: <seq>``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from ..control.hub import SubscriberOverflow
from . import deps
from .agui import SHARED, AguiTranslator
from .auth import AuthError, authenticate, bearer, check, url_token
from .problems import ProblemError, not_found, problem_responses
from .routes_events import MAX_POSITION, open_session_log
from .stream_slots import TooManyStreams

logger = logging.getLogger("switchboard.api.agui")
router = APIRouter(tags=["events"])

KEEPALIVE_S = 15.0  # an SSE comment this often on a quiet stream: proxies and clients keep the connection
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _resume_point(since: int | None, last_event_id: str | None) -> int:
    """Where to resume: ``Last-Event-ID`` (what an EventSource sends when it reconnects) wins over ``since``."""
    if last_event_id is None or not last_event_id.strip():
        return since or 0
    try:
        value = int(last_event_id.strip())
    except ValueError:
        raise ProblemError(400, "invalid_last_event_id", "Last-Event-ID must be an event seq (an integer).") from None
    if not 0 <= value <= MAX_POSITION:
        raise ProblemError(400, "invalid_last_event_id", f"Last-Event-ID must be between 0 and {MAX_POSITION}.")
    return value


# one Server-Sent Event: `data` holds one AG-UI event as JSON; `id` (the session event's seq) on the last AG-UI event
# made from each session event
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "data": {"type": "string", "contentMediaType": "application/json"},
        "event": {"type": "string"},
        "id": {"type": "string", "pattern": "^[0-9]+$"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


@router.get(
    "/v1/sessions/{sid}/ag-ui",
    operation_id="streamSessionAgui",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "AG-UI events as Server-Sent Events; each session event's last AG-UI event carries "
            "`id: <seq>`. Resume with `Last-Event-ID` (or `since`).",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
        **problem_responses(400, 401, 403, 404, (429, "too many open event streams")),
    },
)
async def stream_session_agui(
    request: Request,
    sid: str,
    since: Annotated[int | None, Query(ge=0, le=MAX_POSITION, description="Resume after this seq.")] = None,
    token: Annotated[str | None, Query(description="A session token, for clients that cannot set headers.")] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    """Stream the session as AG-UI events (docs/ag-ui.md): replay those after the resume point, then live ones,
    until the session ends. Needs `events:read`, from a Bearer key or a session token (`token=`)."""
    services = deps.services(request)
    try:
        principal = authenticate(
            services.settings, url_token(token) or bearer(None, request.headers.get("authorization"))
        )
        check(principal, "events:read", sid)
    except AuthError as err:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        raise ProblemError(err.status, err.code, err.detail, headers=headers) from None
    resume = _resume_point(since, last_event_id)
    if await services.host.find(sid) is None:
        raise not_found("session", sid)
    try:
        release = services.streams.acquire(principal.name)
    except TooManyStreams as err:
        raise ProblemError(429, "too_many_streams", err.reason, headers={"Retry-After": "1"}) from None
    return StreamingResponse(
        _frames(services, sid, resume, release), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _frames(services: deps.Services, sid: str, since: int, release: Callable[[], None]) -> AsyncIterator[str]:
    metrics = services.metrics
    metrics.ws_connections.inc()
    try:
        sub, log = await open_session_log(services, sid, since, None, heartbeat_s=KEEPALIVE_S)
        translator = AguiTranslator(sid)
        with sub:
            async with contextlib.aclosing(log):
                try:
                    async for item in log:
                        if item is None:
                            yield ": keepalive\n\n"
                            continue
                        event = item[0]
                        yield SHARED.sse(translator, event)
                except SubscriberOverflow:
                    # nothing is lost: the client reconnects with the Last-Event-ID it holds
                    metrics.ws_dropped.inc()
                    yield ": too slow; reconnect with Last-Event-ID\n\n"
    finally:
        metrics.ws_connections.dec()
        release()
