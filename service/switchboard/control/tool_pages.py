"""Tool calls a page at a time, by (started_at, call_id).

A session's list: a live session answers from memory; an ended one reads only the page's rows from the store. Its
cursor is the id of the last call of the previous page, so a page continues after that call even when the call no
longer matches the status filter. The running calls across sessions end between pages, so that list's cursor is
opaque: it carries the position itself.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import datetime

from ..runtime.session import AgentSession
from ..runtime.tools import ToolCallInfo, ToolCallKey, ToolStatus
from ..store import InvalidCursor, Store

RunningKey = tuple[datetime, str, str]  # (started_at, session_id, call_id)


async def session_page(
    sid: str, live: AgentSession | None, store: Store, status: ToolStatus | None, cursor: str | None, limit: int
) -> tuple[list[ToolCallInfo], bool]:
    """The ``limit`` calls after the call ``cursor`` (None: from the start) and whether more follow. Raises
    ``KeyError`` when ``cursor`` is not a call of this session."""
    after = await _cursor_key(sid, live, store, cursor) if cursor is not None else None
    if live is None:
        infos = await store.tool_calls_after(sid, after, limit + 1, status)
        return infos[:limit], len(infos) > limit
    infos = [i for i in live.tool_calls(status) if after is None or i.order_key > after]
    if not live.remembers_every_tool_call:  # older ended calls are only in the store now
        known = {i.call_id for i in live.tool_calls()}
        # the store's rows of calls held in memory are skipped: reading that many more rows keeps the page whole
        stored = await store.tool_calls_after(sid, after, limit + 1 + len(known), status)
        infos += [i for i in stored if i.call_id not in known]
    infos.sort(key=lambda i: i.order_key)
    return infos[:limit], len(infos) > limit


async def _cursor_key(sid: str, live: AgentSession | None, store: Store, cursor: str) -> ToolCallKey:
    info = live.tool_call(cursor) if live is not None else None
    key = info.order_key if info is not None else await store.tool_call_key(sid, cursor)
    if key is None:
        raise KeyError(cursor)
    return key


def running_page(
    sessions: Mapping[str, AgentSession], cursor: str | None, limit: int
) -> tuple[list[tuple[str, ToolCallInfo]], str | None]:
    """Running calls of the live sessions, oldest first, ``limit`` after ``cursor``, and the next page's cursor
    (None: the last page). Raises ``InvalidCursor`` for a cursor this function did not hand out."""
    after = _decode(cursor) if cursor is not None else None
    calls = [(sid, info) for sid, session in list(sessions.items()) for info in session.tool_calls(ToolStatus.RUNNING)]
    calls = sorted((c for c in calls if after is None or _running_key(c) > after), key=_running_key)
    page = calls[:limit]
    return page, _encode(_running_key(page[-1])) if len(calls) > limit else None


def _running_key(call: tuple[str, ToolCallInfo]) -> RunningKey:
    sid, info = call
    return (info.started_at, sid, info.call_id)


def _encode(key: RunningKey) -> str:
    at, sid, call_id = key
    raw = json.dumps([at.isoformat(), sid, call_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode(cursor: str) -> RunningKey:
    try:
        at, sid, call_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        started_at = datetime.fromisoformat(at)
        if started_at.tzinfo is None or not isinstance(sid, str) or not isinstance(call_id, str):
            raise ValueError(cursor)
    except (ValueError, TypeError) as err:
        raise InvalidCursor(f"invalid cursor {cursor!r}") from err
    return started_at, sid, call_id
