"""Export: a whole session (its resource, chat, tool calls and event log) as one JSON document."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, StreamingResponse

from ...control.host import SessionHost
from ...control.session_view import SessionView
from ...runtime.chat import ChatItem, utcnow
from ...runtime.tools import ToolCallInfo
from .. import deps
from ..auth import Require
from ..deps import HostDep, KnownSession
from ..problems import problem_responses
from ..schemas import ExportedEvent, SessionExport

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


async def _chat(view: SessionView) -> AsyncIterator[ChatItem]:
    """The chat: a live session's from memory, an ended one's from the store a page at a time."""
    if view.live is not None:
        for item in await view.chat():
            yield item
        return
    cursor = None
    while True:
        page, more = await view.chat_page(cursor, EXPORT_CHAT_PAGE)
        for item in page:
            yield item
        if not more or not page:
            return
        cursor = page[-1].id


async def _tool_calls(view: SessionView) -> AsyncIterator[ToolCallInfo]:
    cursor = None
    while True:
        page, more = await view.tool_call_page(None, cursor, EXPORT_TOOL_CALLS_PAGE)
        for info in page:
            yield info
        if not more or not page:
            return
        cursor = page[-1].call_id


async def _events(view: SessionView, host: SessionHost) -> AsyncIterator[ExportedEvent]:
    since = 0
    while True:
        page = await host.store.events(view.id, since=since, limit=EXPORT_EVENTS_PAGE)
        for event in page:
            yield ExportedEvent(
                seq=event.seq, session_id=event.session_id, type=event.type, at=event.at, data=event.data
            )
        if len(page) < EXPORT_EVENTS_PAGE:
            return
        since = page[-1].seq


async def _document(view: SessionView, host: SessionHost) -> AsyncIterator[bytes]:
    """The document in pieces, each value encoded on its own; the event log is read a page at a time."""
    head = {"format": EXPORT_FORMAT, "exported_at": utcnow(), "session": deps.session_read(view, host)}
    yield _json(head)[:-1]
    yield b',"chat":['
    first = True
    async for item in _chat(view):
        yield (b"" if first else b",") + _json(item)
        first = False
    yield b"]"
    yield b',"tool_calls":['
    first = True
    async for info in _tool_calls(view):
        yield (b"" if first else b",") + _json(deps.tool_call_read(view.id, info))
        first = False
    yield b"]"
    yield b',"events":['
    first = True
    try:
        async for event in _events(view, host):
            yield (b"" if first else b",") + _json(event)
            first = False
    except Exception:
        # the answer has started: it cannot become a problem now, and the cut document is not valid JSON
        logger.exception("export of session %s failed reading its events", view.id, extra={"session_id": view.id})
        raise
    yield b"]}"


@router.get(
    "/v1/sessions/{sid}/export",
    operation_id="exportSession",
    response_class=JSONResponse,  # for the schema: the answer is streamed
    responses={
        200: {
            "model": SessionExport,
            "description": "The session as one document (sent as `session-<id>.json`)",
        },
        **problem_responses(404),
    },
    dependencies=[Depends(Require("sessions:read"))],
)
async def export_session(session: KnownSession, host: HostDep) -> StreamingResponse:
    """The whole session as one JSON document: the session resource, its chat context, its tool calls and its
    event log (operator actions included), for live, closed and failed sessions alike. The log, and the chat of a
    session that ended, are read a page at a time, so a long session costs the service no more memory than a short
    one."""
    filename = f"session-{session.id}.json"
    return StreamingResponse(
        _document(session, host),
        media_type="application/json",
        headers={"Content-Disposition": f'attachment; filename="{filename}"'},
    )
