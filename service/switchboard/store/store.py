"""Store: the SQL implementation of the runtime's ports, plus the reads the API and recovery need.

>>> store = Store.from_url("sqlite+aiosqlite:///var/switchboard.db")
>>> await store.migrate(); await store.start()
>>> await store.create_session(SessionRecord(id="s1", agent="demo"))
>>> await store.chat_store().commit("s1", Commit(items=[message("user", "hi")]))
>>> await store.aclose()
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import logging
from collections import deque
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..runtime.chat import ChatItem, order_items
from ..runtime.events import Event
from ..runtime.pending import PendingCommand
from ..runtime.ports import ChatStore, Commit, Completion, EventSink
from ..runtime.speech import SpeechInfo
from ..runtime.status import ENDED_STATUSES, LIVE_STATUSES, SessionStatus
from ..runtime.tools import RUNNING_STATUSES, ToolCallInfo, ToolCallKey, ToolStatus
from . import bulk
from . import models as m
from .alerts import Alerts
from .engine import DATABASE_TIMEOUT_S, make_engine, whole
from .idempotency import IdempotencyKeys, complete_async
from .migrate import upgrade_engine
from .ownership import Fence, Nodes
from .recent import recent_events
from .records import (
    IdempotencyRecord,
    QuotaFull,
    ReadError,
    ReceiptRefused,
    SessionData,
    SessionExists,
    SessionRecord,
    StoreError,
)
from .rows import (
    BadRow,
    event_from_row,
    idempotency_from_row,
    item_from_row,
    items_from_texts,
    pending_from_row,
    session_from_row,
    session_row,
    speech_from_row,
    tool_call_from_row,
)
from .runtime_ports import StoreChatStore, StoreEventSink
from .text import JSONText, decode_text
from .writer import GroupCommitWriter
from .writes import Op

logger = logging.getLogger("switchboard.store")

T = TypeVar("T")

READ_ERROR_LOG_MAX = 100
# What each session's event log reports (``Reported``): the subject of every chat.item, tool.ended and speech.done.
# Session ids and event types are read as they are (neither can hold what the store encodes): one row per event.
_REPORTED = sa.select(
    sa.type_coerce(m.events.c.session_id, sa.String()),
    sa.type_coerce(m.events.c.type, sa.String()),
    m.events.c.subject,
).where(m.events.c.subject.is_not(None))
# Chat item data read as JSON text: ``item_from_row`` parses and validates it in one step.
ITEM_DATA = sa.cast(m.chat_items.c.data, JSONText).label("data")
# One owner's quota-checked creates take the transaction-scoped advisory lock (OWNER_LOCK_SPACE, a hash of the owner):
# on every node, each counts the owner's sessions only once the previous one committed. A pair of keys, so a space
# apart from the single-key locks (``ownership.NODES_LOCK_KEY``, ``writes.EVENT_ORDER_LOCK_KEY``); two owners whose
# hashes meet only wait for each other.
OWNER_LOCK_SPACE = 0x5357_5154  # "SWQT"
_OWNER_LOCK = sa.text("SELECT pg_advisory_xact_lock(:space, :key)")
BULK_CHUNK = 500  # sessions per query in load_sessions_bulk (bound parameters stay far below the limits)
PING_TIMEOUT_S = 2.0


class InvalidCursor(StoreError, ValueError):
    """A ``list_sessions`` cursor that this store did not hand out."""


class Store:
    """Persistence for Switchboard on SQLite or PostgreSQL (SQLAlchemy 2 async).

    Writes from the runtime ports go through one group-commit writer task; reads use pooled connections.
    A session is written by one process at a time: the node that owns it (``ownership``). With a fence
    (``use_fence``) every write batch checks that ownership in its own transaction.
    """

    def __init__(self, engine: AsyncEngine, *, batch_max: int = 256) -> None:
        self.engine = engine
        self.writer = GroupCommitWriter(engine, batch_max=batch_max)
        self.nodes = Nodes(engine)
        self.alerts = Alerts(engine)  # alerts opened and cleared once across the nodes, and their deliveries
        # the reservations of idempotency keys, their completion and their takeover
        self.idempotency = IdempotencyKeys(
            engine, lambda row: self._first([row], idempotency_from_row, "idempotency_keys")
        )
        self._started = False
        self.read_errors = 0
        self.read_error_log: deque[ReadError] = deque(maxlen=READ_ERROR_LOG_MAX)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        batch_max: int = 256,
        schema: str | None = None,
        idle_in_transaction_ms: int | None = None,
        timeout_s: float = DATABASE_TIMEOUT_S,
    ) -> Store:
        """``sqlite+aiosqlite:///path/to.db`` or ``postgresql+asyncpg://user@host/db`` (``schema``: PostgreSQL
        search_path, to keep several stores in one database; ``idle_in_transaction_ms``: PostgreSQL ends a
        transaction of this store left idle that long; ``timeout_s``: the bound of each call; see ``make_engine``)."""
        engine = make_engine(url, schema=schema, idle_in_transaction_ms=idle_in_transaction_ms, timeout_s=timeout_s)
        return cls(engine, batch_max=batch_max)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the writer task. Does not migrate (call ``migrate()`` first)."""
        self._started = True
        self.writer.start()

    async def aclose(self, *, timeout_s: float | None = 30.0) -> None:
        """Flush queued writes (for at most ``timeout_s`` if the database is down), stop, dispose the engine."""
        await self.writer.aclose(timeout_s=timeout_s)
        await self.engine.dispose()

    async def migrate(self) -> None:
        """``alembic upgrade head`` on this store's database."""
        await upgrade_engine(self.engine, "head")

    async def ping(self) -> bool:
        """Ready: the database answers and the writer is running and not stuck on an unavailable database."""
        try:
            async with asyncio.timeout(PING_TIMEOUT_S), self.engine.connect() as conn:
                await conn.execute(sa.select(1))
        except Exception:
            return False
        return not self.writer.unavailable and (self.writer.running or not self._started)

    def use_fence(self, fence: Fence) -> None:
        """From now on every write checks that ``fence``'s node owns the session it writes for (``ownership``)."""
        self.writer.fence = fence

    @property
    def fence(self) -> Fence | None:
        return self.writer.fence

    # -- runtime ports ----------------------------------------------------------------------------------------

    def chat_store(self, epoch: int | None = None) -> ChatStore:
        """The chat store of a session's incarnation made at ``epoch``: its commits land only while this node owns
        the session at that epoch (None: the epoch held when each commit is queued; see ``writes.Op``)."""
        return StoreChatStore(self.writer, epoch)

    def event_sink(
        self, on_durable: Callable[[list[Event]], None] | None = None, epoch: int | None = None
    ) -> EventSink:
        """An event sink (for a session's incarnation made at ``epoch``, as ``chat_store``); after each committed batch
        ``on_durable`` gets that batch's events (per session in ``seq`` order), before the publishers' awaitables
        resolve."""
        return StoreEventSink(self.writer, on_durable, epoch)

    # -- sessions ---------------------------------------------------------------------------------------------

    async def create_session(
        self, rec: SessionRecord, *, owner_quota: int | None = None, receipt: Completion | None = None
    ) -> None:
        """Insert a session row; raises ``SessionExists`` if the id is taken.

        The row goes through the group-commit writer (creates that arrive together share a transaction; one of an
        id that is taken fails alone, writing nothing). With ``owner_quota``, the row is inserted only while its
        owner (``config["owner"]``) has fewer live sessions than that in the database, else ``QuotaFull``: counted
        and inserted in a transaction of its own holding the owner's lock (PostgreSQL), so creates for one owner on
        several nodes at once cannot both pass the count. A create that fails leaves nothing counted. ``receipt``
        completes the create's idempotency reservation in the same transaction (else ``ReceiptRefused``, nothing
        inserted: its holder no longer holds it)."""
        owner = rec.config.get("owner")
        quota = (str(owner), owner_quota) if owner_quota is not None and owner is not None else None
        try:
            if quota is not None or not self.writer.running:  # (a store not started: a transaction of its own)
                await self._create_alone(rec, receipt, quota)
            else:
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                commit = Commit(receipts=[receipt]) if receipt is not None else None  # landed with the row
                self.writer.submit(Op(rec.id, fut, create=session_row(rec), commit=commit))
                await asyncio.shield(fut)
        except sa_exc.IntegrityError as err:  # another node inserted the same id at the same moment
            if await self.get_session(rec.id) is not None:
                raise SessionExists(rec.id) from err
            raise

    @whole
    async def _create_alone(
        self, rec: SessionRecord, receipt: Completion | None, quota: tuple[str, int] | None
    ) -> None:
        async with self.engine.begin() as conn:
            if quota is not None:
                await self._check_owner_quota(conn, *quota)
            await conn.execute(sa.insert(m.sessions), [session_row(rec)])
            if receipt is not None and not await complete_async(conn, receipt):
                raise ReceiptRefused(receipt.key)
        if receipt is not None:
            receipt.mark_landed()

    async def _check_owner_quota(self, conn: AsyncConnection, owner: str, quota: int) -> None:
        if conn.dialect.name == "postgresql":
            await conn.execute(_OWNER_LOCK, {"space": OWNER_LOCK_SPACE, "key": _owner_lock_key(owner)})
        if await self._live_sessions_of(conn, owner) >= quota:
            raise QuotaFull(f"{owner} has {quota} live sessions")

    async def _live_sessions_of(self, conn: AsyncConnection, owner: str) -> int:
        owner_of = m.SESSION_OWNER if conn.dialect.name == "postgresql" else m.sessions.c.config["owner"].as_string()
        stmt = sa.select(sa.func.count()).select_from(m.sessions).where(m.SESSION_LIVE, owner_of == owner)
        return int((await conn.execute(stmt)).scalar_one())

    async def get_session(self, sid: str) -> SessionRecord | None:
        rows = await self._fetch(sa.select(m.sessions).where(m.sessions.c.id == sid))
        return self._first(rows, session_from_row, "sessions")

    async def list_sessions(
        self, *, state: str | None = None, agent: str | None = None, cursor: str | None = None, limit: int = 50
    ) -> tuple[list[SessionRecord], str | None]:
        """Sessions newest first, ``limit`` at a time; pass the returned cursor to get the next page (None: done).

        Sessions created at the same instant are ordered by id (descending), so the pages neither skip nor repeat.
        """
        t = m.sessions
        stmt = sa.select(t).order_by(t.c.created_at.desc(), t.c.id.desc()).limit(limit + 1)
        if state is not None:
            stmt = stmt.where(t.c.state == state)
        if agent is not None:
            stmt = stmt.where(t.c.agent == agent)
        if cursor:
            after_at, after_id = _decode_cursor(cursor)
            stmt = stmt.where(sa.or_(t.c.created_at < after_at, sa.and_(t.c.created_at == after_at, t.c.id < after_id)))
        rows = await self._fetch(stmt)
        page = rows[:limit]
        next_cursor = _encode_cursor(page[-1]["created_at"], page[-1]["id"]) if len(rows) > limit else None
        return self._convert(page, session_from_row, "sessions"), next_cursor

    async def live_sessions(self, ids: Sequence[str] | None = None) -> list[SessionRecord]:
        """Sessions that were live (active, initializing, closing): what recovery resumes (only ``ids``, if given)."""
        t = m.sessions
        live = sa.select(t).where(t.c.state.in_(sorted(LIVE_STATUSES))).order_by(t.c.created_at, t.c.id)
        if ids is None:
            return self._convert(await self._fetch(live), session_from_row, "sessions")
        wanted = sorted(set(ids))
        out: list[SessionRecord] = []
        for start in range(0, len(wanted), BULK_CHUNK):
            rows = await self._fetch(live.where(t.c.id.in_(wanted[start : start + BULK_CHUNK])))
            out += self._convert(rows, session_from_row, "sessions")
        return sorted(out, key=lambda rec: (rec.created_at, rec.id))

    async def failed_sessions(self, *, since: datetime, limit: int) -> list[tuple[SessionRecord, Event | None]]:
        """Sessions that failed (could not be recovered) at ``since`` or later, the latest first (at most ``limit``),
        each with its ``session.failed`` event (None if it has none)."""
        t, ev = m.sessions, m.events
        stmt = (
            sa.select(t)
            .where(t.c.state == SessionStatus.FAILED.value, t.c.updated_at >= since)
            .order_by(t.c.updated_at.desc(), t.c.id)
            .limit(limit)
        )
        records = self._convert(await self._fetch(stmt), session_from_row, "sessions")
        if not records:
            return []
        failures = (
            sa.select(ev.c.id, ev.c.session_id, ev.c.seq, ev.c.type, ev.c.at, ev.c.data)
            .where(ev.c.session_id.in_([rec.id for rec in records]), ev.c.type == "session.failed")
            .order_by(ev.c.seq)
        )
        found = {
            event.session_id: event for event in self._convert(await self._fetch(failures), event_from_row, "events")
        }
        return [(rec, found.get(rec.id)) for rec in records]

    async def mark_session(self, sid: str, state: SessionStatus, *, epoch: int | None = None) -> None:
        """Set a session's state (e.g. ``failed``), in order with the writes queued before it; under the claim of
        ``epoch`` (as ``chat_store``)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.writer.submit(Op(sid, fut, mark_state=state, epoch=epoch))
        await asyncio.shield(fut)

    # -- reads ------------------------------------------------------------------------------------------------

    async def chat_items(self, sid: str) -> list[ChatItem]:
        """The session's chat context, ordered (``order_items``: by created_at, each output after its call)."""
        t = m.chat_items
        stmt = sa.select(t.c.session_id, t.c.pos, ITEM_DATA).where(t.c.session_id == sid).order_by(t.c.pos)
        return self._items(await self._fetch(stmt))

    async def chat_page(self, sid: str, cursor: str | None, limit: int) -> tuple[list[ChatItem], bool]:
        """The ``limit`` items of the chat (ordered as ``chat_items`` orders it) after the item ``cursor`` (None:
        from the start), and whether more follow. Reads those rows only: a page of a long chat costs what a page of
        a short one does. Raises ``KeyError`` when ``cursor`` is not an item of this chat."""
        async with self.engine.connect() as conn:
            after, rows = await _resume_point(conn, sid, cursor)
            anchors = (await conn.execute(_anchors_after(sid, after, limit + 1))).mappings().all()
            calls = [row["call_id"] for row in anchors if row["type"] == CALL]
            by_call: dict[str, list[RowMapping]] = {}
            for row in (await conn.execute(_outputs_of(sid, calls))).mappings().all() if calls else ():
                by_call.setdefault(row["call_id"], []).append(row)
        for anchor in anchors:
            rows.append(anchor)
            if anchor["type"] == CALL:
                rows.extend(by_call.get(anchor["call_id"], ()))
        return self._parsed(rows[:limit]), len(rows) > limit

    def _items(self, rows: Sequence[RowMapping]) -> list[ChatItem]:
        """One session's item rows (in ``pos`` order) as its ordered chat context; bad rows are skipped."""
        return order_items(self._parsed(rows))

    def _parsed(self, rows: Sequence[RowMapping]) -> list[ChatItem]:
        try:
            return items_from_texts([row["data"] for row in rows])
        except BadRow:  # find, report and skip the bad rows
            return self._convert(rows, item_from_row, "chat_items")

    async def tool_calls(self, sid: str, status: str | None = None) -> list[ToolCallInfo]:
        t = m.tool_calls
        stmt = sa.select(t).where(t.c.session_id == sid).order_by(t.c.started_at, t.c.call_id)
        if status is not None:
            stmt = stmt.where(_listed_as(status))
        return self._convert(await self._fetch(stmt), tool_call_from_row, "tool_calls")

    async def tool_calls_after(
        self, sid: str, after: ToolCallKey | None, limit: int, status: str | None = None
    ) -> list[ToolCallInfo]:
        """The first ``limit`` tool calls of the session ordered after ``after`` (None: from the start), by
        (started_at, call_id): those rows only, however many calls the session has."""
        t = m.tool_calls
        stmt = sa.select(t).where(t.c.session_id == sid).order_by(t.c.started_at, t.c.call_id).limit(limit)
        if status is not None:
            stmt = stmt.where(_listed_as(status))
        if after is not None:
            at, call_id = after
            stmt = stmt.where(sa.or_(t.c.started_at > at, sa.and_(t.c.started_at == at, t.c.call_id > call_id)))
        return self._convert(await self._fetch(stmt), tool_call_from_row, "tool_calls")

    async def tool_call_key(self, sid: str, call_id: str) -> ToolCallKey | None:
        """Where the call stands in the session's tool-call order, without reading its arguments or output."""
        t = m.tool_calls
        stmt = sa.select(t.c.started_at, t.c.call_id).where(t.c.session_id == sid, t.c.call_id == call_id)
        rows = await self._fetch(stmt)
        return (rows[0]["started_at"], rows[0]["call_id"]) if rows else None

    async def tool_call(self, sid: str, call_id: str) -> ToolCallInfo | None:
        t = m.tool_calls
        rows = await self._fetch(sa.select(t).where(t.c.session_id == sid, t.c.call_id == call_id))
        return self._first(rows, tool_call_from_row, "tool_calls")

    async def running_tool_calls(self, limit: int = 1000) -> list[tuple[str, ToolCallInfo]]:
        """Tool calls still running, across sessions, oldest first: ``(session_id, call)``. Calls started at the same
        instant (the clock's resolution) are ordered by session and call id, so ``limit`` cuts one order."""
        t = m.tool_calls
        running = sa.select(t).where(_listed_as(ToolStatus.RUNNING.value))
        stmt = running.order_by(t.c.started_at, t.c.session_id, t.c.call_id).limit(limit)
        rows = await self._fetch(stmt)
        return [(row["session_id"], info) for row, info in self._convert_pairs(rows, tool_call_from_row, "tool_calls")]

    async def speeches(self, sid: str) -> list[SpeechInfo]:
        t = m.speeches
        stmt = sa.select(t).where(t.c.session_id == sid).order_by(t.c.created_at, t.c.id)
        return self._convert(await self._fetch(stmt), speech_from_row, "speeches")

    async def pending_commands(self, sid: str) -> list[PendingCommand]:
        """The session's scheduled commands and coaching notes, whatever their state, oldest first."""
        t = m.pending_commands
        stmt = sa.select(t).where(t.c.session_id == sid).order_by(t.c.created_at, t.c.id)
        return self._convert(await self._fetch(stmt), pending_from_row, "pending_commands")

    async def speech(self, sid: str, speech_id: str) -> SpeechInfo | None:
        t = m.speeches
        rows = await self._fetch(sa.select(t).where(t.c.session_id == sid, t.c.id == speech_id))
        return self._first(rows, speech_from_row, "speeches")

    async def events(
        self, sid: str, *, since: int = 0, limit: int = 1000, types: list[str] | None = None
    ) -> list[Event]:
        """Durable events of ``sid`` with ``seq > since``, in order. ``types`` are globs such as ``tool.*``."""
        t = m.events
        stmt = (
            sa.select(t.c.id, t.c.session_id, t.c.seq, t.c.type, t.c.at, t.c.data)
            .where(t.c.session_id == sid, t.c.seq > since)
            .order_by(t.c.seq)
            .limit(limit)
        )
        type_filter = _type_filter(t.c.type, types)
        if type_filter is not None:
            stmt = stmt.where(type_filter)
        return self._convert(await self._fetch(stmt), event_from_row, "events")

    async def events_multi(
        self, *, session_ids: list[str] | None, since_id: int, limit: int
    ) -> list[tuple[int, Event]]:
        """Events of many sessions (None: all) after the global cursor ``since_id``: ``(id, event)`` by id."""
        if session_ids is not None and not session_ids:
            return []
        t = m.events
        stmt = sa.select(t).where(t.c.id > since_id).order_by(t.c.id).limit(limit)
        if session_ids is not None:
            stmt = stmt.where(t.c.session_id.in_(session_ids))
        rows = await self._fetch(stmt)
        return [(row["id"], ev) for row, ev in self._convert_pairs(rows, event_from_row, "events")]

    async def last_event_cursor(self) -> int:
        """The highest event cursor stored (0 if none)."""
        async with self.engine.connect() as conn:
            return int(await conn.scalar(sa.select(sa.func.max(m.events.c.id))) or 0)

    async def last_seq(self, sid: str) -> int:
        """The highest durable event ``seq`` of ``sid`` (0 if none): where a recovered event log continues."""
        t = m.events
        async with self.engine.connect() as conn:
            value = await conn.scalar(sa.select(sa.func.max(t.c.seq)).where(t.c.session_id == sid))
        return int(value or 0)

    async def load_sessions_bulk(
        self, ids: Sequence[str], *, recent_types: Sequence[str] = (), recent_limit: int = 0
    ) -> dict[str, SessionData]:
        """Chat items (ordered), tool calls, speeches and last event ``seq`` of many sessions (what recovery needs),
        in a few queries per ``BULK_CHUNK`` sessions on one connection, instead of several per session; with
        ``recent_types``, also each session's latest ``recent_limit`` events of those types (``SessionData.recent``:
        what its node needs to know of its recent past, e.g. why it needs an operator)."""
        out = {sid: SessionData() for sid in ids}
        sp, ev = m.speeches, m.events
        async with self.engine.connect() as conn:
            for start in range(0, len(ids), BULK_CHUNK):
                chunk = list(ids[start : start + BULK_CHUNK])
                await self._bulk_items(conn, chunk, out)
                await self._bulk_tool_calls(conn, chunk, out)
                stmt = sa.select(sp).where(sp.c.session_id.in_(chunk))
                rows = (await conn.execute(stmt.order_by(sp.c.created_at, sp.c.id))).mappings().all()
                for row, speech in self._convert_pairs(rows, speech_from_row, "speeches"):
                    out[row["session_id"]].speeches.append(speech)
                pc = m.pending_commands
                stmt = sa.select(pc).where(pc.c.session_id.in_(chunk), pc.c.state == "pending")
                rows = (await conn.execute(stmt.order_by(pc.c.created_at, pc.c.id))).mappings().all()
                for row, command in self._convert_pairs(rows, pending_from_row, "pending_commands"):
                    out[row["session_id"]].pending.append(command)
                stmt = sa.select(ev.c.session_id, sa.func.max(ev.c.seq)).where(ev.c.session_id.in_(chunk))
                for sid, top in await conn.execute(stmt.group_by(ev.c.session_id)):
                    out[sid].last_seq = int(top or 0)
                await self._bulk_reported(conn, chunk, out)
                if recent_types and recent_limit > 0:
                    rows = (await conn.execute(recent_events(chunk, recent_types, recent_limit))).mappings().all()
                    for row, event in self._convert_pairs(rows, event_from_row, "events"):
                        out[row["session_id"]].recent.append(event)
        return out

    async def _bulk_items(self, conn: AsyncConnection, chunk: list[str], out: dict[str, SessionData]) -> None:
        """The chat items of ``chunk`` (``bulk``: read raw, validated per session in one call); a session whose rows
        do not all read back is read again the ordinary way, which reports and skips each bad row."""
        rows = (await conn.execute(bulk.items_of(chunk))).all()
        for stored_id, session_rows in itertools.groupby(rows, key=_first_column):
            sid = decode_text(stored_id)  # read raw: as stored (``text``)
            texts = [text for _, text in session_rows]
            try:
                out[sid].items = order_items(bulk.items_from_stored(texts))
            except bulk.FastReadFailed:
                out[sid].items = await self._items_of(conn, sid)

    async def _items_of(self, conn: AsyncConnection, sid: str) -> list[ChatItem]:
        ci = m.chat_items
        stmt = sa.select(ci.c.session_id, ci.c.pos, ITEM_DATA).where(ci.c.session_id == sid).order_by(ci.c.pos)
        return self._items((await conn.execute(stmt)).mappings().all())

    async def _bulk_tool_calls(self, conn: AsyncConnection, chunk: list[str], out: dict[str, SessionData]) -> None:
        """The tool calls of ``chunk`` (``bulk``: read raw, built without validating again); if any row does not
        read back, the chunk's calls are read again the ordinary way, which reports and skips each bad row."""
        try:
            calls = bulk.tool_calls_from_raw((await conn.execute(bulk.tool_calls_of(chunk))).all())
        except bulk.FastReadFailed:
            tc = m.tool_calls
            stmt = sa.select(tc).where(tc.c.session_id.in_(chunk)).order_by(tc.c.started_at, tc.c.call_id)
            rows = (await conn.execute(stmt)).mappings().all()
            calls = [
                (row["session_id"], call) for row, call in self._convert_pairs(rows, tool_call_from_row, "tool_calls")
            ]
        for sid, call in calls:
            out[sid].tool_calls.append(call)

    async def _bulk_reported(self, conn: AsyncConnection, chunk: list[str], out: dict[str, SessionData]) -> None:
        """What the event logs of ``chunk`` report: their subjects by session and type, or row by row if those do not
        read back (a subject the store did not write)."""
        ev = m.events
        try:
            rows = await conn.execute(bulk.reported_of(chunk, conn.dialect.name))
            reported = [(sid, event_type, bulk.subjects_from_stored(text)) for sid, event_type, text in rows]
        except bulk.FastReadFailed:
            reported = [
                (sid, event_type, [subject])
                for sid, event_type, subject in await conn.execute(_REPORTED.where(ev.c.session_id.in_(chunk)))
            ]
        for sid, event_type, subjects in reported:
            out[decode_text(sid)].reported.add_all(event_type, subjects)

    # -- idempotency (I7) -------------------------------------------------------------------------------------

    async def idempotency_get(self, key: str, scope: str) -> IdempotencyRecord | None:
        t = m.idempotency_keys
        rows = await self._fetch(sa.select(t).where(t.c.key == key, t.c.scope == scope))
        return self._first(rows, idempotency_from_row, "idempotency_keys")

    async def idempotency_put(self, rec: IdempotencyRecord) -> bool:
        """Remember ``rec``; False (and nothing written) if ``(key, scope)`` is already taken."""
        return await self.idempotency.put(rec)

    async def idempotency_purge(self, older_than: datetime) -> int:
        """Forget records (and dead holders' reservations) created before ``older_than``; returns how many."""
        return await self.idempotency.purge(older_than)

    @whole
    async def purge_ended_sessions(self, ended_before: datetime, *, limit: int = 500) -> list[str]:
        """Delete sessions that ended (closed, failed) before ``ended_before``, with their chat, tool calls, speeches
        and events: at most ``limit`` sessions, in one transaction. Returns their ids. An ended session is written
        no more, so nothing races the delete."""
        t = m.sessions
        ended = sorted(ENDED_STATUSES)
        pick = sa.select(t.c.id).where(t.c.state.in_(ended), t.c.updated_at < ended_before).limit(limit)
        async with self.engine.begin() as conn:
            ids = [row.id for row in (await conn.execute(pick)).all()]
            if ids:
                for table in (m.events, m.chat_items, m.tool_calls, m.speeches, m.pending_commands):
                    await conn.execute(sa.delete(table).where(table.c.session_id.in_(ids)))
                # the state is checked again: only ended sessions are ever deleted
                await conn.execute(sa.delete(t).where(t.c.id.in_(ids), t.c.state.in_(ended)))
        return ids

    # -- helpers ----------------------------------------------------------------------------------------------

    async def _fetch(self, stmt: sa.Select[Any]) -> Sequence[RowMapping]:
        async with self.engine.connect() as conn:
            result = await conn.execute(stmt)
            rows: Sequence[RowMapping] = result.mappings().all()
        return rows

    def _convert_pairs(
        self, rows: Sequence[RowMapping], convert: Callable[[RowMapping], T], table: str
    ) -> list[tuple[RowMapping, T]]:
        out: list[tuple[RowMapping, T]] = []
        for row in rows:
            try:
                out.append((row, convert(row)))
            except BadRow as err:
                self._report(table, row, err)
        return out

    def _convert(self, rows: Sequence[RowMapping], convert: Callable[[RowMapping], T], table: str) -> list[T]:
        return [value for _, value in self._convert_pairs(rows, convert, table)]

    def _first(self, rows: Sequence[RowMapping], convert: Callable[[RowMapping], T], table: str) -> T | None:
        values = self._convert(rows[:1], convert, table)
        return values[0] if values else None

    def _report(self, table: str, row: RowMapping, err: BadRow) -> None:
        sid = row.get("session_id", row.get("id") if table == "sessions" else None)
        key_column = {
            "chat_items": "pos",
            "tool_calls": "call_id",
            "speeches": "id",
            "pending_commands": "id",
            "events": "seq",
            "sessions": "id",
            "idempotency_keys": "key",
        }[table]
        key = str(row.get(key_column))
        self.read_errors += 1
        self.read_error_log.append(ReadError(table=table, session_id=sid, key=key, error=str(err)))
        logger.error(
            "store: skipping unreadable %s row (session %s, %s=%s): %s",
            table,
            sid,
            key_column,
            key,
            err,
            extra={"session_id": sid},
        )


