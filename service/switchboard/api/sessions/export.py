"""Export: a whole session (its resource, chat, tool calls and event log) as one JSON document."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, StreamingResponse

from ...control.host import SessionHost
from ...control.session_view import SessionView
from ...runtime.chat import ChatItem, utcnow
from ...runtime.events import Event
from .. import deps
from ..auth import ANONYMOUS, Require, principal_of
from ..deps import HostDep, KnownSession, services
from ..problems import ProblemError, problem_responses
from ..schemas import ExportedEvent, SessionExport, ToolCallRead
from .export_budget import EXPORT_RETRY_AFTER_S, ExportBudget, ExportResponse, ExportsBusy

router = APIRouter(tags=["sessions"])
logger = logging.getLogger(__name__)

EXPORT_FORMAT = "switchboard.session-export/1"
#: Events (and chat items and tool calls of an ended session) read from the store at a time: the export of a long
#: session never holds its whole log, chat or tool-call list in memory.
EXPORT_EVENTS_PAGE = 500
EXPORT_CHAT_PAGE = 500
EXPORT_TOOL_CALLS_PAGE = 100


def _json(value: Any) -> bytes:
    return json.dumps(jsonable_encoder(value), separators=(",", ":"), ensure_ascii=False).encode()


def _members(values: Sequence[Any], convert: Callable[[Any], Any], first: bool) -> bytes:
    """``values`` (each ``convert``ed) as members of a JSON array, the first of it or not: one chunk."""
    body = b",".join(_json(convert(value)) for value in values)
    return body if first else b"," + body


def _same(value: Any) -> Any:
    return value


def _exported(event: Event) -> ExportedEvent:
    return ExportedEvent(seq=event.seq, session_id=event.session_id, type=event.type, at=event.at, data=event.data)


async def _chat(view: SessionView) -> AsyncIterator[list[ChatItem]]:
    """The chat a page at a time: a live session's from memory (its items are immutable), an ended one's from the
    store."""
    if view.live is not None:
        items = list(await view.chat())
        for start in range(0, len(items), EXPORT_CHAT_PAGE):
            yield items[start : start + EXPORT_CHAT_PAGE]
        return
    cursor = None
    while True:
        page, more = await view.chat_page(cursor, EXPORT_CHAT_PAGE)
        if page:
            yield page
        if not more or not page:
            return
        cursor = page[-1].id


async def _tool_calls(view: SessionView) -> AsyncIterator[list[ToolCallRead]]:
    cursor = None
    while True:
        page, more = await view.tool_call_page(None, cursor, EXPORT_TOOL_CALLS_PAGE)
        if page:  # read here: a live call's info changes on the loop
            yield [deps.tool_call_read(view.id, info) for info in page]
        if not more or not page:
            return
        cursor = page[-1].call_id


async def _events(view: SessionView, host: SessionHost) -> AsyncIterator[list[Event]]:
    since = 0
    while True:
        page = await host.store.events(view.id, since=since, limit=EXPORT_EVENTS_PAGE)
        if page:
            yield page
        if len(page) < EXPORT_EVENTS_PAGE:
            return
        since = page[-1].seq


async def _array(
    pages: AsyncIterator[Sequence[Any]], convert: Callable[[Any], Any], budget: ExportBudget
) -> AsyncIterator[bytes]:
    """The members of a JSON array, a page per chunk, each page encoded on the exports' thread: encoding a page of a
    large log takes long enough to hold up every other request if it ran on the event loop."""
    first = True
    async for page in pages:
        yield await budget.encode(_members, page, convert, first)
        first = False


async def _document(view: SessionView, host: SessionHost, budget: ExportBudget) -> AsyncIterator[bytes]:
    """The document in pieces, a page of values at a time; the event log is read a page at a time."""
    head = {"format": EXPORT_FORMAT, "exported_at": utcnow(), "session": deps.session_read(view, host)}
    yield _json(head)[:-1] + b',"chat":['
    async for chunk in _array(_chat(view), _same, budget):
        yield chunk
    yield b'],"tool_calls":['
    async for chunk in _array(_tool_calls(view), _same, budget):
        yield chunk
    yield b'],"events":['
    try:
        async for chunk in _array(_events(view, host), _exported, budget):
            yield chunk
    except Exception:
        # the answer has started: it cannot become a problem now, and the cut document is not valid JSON
        logger.exception("export of session %s failed reading its events", view.id, extra={"session_id": view.id})
        raise
    yield b"]}"


async def _paced(
    document: AsyncIterator[bytes], budget: ExportBudget, caller: str | None, release: Callable[[], None]
) -> AsyncIterator[bytes]:
    """``document``, each chunk sent once ``caller``'s byte budget holds it; the slot given back when it ends."""
    try:
        async for chunk in document:
            await budget.spend(caller, len(chunk))
            yield chunk
    finally:
        release()


@router.get(
    "/v1/sessions/{sid}/export",
    operation_id="exportSession",
    response_class=JSONResponse,  # for the schema: the answer is streamed
    responses={
        200: {
            "model": SessionExport,
            "description": "The session as one document (sent as `session-<id>.json`)",
        },
        **problem_responses(404, (429, "Rate limited, or too many exports at once: retry after `Retry-After` seconds")),
    },
    dependencies=[Depends(Require("sessions:read"))],
)
async def export_session(request: Request, session: KnownSession, host: HostDep) -> StreamingResponse:
    """The whole session as one JSON document: the session resource, its chat context, its tool calls and its
    event log (operator actions included), for live, closed and failed sessions alike. The log, and the chat of a
    session that ended, are read a page at a time, so a long session costs the service no more memory than a short
    one.

    A process runs at most `SWITCHBOARD_EXPORT_MAX` exports at once, and an API key (its session tokens included)
    at most `SWITCHBOARD_EXPORT_MAX_PER_KEY`: one more is a 429 `too_many_exports` with `Retry-After`. One key's
    exports together send at most `SWITCHBOARD_EXPORT_BYTES_PER_S` bytes a second: beyond, the download slows down."""
    principal = principal_of(request)
    caller = None if principal is ANONYMOUS else principal.budget
    budget = services(request).exports
    try:
        release = budget.enter(caller)
    except ExportsBusy as busy:
        raise ProblemError(
            429, "too_many_exports", str(busy), headers={"Retry-After": str(EXPORT_RETRY_AFTER_S)}
        ) from None
    filename = f"session-{session.id}.json"
    return ExportResponse(
        _paced(_document(session, host, budget), budget, caller, release),
        release=release,
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )
