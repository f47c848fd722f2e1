"""The SQL of one group-commit batch: many queued operations written in a single transaction."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from ..runtime.chat import ChatItem
from ..runtime.events import Event
from ..runtime.ports import Commit
from ..runtime.status import SessionStatus
from . import models as m
from .records import now_utc
from .rows import event_row, item_row, speech_row, tool_call_row

DurableCallback = Callable[[list[Event]], None]

# Bound parameters per statement stay far below SQLite's and PostgreSQL's limits (32766 / 32767).
_LOOKUP_CHUNK = 2000


@dataclass(slots=True, eq=False)
class Op:
    """One queued write. Exactly one of ``commit``, ``event`` and ``mark_state`` is set."""

    session_id: str
    fut: asyncio.Future[None]
    commit: Commit | None = None
    event: Event | None = None
    mark_state: SessionStatus | None = None
    on_durable: DurableCallback | None = None


def dialect_insert(conn: AsyncConnection, table: sa.Table) -> Any:
    """The dialect's INSERT (both have ``on_conflict_do_update`` / ``on_conflict_do_nothing``)."""
    return postgresql.insert(table) if conn.dialect.name == "postgresql" else sqlite.insert(table)


@functools.cache
def _insert_events_stmt(dialect: str) -> Any:
    stmt = postgresql.insert(m.events) if dialect == "postgresql" else sqlite.insert(m.events)
    return stmt.on_conflict_do_nothing(index_elements=["session_id", "seq"])


# Statements run for every batch are built once (building them leaves cyclic garbage for the collector).
_EVENT_IDS = sa.select(m.events.c.id, m.events.c.session_id, m.events.c.seq).where(
    sa.tuple_(m.events.c.session_id, m.events.c.seq).in_(sa.bindparam("keys", expanding=True))
)
_EXISTING_ITEMS = sa.select(m.chat_items.c.session_id, m.chat_items.c.item_id).where(
    sa.tuple_(m.chat_items.c.session_id, m.chat_items.c.item_id).in_(sa.bindparam("keys", expanding=True))
)


def _upsert(conn: AsyncConnection, table: sa.Table, keys: Sequence[str], update: Sequence[str]) -> Any:
    return _upsert_stmt(conn.dialect.name, table, tuple(keys), tuple(update))


@functools.cache
def _upsert_stmt(dialect: str, table: sa.Table, keys: tuple[str, ...], update: tuple[str, ...]) -> Any:
    # Built once per table: ``excluded`` makes a new alias with a proxy per column, cyclic garbage for every batch.
    stmt = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    return stmt.on_conflict_do_update(index_elements=list(keys), set_={c: stmt.excluded[c] for c in update})


_SESSION_STATE_COLUMNS = ("agent", "state", "llm_state", "current_speech_id", "updated_at")
_TOOL_CALL_UPDATE = tuple(c.name for c in m.tool_calls.columns if c.name not in ("session_id", "call_id"))
_SPEECH_UPDATE = tuple(c.name for c in m.speeches.columns if c.name not in ("session_id", "id"))