def _first_column(row: Sequence[Any]) -> Any:
    return row[0]


def _owner_lock_key(owner: str) -> int:
    return int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=4).digest(), "big", signed=True)


CALL, OUTPUT = "function_call", "function_call_output"
_PAGE_COLUMNS = (m.chat_items.c.pos, m.chat_items.c.type, m.chat_items.c.call_id, m.chat_items.c.created_at, ITEM_DATA)


def _outputs_of(sid: str, call_ids: Sequence[str]) -> sa.Select[Any]:
    t = m.chat_items
    where = (t.c.session_id == sid, t.c.type == OUTPUT, t.c.call_id.in_(call_ids))
    return sa.select(*_PAGE_COLUMNS).where(*where).order_by(t.c.created_at, t.c.pos)


def _anchors_after(sid: str, after: RowMapping | None, limit: int) -> sa.Select[Any]:
    """The items ``order_items`` places by their own time (all but the outputs of calls in the chat), after
    ``after``, by (created_at, pos): the outputs of each call follow it."""
    t, calls = m.chat_items, m.chat_items.alias("calls")
    has_call = sa.exists().where(calls.c.session_id == sid, calls.c.type == CALL, calls.c.call_id == t.c.call_id)
    stmt = sa.select(*_PAGE_COLUMNS).where(t.c.session_id == sid, sa.not_(sa.and_(t.c.type == OUTPUT, has_call)))
    if after is not None:
        later = sa.and_(t.c.created_at == after["created_at"], t.c.pos > after["pos"])
        stmt = stmt.where(sa.or_(t.c.created_at > after["created_at"], later))
    return stmt.order_by(t.c.created_at, t.c.pos).limit(limit)


