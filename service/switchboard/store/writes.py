"""The SQL of one group-commit batch: many queued operations written in a single transaction."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from ..runtime.chat import ChatItem
from ..runtime.events import Event
from ..runtime.pending import split_marks
from ..runtime.ports import Commit, Completion
from ..runtime.status import SessionStatus
from . import models as m
from .idempotency import complete_in
from .records import SessionExists, StoreError, now_utc
from .rows import event_row, item_row, pending_row, speech_row, tool_call_row
from .text import encode_text

DurableCallback = Callable[[list[Event]], None]

# Bound parameters per statement stay far below SQLite's and PostgreSQL's limits (32766 / 32767).
_LOOKUP_CHUNK = 2000


@dataclass(slots=True, eq=False)
class Op:
    """One queued write. Exactly one of ``commit``, ``event`` and ``mark_state`` is set, or ``create`` (a new
    session's row), then with an optional ``commit`` carrying only the create's idempotency receipts.

    ``epoch`` is its fencing token: the ownership epoch it was made under (that of the live session that made it, or
    of the claim it acts under). On a fenced store it lands only while the session's row names this node at exactly
    that epoch. Left out (None), the writer sets the epoch the node holds when the write is queued; if it holds none,
    the write lands only while no node owns the session."""

    session_id: str
    fut: asyncio.Future[None]
    commit: Commit | None = None
    event: Event | None = None
    mark_state: SessionStatus | None = None
    on_durable: DurableCallback | None = None
    epoch: int | None = None
    create: dict[str, Any] | None = None  # a ``sessions`` row to insert; an id already taken fails this op alone


def dialect_insert(conn: AsyncConnection | Connection, table: sa.Table) -> Any:
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
# On SQLite the same two look-ups take their keys as one JSON array: SQLite plans a row-value IN over a list of
# values as a scan of the whole index (a cost that grows with every session's items and events, paid by every batch);
# joined with ``json_each`` it probes the unique index once per key. Keys are bound as the columns store them.
_SQLITE_EVENT_IDS = sa.text(
    "SELECT events.id, events.session_id, events.seq FROM json_each(:keys) AS k JOIN events"
    " ON events.session_id = json_extract(k.value, '$[0]') AND events.seq = json_extract(k.value, '$[1]')"
).columns(m.events.c.id, m.events.c.session_id, m.events.c.seq)
_SQLITE_EXISTING_ITEMS = sa.text(
    "SELECT chat_items.session_id, chat_items.item_id FROM json_each(:keys) AS k JOIN chat_items"
    " ON chat_items.session_id = json_extract(k.value, '$[0]') AND chat_items.item_id = json_extract(k.value, '$[1]')"
).columns(m.chat_items.c.session_id, m.chat_items.c.item_id)


def _lookup(conn: Connection, stmt: Any, sqlite_stmt: Any, keys: Sequence[tuple[str, Any]]) -> list[Any]:
    """Rows of ``stmt`` for ``keys`` ((session id, key) pairs), through ``sqlite_stmt`` on SQLite."""
    if conn.dialect.name == "sqlite":
        encoded = [[encode_text(sid), encode_text(k) if isinstance(k, str) else k] for sid, k in keys]
        return list(conn.execute(sqlite_stmt, {"keys": json.dumps(encoded)}))
    return list(conn.execute(stmt, {"keys": list(keys)}))


def _upsert(conn: Connection, table: sa.Table, keys: Sequence[str], update: Sequence[str]) -> Any:
    return _upsert_stmt(conn.dialect.name, table, tuple(keys), tuple(update))


@functools.cache
def _upsert_stmt(dialect: str, table: sa.Table, keys: tuple[str, ...], update: tuple[str, ...]) -> Any:
    # Built once per table: ``excluded`` makes a new alias with a proxy per column, cyclic garbage for every batch.
    stmt = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    return stmt.on_conflict_do_update(index_elements=list(keys), set_={c: stmt.excluded[c] for c in update})


_SESSION_STATE_COLUMNS = ("agent", "entered", "state", "llm_state", "current_speech_id", "takeover", "updated_at")
_TOOL_CALL_UPDATE = tuple(c.name for c in m.tool_calls.columns if c.name not in ("session_id", "call_id"))
_SPEECH_UPDATE = tuple(c.name for c in m.speeches.columns if c.name not in ("session_id", "id"))
_PENDING_UPDATE = ("state", "data")


@dataclass(eq=False)
class _Batch:
    """The rows of a batch's operations, merged in order: a later version of the same tool call, speech or session
    replaces an earlier one (each is a full record), a chat item or an event is kept once."""

    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    marks: dict[str, SessionStatus] = field(default_factory=dict)  # state changes of sessions the batch has no row for
    items: list[tuple[str, ChatItem]] = field(default_factory=list)
    item_keys: set[tuple[str, str]] = field(default_factory=set)
    tool_calls: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    speeches: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    pending: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # scheduled commands, notes
    events: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    event_objs: dict[tuple[str, int], list[Event]] = field(default_factory=dict)
    receipts: list[Completion] = field(default_factory=list)  # idempotency reservations completed by this batch
    created: list[dict[str, Any]] = field(default_factory=list)  # new sessions' rows

    @classmethod
    def of(cls, ops: Sequence[Op]) -> _Batch:
        batch = cls()
        for op in ops:
            if op.create is not None:
                batch.created.append(op.create)
            if op.commit is not None:
                batch.add_commit(op.session_id, op.commit)
            elif op.event is not None:
                batch.add_event(op.session_id, op.event)
            elif op.mark_state is not None:
                batch.mark(op.session_id, op.mark_state)
        return batch

    def add_commit(self, sid: str, commit: Commit) -> None:
        marks, receipts = split_marks(commit.receipts)  # a scheduled command applied with its effect rides there
        self.receipts.extend(receipts)
        for command in [*commit.pending, *marks]:
            self.pending[(sid, command.id)] = pending_row(sid, command)
        for it in commit.items:
            if (sid, it.id) not in self.item_keys:
                self.item_keys.add((sid, it.id))
                self.items.append((sid, it))
        for tc in commit.tool_calls:
            self.tool_calls[(sid, tc.call_id)] = tool_call_row(sid, tc)
        for sp in commit.speeches:
            self.speeches[(sid, sp.id)] = speech_row(sid, sp)
        if commit.session is not None:
            s = commit.session
            self.sessions[sid] = {
                "id": sid,
                "agent": s.agent,
                "entered": s.entered,
                "state": s.state,
                "llm_state": s.model_dump(mode="json", include={"llm_state"})["llm_state"],
                "takeover": s.model_dump(mode="json", include={"takeover"})["takeover"],
                "current_speech_id": s.current_speech_id,
            }
            self.marks.pop(sid, None)

    def add_event(self, sid: str, event: Event) -> None:
        self.events.setdefault((sid, event.seq), event_row(event))
        self.event_objs.setdefault((sid, event.seq), []).append(event)

    def mark(self, sid: str, state: SessionStatus) -> None:
        if sid in self.sessions:
            self.sessions[sid]["state"] = state
        else:
            self.marks[sid] = state


def apply_batch(
    conn: Connection,
    ops: Sequence[Op],
    next_pos: dict[str, int],
    *,
    ordered: bool = False,
    refused: dict[Op, StoreError] | None = None,
) -> dict[str, int]:
    """Write ``ops`` on ``conn`` (inside the caller's transaction), in order.

    Synchronous, so that a whole batch is one call: on SQLite the writer's thread runs it in one hop, on PostgreSQL
    ``AsyncConnection.run_sync`` runs it on the event loop. Nothing here may touch the event loop (no futures).

    ``next_pos`` is the per-session next chat position known so far (read-only here); sessions missing from it are
    initialised from the database once. Returns the counters after this batch; the caller keeps them only if the
    transaction commits.

    Later versions of the same tool call / speech / session in one batch replace earlier ones (each is a full
    record), chat items already stored are skipped (idempotent append), events already stored are kept as they are.
    The idempotency reservations the commits complete are completed first: one no longer held by its holder raises
    ``ReceiptRefused`` (the caller's transaction is rolled back, and the writer writes the operations one by one, so
    that only the commit carrying it fails).

    A create (``Op.create``) of an id already stored, or created earlier in the batch, writes nothing (its receipts
    are not completed either) and is put in ``refused`` with ``SessionExists`` (raised when ``refused`` is None);
    the rest of the batch is written.
    """
    ops = _without_taken(conn, ops, refused)
    batch = _Batch.of(ops)
    complete_in(conn, batch.receipts)
    if batch.created:
        conn.execute(sa.insert(m.sessions), batch.created)
    # Sessions first: a SessionState may create the row the other tables' foreign keys point at.
    _write_sessions(conn, batch, now_utc())
    counters = _append_items(conn, batch.items, next_pos)
    _upsert_rows(conn, m.tool_calls, ("session_id", "call_id"), _TOOL_CALL_UPDATE, batch.tool_calls)
    _upsert_rows(conn, m.speeches, ("session_id", "id"), _SPEECH_UPDATE, batch.speeches)
    _upsert_rows(conn, m.pending_commands, ("session_id", "id"), _PENDING_UPDATE, batch.pending)
    _insert_events(conn, batch, ordered)
    return counters


_TAKEN_IDS = sa.select(m.sessions.c.id).where(m.sessions.c.id.in_(sa.bindparam("ids", expanding=True)))


def _without_taken(conn: Connection, ops: Sequence[Op], refused: dict[Op, StoreError] | None) -> Sequence[Op]:
    """``ops`` without the creates of ids that are taken (stored, or created by an earlier op of the batch)."""
    creates = [op for op in ops if op.create is not None]
    if not creates:
        return ops
    ids = sorted({op.session_id for op in creates})
    taken: set[str] = set()
    for start in range(0, len(ids), _LOOKUP_CHUNK):
        taken.update(conn.execute(_TAKEN_IDS, {"ids": ids[start : start + _LOOKUP_CHUNK]}).scalars())
    kept: list[Op] = []
    for op in ops:
        if op.create is not None:
            if op.session_id in taken:
                if refused is None:
                    raise SessionExists(op.session_id)
                refused[op] = SessionExists(op.session_id)
                continue
            taken.add(op.session_id)
        kept.append(op)
    return kept


def _write_sessions(conn: Connection, batch: _Batch, now: datetime) -> None:
    if batch.sessions:
        rows = [
            {**row, "config": {}, "metadata": {}, "created_at": now, "updated_at": now}
            for row in batch.sessions.values()
        ]
        conn.execute(_upsert(conn, m.sessions, ["id"], _SESSION_STATE_COLUMNS), rows)
    if batch.marks:
        t = m.sessions
        stmt = (
            sa.update(t)
            .where(t.c.id == sa.bindparam("b_id"))
            .values(state=sa.bindparam("b_state"), updated_at=sa.bindparam("b_now"))
        )
        conn.execute(stmt, [{"b_id": sid, "b_state": st, "b_now": now} for sid, st in batch.marks.items()])


def _upsert_rows(
    conn: Connection,
    table: sa.Table,
    keys: Sequence[str],
    update: Sequence[str],
    rows: dict[Any, dict[str, Any]],
) -> None:
    if rows:
        conn.execute(_upsert(conn, table, keys, update), list(rows.values()))


# Cluster mode (several writers on one PostgreSQL): a batch inserts its events holding this transaction-scoped lock,
# so events get their ids (the multi-session stream's cursor) in commit order: once an id is committed, every lower
# one is committed too or never will be. One writer alone (a single node, SQLite) commits in id order anyway.
EVENT_ORDER_LOCK_KEY = 0x5357_4256  # "SWBV"
_EVENT_ORDER_LOCK = sa.text("SELECT pg_advisory_xact_lock(:key)").bindparams(key=EVENT_ORDER_LOCK_KEY)


def _insert_events(conn: Connection, batch: _Batch, ordered: bool) -> None:
    if not batch.events:
        return
    if ordered and conn.dialect.name == "postgresql":
        conn.execute(_EVENT_ORDER_LOCK)
    conn.execute(_insert_events_stmt(conn.dialect.name), list(batch.events.values()))
    # Each event learns its global cursor (the multi-session stream resumes by it).
    keys = list(batch.events)
    for start in range(0, len(keys), 400):
        found = _lookup(conn, _EVENT_IDS, _SQLITE_EVENT_IDS, keys[start : start + 400])
        for row_id, sid, seq in found:
            for ev in batch.event_objs.get((sid, seq), ()):
                ev.cursor = int(row_id)


def _append_items(conn: Connection, items: list[tuple[str, ChatItem]], next_pos: dict[str, int]) -> dict[str, int]:
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
        found = {sid: top for sid, top in conn.execute(stmt.group_by(t.c.session_id)).all()}
        counters.update({sid: (found[sid] + 1 if found.get(sid) is not None else 0) for sid in missing})
    existing = _existing_items(conn, [(sid, it.id) for sid, it in items])
    rows = []
    for sid, it in items:
        if (sid, it.id) in existing:
            continue  # committed before (a retried batch, or the same item twice): kept once, like ChatContext
        rows.append(item_row(sid, counters[sid], it))
        counters[sid] += 1
    if rows:
        conn.execute(sa.insert(t), rows)
    return counters


def _existing_items(conn: Connection, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for start in range(0, len(keys), _LOOKUP_CHUNK):
        rows = _lookup(conn, _EXISTING_ITEMS, _SQLITE_EXISTING_ITEMS, keys[start : start + _LOOKUP_CHUNK])
        found.update((sid, item_id) for sid, item_id in rows)
    return found
