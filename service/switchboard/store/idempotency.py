"""Idempotency keys in the database (I7): reserved before the command runs, completed with its effect.

A request with a key first reserves ``(key, scope)``: one row, ``pending``, naming the process that holds it
(``Holder``: a node and its process incarnation). The primary key makes the reservation the cluster's: of two
requests with the same key on two nodes, one inserts the row and the other finds it. The holder runs the command and
its effect carries the completion (``runtime.ports.Completion``): the store sets the row ``done`` with the answer in
the transaction of the effect, and only while the row still names that holder (``complete_in``). So the effect and
the answer are durable together or not at all.

A request that finds the key ``pending`` waits, unless the holder is dead: its node row is gone, no longer leased by
the database's clock, or registered by another process incarnation (the node restarted). A dead holder's effect did
not land (it would have completed the row), so the request takes the reservation over, in an update conditioned on
the old holder, and runs the command itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from ..runtime.ports import Completion
from . import models as m
from .engine import whole
from .ownership import NodeState
from .records import Claim, Holder, IdempotencyRecord, IdempotencyState, ReceiptRefused
from .rows import idempotency_row

PENDING, DONE = IdempotencyState.PENDING.value, IdempotencyState.DONE.value
_LEASED = (NodeState.LIVE.value, NodeState.DRAINING.value)
RESERVE_ATTEMPTS = 5  # a row that changes between the look and the takeover is looked at again, a few times

# A read of a key's row that may fail to convert (a corrupt answer): the store reports it and gives None.
ReadRecord = Callable[[RowMapping], IdempotencyRecord | None]


def database_now(dialect: str) -> sa.ColumnElement[Any]:
    """The database's clock when the statement runs: leases are judged by it, never by this node's clock.
    (SQLite: the text form its timestamps are stored in; one machine, so one clock.)"""
    if dialect == "postgresql":
        return sa.func.clock_timestamp()
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", "now")


def holder_alive(dialect: str) -> sa.ColumnElement[bool]:
    """For a row of ``idempotency_keys``: its holder's process still holds its node's lease."""
    t, n = m.idempotency_keys, m.nodes
    return sa.exists().where(
        n.c.id == t.c.holder_node,
        n.c.incarnation == t.c.holder_incarnation,
        n.c.state.in_(_LEASED),
        n.c.lease_until >= database_now(dialect),
    )


def _insert_once(conn: AsyncConnection) -> Any:
    """INSERT of a row unless its key is taken (``writes.dialect_insert``, which this module cannot import)."""
    t = m.idempotency_keys
    stmt = postgresql.insert(t) if conn.dialect.name == "postgresql" else sqlite.insert(t)
    return stmt.on_conflict_do_nothing(index_elements=["key", "scope"]).returning(t.c.key)


@functools.cache
def _row_of(dialect: str) -> sa.Select[Any]:
    t = m.idempotency_keys
    where = (t.c.key == sa.bindparam("k_key"), t.c.scope == sa.bindparam("k_scope"))
    return sa.select(t, holder_alive(dialect).label("holder_alive")).where(*where)


def _key_of(t: sa.Table) -> tuple[sa.ColumnElement[bool], ...]:
    return (t.c.key == sa.bindparam("k_key"), t.c.scope == sa.bindparam("k_scope"))


_T = m.idempotency_keys
_TAKE_OVER = (
    sa.update(_T)
    .where(
        *_key_of(_T),
        _T.c.state == PENDING,
        _T.c.holder_node == sa.bindparam("old_node"),
        _T.c.holder_incarnation == sa.bindparam("old_incarnation"),
    )
    .values(holder_node=sa.bindparam("new_node"), holder_incarnation=sa.bindparam("new_incarnation"))
)
# Whatever the row's state: the effect's commit and the route that ran the command may both complete it (a commit
# still under way when the command returned), always with the same holder. Another holder's row is never touched.
_COMPLETE = (
    sa.update(_T)
    .where(
        *_key_of(_T),
        _T.c.holder_node == sa.bindparam("h_node"),
        _T.c.holder_incarnation == sa.bindparam("h_incarnation"),
    )
    .values(
        state=DONE,
        status_code=sa.bindparam("c_status"),
        response_body=sa.bindparam("c_body", type_=_T.c.response_body.type),
    )
)
_RELEASE = sa.delete(_T).where(
    *_key_of(_T),
    _T.c.state == PENDING,
    _T.c.holder_node == sa.bindparam("h_node"),
    _T.c.holder_incarnation == sa.bindparam("h_incarnation"),
)


def _completion_params(done: Completion) -> dict[str, Any]:
    return {
        "k_key": done.key,
        "k_scope": done.scope,
        "h_node": done.holder_node,
        "h_incarnation": done.holder_incarnation,
        "c_status": done.status_code,
        "c_body": done.body,
    }


def complete_in(conn: Connection, receipts: Iterable[Completion]) -> None:
    """Inside the caller's write transaction (the store writer's batch): complete each reservation, or raise
    ``ReceiptRefused`` (rolling the transaction back) when its holder no longer holds it."""
    for done in receipts:
        if conn.execute(_COMPLETE, _completion_params(done)).rowcount != 1:
            raise ReceiptRefused(done.key)


async def complete_async(conn: AsyncConnection, done: Completion) -> bool:
    """``complete_in`` on an async connection, for one completion; False when its holder no longer holds it."""
    return bool((await conn.execute(_COMPLETE, _completion_params(done))).rowcount == 1)


class IdempotencyKeys:
    """The SQL of ``idempotency_keys`` (each method its own transaction)."""

    def __init__(self, engine: AsyncEngine, read: ReadRecord) -> None:
        self.engine = engine
        self._read = read

    @whole
    async def reserve(self, key: str, scope: str, request_hash: str, holder: Holder) -> Claim:
        """Reserve ``(key, scope)`` for ``holder``: held when no row existed, or when the row is a reservation of a
        dead holder (or of ``holder`` itself: the caller knows no request of its own still runs it) that this call
        took over; else the row as it is (``Claim.record``; None when it cannot be read)."""
        pending = IdempotencyRecord(
            key=key,
            scope=scope,
            request_hash=request_hash,
            status_code=0,
            state=IdempotencyState.PENDING,
            holder_node=holder.node,
            holder_incarnation=holder.incarnation,
        )
        async with self.engine.begin() as conn:
            insert = _insert_once(conn)
            for _ in range(RESERVE_ATTEMPTS):
                if (await conn.execute(insert, [idempotency_row(pending)])).first() is not None:
                    return Claim(held=True)
                claim = await self._look(conn, key, scope, request_hash, holder)
                if claim is not None:
                    return claim
        # the row kept changing under this request (taken and released by others): it waits and looks again
        return Claim(held=False, record=pending.model_copy(update={"holder_node": None}))

    async def _look(
        self, conn: AsyncConnection, key: str, scope: str, request_hash: str, holder: Holder
    ) -> Claim | None:
        """The claim for the row found (None: it changed meanwhile, look again)."""
        row = (await conn.execute(_row_of(conn.dialect.name), {"k_key": key, "k_scope": scope})).mappings().first()
        if row is None:
            return None  # released since the insert found it
        found = self._read(row)
        if found is None or found.state is IdempotencyState.DONE or found.request_hash != request_hash:
            return Claim(held=False, record=found)
        if row["holder_alive"] and not found.held_by(holder):
            return Claim(held=False, record=found)
        old = Holder(found.holder_node or "", found.holder_incarnation or "")
        params = {
            "k_key": key,
            "k_scope": scope,
            "old_node": found.holder_node,
            "old_incarnation": found.holder_incarnation,
            "new_node": holder.node,
            "new_incarnation": holder.incarnation,
        }
        if (await conn.execute(_TAKE_OVER, params)).rowcount == 1:
            return Claim(held=True, taken_from=None if found.held_by(holder) else old)
        return None

    async def find(self, key: str, scope: str) -> IdempotencyRecord | None:
        """The record of ``(key, scope)`` as it is (None: there is none, or it cannot be read)."""
        async with self.engine.connect() as conn:
            query = _row_of(conn.dialect.name)
            row = (await conn.execute(query, {"k_key": key, "k_scope": scope})).mappings().first()
        return None if row is None else self._read(row)

    @whole
    async def complete(self, done: Completion) -> bool:
        """Complete a reservation in a transaction of its own (an answer with no durable effect to ride on); False
        when ``done``'s holder no longer holds it."""
        async with self.engine.begin() as conn:
            return await complete_async(conn, done)

    @whole
    async def release(self, key: str, scope: str, holder: Holder) -> bool:
        """Delete ``holder``'s reservation of ``(key, scope)`` (its command had no effect: a retry runs it again);
        False when it holds none (it was completed, or taken over)."""
        params = {"k_key": key, "k_scope": scope, "h_node": holder.node, "h_incarnation": holder.incarnation}
        async with self.engine.begin() as conn:
            return bool((await conn.execute(_RELEASE, params)).rowcount)

    @whole
    async def put(self, rec: IdempotencyRecord) -> bool:
        """Insert ``rec`` as it is; False (and nothing written) if ``(key, scope)`` is already taken."""
        async with self.engine.begin() as conn:
            inserted = (await conn.execute(_insert_once(conn), [idempotency_row(rec)])).first()
        return inserted is not None

    @whole
    async def purge(self, older_than: datetime) -> int:
        """Forget the records created before ``older_than``, and the reservations of dead holders made before it
        (a live holder's command may still be running); returns how many."""
        t = m.idempotency_keys
        async with self.engine.begin() as conn:
            forgettable = sa.or_(t.c.state == DONE, sa.not_(holder_alive(conn.dialect.name)))
            result = await conn.execute(sa.delete(t).where(t.c.created_at < older_than, forgettable))
        return int(result.rowcount)


__all__ = ["IdempotencyKeys", "complete_async", "complete_in", "database_now", "holder_alive"]