async def _resume_point(conn: Any, sid: str, cursor: str | None) -> tuple[RowMapping | None, list[RowMapping]]:
    """Where a page after ``cursor`` starts: the item placed by its own time that the cursor is (or whose outputs
    it is one of), and the outputs of that item still to come."""
    if cursor is None:
        return None, []
    t = m.chat_items
    found = (
        await conn.execute(sa.select(*_PAGE_COLUMNS).where(t.c.session_id == sid, t.c.item_id == cursor))
    ).mappings()
    row = found.first()
    if row is None:
        raise KeyError(cursor)
    if row["type"] == CALL:
        return row, list((await conn.execute(_outputs_of(sid, [row["call_id"]]))).mappings().all())
    if row["type"] != OUTPUT:
        return row, []
    calls = sa.select(*_PAGE_COLUMNS).where(t.c.session_id == sid, t.c.type == CALL, t.c.call_id == row["call_id"])
    call = (await conn.execute(calls.order_by(t.c.created_at, t.c.pos).limit(1))).mappings().first()
    if call is None:  # an output whose call is not in the chat keeps its own place
        return row, []
    outputs = list((await conn.execute(_outputs_of(sid, [row["call_id"]]))).mappings().all())
    done = next(i for i, output in enumerate(outputs) if output["pos"] == row["pos"])
    return call, outputs[done + 1 :]


