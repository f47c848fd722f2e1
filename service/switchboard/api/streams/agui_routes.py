"""A session as an AG-UI event stream over Server-Sent Events, resumable with ``Last-Event-ID``.

The log is the same as the WebSocket event stream's (``session_stream``: replay from the store, then live, each event
once and in order); each session event becomes AG-UI events (``agui``) and the last of them carries ``id: <seq>``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

from ...control.hub import SubscriberOverflow
from ...runtime.aio import cancel_and_wait
from ...runtime.events import Event
from .. import deps
from ..auth import AuthError, authenticate, bearer, check, url_token
from ..openapi_doc import API_KEY, SESSION_TOKEN, TOKEN_QUERY, security
from ..problems import ProblemError, not_found, problem_responses
from .agui import SHARED, AguiTranslator
from .direct_send import DirectSend
from .events import CLOSE_TIMEOUT_S, MAX_POSITION, SLOW_CLOSE_TIMEOUT_S, Sends, fell_behind
from .session_stream import TERMINAL_EVENTS, open_session_log, pump_log
from .stream_slots import TooManyStreams

logger = logging.getLogger("switchboard.api.streams.agui")
router = APIRouter(tags=["events"])

TOO_SLOW = ": too slow; reconnect with Last-Event-ID\n\n"
KEEPALIVE_S = 15.0  # an SSE comment this often on a quiet stream: proxies and clients keep the connection
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def resume_point(since: int | None, last_event_id: str | None) -> int:
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
    openapi_extra=security(
        {API_KEY: ["events:read"]}, {SESSION_TOKEN: ["events:read"]}, {TOKEN_QUERY: ["events:read"]}
    ),
)
async def stream_session_agui(
    request: Request,
    sid: str,
    since: Annotated[int | None, Query(ge=0, le=MAX_POSITION, description="Resume after this seq.")] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> StreamingResponse:
    """Stream the session as AG-UI events (docs/ag-ui.md): replay those after the resume point, then live ones,
    until the session ends."""
    services = deps.services(request)
    try:
        principal = authenticate(
            services.settings,
            url_token(request.query_params.getlist("token")) or bearer(None, request.headers.get("authorization")),
        )
        check(principal, "events:read", sid)
    except AuthError as err:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        raise ProblemError(err.status, err.code, err.detail, headers=headers) from None
    resume = resume_point(since, last_event_id)
    if await services.host.find(sid) is None:
        raise not_found("session", sid)
    try:
        release = services.streams.acquire(principal.budget, operator=principal.operator)
    except TooManyStreams as err:
        raise ProblemError(429, "too_many_streams", err.reason, headers={"Retry-After": "1"}) from None
    return AguiStream(services, sid, resume, release)


class AguiStream(StreamingResponse):
    """The SSE response. Live events are sent from the hub's publish while the stream waits idle for its next one
    (``DirectSend``: no task wakes per subscriber per event); the rest (replay, keepalives, an event behind a send
    still under way, the session's end) by the stream's pump. A stream that fell behind (its buffer overflowed, or a
    send stuck for ``SEND_TIMEOUT_S``) ends with a comment: the client resumes with the ``Last-Event-ID`` it holds.
    """

    def __init__(self, services: deps.Services, sid: str, since: int, release: Callable[[], None]) -> None:
        super().__init__((), media_type="text/event-stream", headers=SSE_HEADERS)
        self._services, self._sid, self._since, self._release = services, sid, since, release

    async def stream_response(self, send: Send) -> None:
        metrics = self._services.metrics
        metrics.ws_connections.inc()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            behind = await self._stream(send)
            if behind:
                metrics.ws_dropped.inc()
            try:
                async with asyncio.timeout(SLOW_CLOSE_TIMEOUT_S if behind else CLOSE_TIMEOUT_S):
                    if behind:  # nothing is lost: the client reconnects with the Last-Event-ID it holds
                        await send(sse_chunk(TOO_SLOW))
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except TimeoutError:  # a client that reads nothing is not waited for: the server closes the connection
                logger.warning("AG-UI stream of session %s: the client reads nothing; closing", self._sid)
        finally:
            metrics.ws_connections.dec()
            self._release()

    async def _stream(self, send: Send) -> bool:
        """Send the session's events until it ends; True when the stream fell behind."""
        resume, sends = [self._since], Sends()
        services = self._services
        sub, log = await open_session_log(
            services.host.hub,
            services.store,
            self._sid,
            self._since,
            None,
            maxsize=services.settings.ws_buffer,
            has_ended=self._has_ended,
            heartbeat_s=KEEPALIVE_S,
        )
        translator = AguiTranslator(self._sid)

        async def send_text(text: str) -> None:
            sends.since = time.monotonic()
            await send(sse_chunk(text))
            sends.since = None

        async def keepalive() -> None:
            await send_text(": keepalive\n\n")

        def frames(event: Event, text: str | None) -> list[str]:
            encoded = SHARED.sse(translator, event)
            return [encoded] if encoded else []  # a progress update's chat items make no AG-UI event

        # as on the WebSocket: on every node the hub hands the subscription its session's events in order
        direct = DirectSend(send_text, sub, frames, resume, sends, TERMINAL_EVENTS, joined=True)
        sub.direct = direct
        pump = pump_log(log, direct, keepalive=keepalive)

        with sub:
            tasks = [asyncio.create_task(pump, name="sse-pump"), asyncio.create_task(fell_behind(sub, sends))]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(*tasks)
        if tasks[1] in done:
            return True
        err = tasks[0].exception()
        if isinstance(err, SubscriberOverflow):
            return True
        if err is not None:
            raise err
        return False

    async def _has_ended(self) -> bool:
        session = await self._services.host.find(self._sid)
        return session is not None and session.ended


def sse_chunk(text: str) -> Message:
    return {"type": "http.response.body", "body": text.encode(), "more_body": True}