async def apply_batch(conn: AsyncConnection, ops: Sequence[Op], next_pos: dict[str, int]) -> dict[str, int]:
    """Write ``ops`` on ``conn`` (inside the caller's transaction), in order.

    ``next_pos`` is the per-session next chat position known so far (read-only here); sessions missing from it are
    initialised from the database once. Returns the counters after this batch; the caller keeps them only if the
    transaction commits.

    Later versions of the same tool call / speech / session in one batch replace earlier ones (each is a full
    record), chat items already stored are skipped (idempotent append), events already stored are kept as they are.
    """
    now = now_utc()
    session_rows: dict[str, dict[str, Any]] = {}
    marks: dict[str, SessionStatus] = {}
    items: list[tuple[str, ChatItem]] = []
    item_keys: set[tuple[str, str]] = set()
    tool_rows: dict[tuple[str, str], dict[str, Any]] = {}
    speech_rows: dict[tuple[str, str], dict[str, Any]] = {}
    event_rows: dict[tuple[str, int], dict[str, Any]] = {}
    event_objs: dict[tuple[str, int], list[Event]] = {}
    for op in ops:
        sid = op.session_id
        if op.commit is not None:
            c = op.commit
            for it in c.items:
                if (sid, it.id) not in item_keys:
                    item_keys.add((sid, it.id))
                    items.append((sid, it))
            for tc in c.tool_calls:
                tool_rows[(sid, tc.call_id)] = tool_call_row(sid, tc)
            for sp in c.speeches:
                speech_rows[(sid, sp.id)] = speech_row(sid, sp)
            if c.session is not None:
                s = c.session
                session_rows[sid] = {
                    "id": sid,
                    "agent": s.agent,
                    "state": s.state,
                    "llm_state": s.model_dump(mode="json", include={"llm_state"})["llm_state"],
                    "current_speech_id": s.current_speech_id,
                }
                marks.pop(sid, None)
        elif op.event is not None:
            event_rows.setdefault((sid, op.event.seq), event_row(op.event))
            event_objs.setdefault((sid, op.event.seq), []).append(op.event)
        elif op.mark_state is not None:
            if sid in session_rows:
                session_rows[sid]["state"] = op.mark_state
            else:
                marks[sid] = op.mark_state

    # Sessions first: a SessionState may create the row the other tables' foreign keys point at.
    if session_rows:
        rows = [
            {**row, "config": {}, "metadata": {}, "created_at": now, "updated_at": now} for row in session_rows.values()
        ]
        await conn.execute(_upsert(conn, m.sessions, ["id"], _SESSION_STATE_COLUMNS), rows)
    if marks:
        t = m.sessions
        stmt = (
            sa.update(t)
            .where(t.c.id == sa.bindparam("b_id"))
            .values(state=sa.bindparam("b_state"), updated_at=sa.bindparam("b_now"))
        )
        await conn.execute(stmt, [{"b_id": sid, "b_state": st, "b_now": now} for sid, st in marks.items()])

    counters = await _append_items(conn, items, next_pos)

    if tool_rows:
        await conn.execute(
            _upsert(conn, m.tool_calls, ["session_id", "call_id"], _TOOL_CALL_UPDATE), list(tool_rows.values())
        )
    if speech_rows:
        await conn.execute(_upsert(conn, m.speeches, ["session_id", "id"], _SPEECH_UPDATE), list(speech_rows.values()))
    if event_rows:
        await conn.execute(_insert_events_stmt(conn.dialect.name), list(event_rows.values()))
        # Each event learns its global cursor (the multi-session stream resumes by it).
        keys = list(event_rows)
        for start in range(0, len(keys), 400):
            found = await conn.execute(_EVENT_IDS, {"keys": keys[start : start + 400]})
            for row_id, sid, seq in found:
                for ev in event_objs.get((sid, seq), ()):
                    ev.cursor = int(row_id)
    return counters


async def _append_items(
    conn: AsyncConnection, items: list[tuple[str, ChatItem]], next_pos: dict[str, int]
) -> dict[str, int]:
    """Insert chat items at the next positions of their sessions: O(1) per item whatever the context size."""
    if not items:
        return {}
    t = m.chat_items
    sids = {sid for sid, _ in items}
    counters = {sid: next_pos[sid] for sid in sids if sid in next_pos}
    missing = sids - counters.keys()
    if missing:
        # Once per session (per process, or after a failed batch): an index lookup, not a scan.
        stmt = sa.select(t.c.session_id, sa.func.max(t.c.pos)).where(t.c.session_id.in_(missing))
        found = {sid: top for sid, top in (await conn.execute(stmt.group_by(t.c.session_id))).all()}
        counters.update({sid: (found[sid] + 1 if found.get(sid) is not None else 0) for sid in missing})
    existing = await _existing_items(conn, [(sid, it.id) for sid, it in items])
    rows = []
    for sid, it in items:
        if (sid, it.id) in existing:
            continue  # committed before (a retried batch, or the same item twice): kept once, like ChatContext
        rows.append(item_row(sid, counters[sid], it))
        counters[sid] += 1
    if rows:
        await conn.execute(sa.insert(t), rows)
    return counters


async def _existing_items(conn: AsyncConnection, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for start in range(0, len(keys), _LOOKUP_CHUNK):
        result = await conn.execute(_EXISTING_ITEMS, {"keys": keys[start : start + _LOOKUP_CHUNK]})
        found.update((sid, item_id) for sid, item_id in result.all())
    return found