def _type_filter(column: sa.ColumnElement[str], patterns: list[str] | None) -> sa.ColumnElement[bool] | None:
    """SQL for event type globs (``*`` and ``?``), or None for no filter."""
    pats = [p.strip() for p in patterns or () if p.strip()]
    if not pats:
        return None
    exact = [p for p in pats if "*" not in p and "?" not in p]
    clauses: list[sa.ColumnElement[bool]] = [column.in_(exact)] if exact else []
    for p in pats:
        if p in exact:
            continue
        like = p.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_").replace("*", "%").replace("?", "_")
        clauses.append(column.like(like, escape="\\"))
    return sa.or_(*clauses)


def _encode_cursor(created_at: datetime, sid: str) -> str:
    raw = json.dumps([created_at.isoformat(), sid]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, sid = json.loads(raw)
        created_at = datetime.fromisoformat(at)
        if created_at.tzinfo is None or not isinstance(sid, str):
            raise ValueError(cursor)
    except (ValueError, TypeError) as err:
        raise InvalidCursor(f"invalid cursor {cursor!r}") from err
    return created_at, sid


def _listed_as(status: str) -> sa.ColumnElement[bool]:
    """The tool calls a listing filtered by ``status`` shows (``ToolCallInfo.listed_as``): ``running`` is every call
    not ended yet, ``cancelling`` ones included."""
    t = m.tool_calls
    if status == ToolStatus.RUNNING:
        return t.c.status.in_([s.value for s in RUNNING_STATUSES])
    return t.c.status == status
