"""A caller cancelled while a store transaction runs (a node stopping its alert workers, a client hanging up) does not
cut the transaction in half: it runs to its end, and leaves no lock behind.

Cut off mid-statement, the connection was thrown away without a rollback; on SQLite, a statement with rows left to
read (a SELECT, a RETURNING) was kept by the traceback of the cancellation, and so was the write lock: the next node's
write waited out its busy timeout and failed (``database is locked``). Each case cancels its caller at each statement
of the transaction in turn, keeps the cancellation (as a cancelled task does), and checks that the transaction ended
as a whole and that another writer gets the database at once."""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event

from switchboard.store import Store
from switchboard.store.alerts import OPENED, AlertRecord, Delivery, DeliveryState
from switchboard.store.records import Holder

from .conftest import Db

MAX_STATEMENTS = 8  # more than any of these transactions runs
LOCK_WAIT_S = 1.0  # nothing else writes: the lock is free at once, or held until the test ends


def alert(alert_id: str = "alrt-1", reason: str = "generation_failed") -> AlertRecord:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    return AlertRecord(
        id=alert_id,
        session_id="s1",
        reason=reason,
        agent="demo",
        message="something is wrong",
        since=at,
        opened_at=at,
        opened_node="node-a",
        opened_deliveries={"ops": Delivery()},
    )


async def cut_at(store: Store, statement: int, call: Callable[[], Awaitable[Any]]) -> BaseException | None:
    """Run ``call`` in a task, cancel that task as the ``statement``-th statement (or commit) is sent, and return what
    it raised (kept alive, as a cancelled task keeps it); None when the call sent fewer statements."""
    seen = 0
    caller: asyncio.Task[Any] | None = None

    def count(*_args: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == statement and caller is not None:
            caller.cancel()

    sync = store.engine.sync_engine
    event.listen(sync, "before_cursor_execute", count)
    event.listen(sync, "commit", count)
    try:
        caller = asyncio.create_task(call())
        [outcome] = await asyncio.gather(caller, return_exceptions=True)
    finally:
        event.remove(sync, "before_cursor_execute", count)
        event.remove(sync, "commit", count)
    if seen < statement:
        return None
    assert isinstance(outcome, asyncio.CancelledError), outcome
    return outcome


def write_lock_free(db: Db) -> bool:
    """Whether another connection takes the SQLite write lock (on PostgreSQL: the alert rows' locks) at once."""
    if db.kind == "sqlite":
        conn = sqlite3.connect(str(db.path), timeout=LOCK_WAIT_S, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            conn.close()
    try:
        db.sql_sync("SELECT id FROM alerts FOR UPDATE NOWAIT")
    except Exception:
        return False
    return True


async def every_cut(
    db: Db,
    store: Store,
    call: Callable[[int], Awaitable[Any]],
    landed: Callable[[int], Awaitable[bool]],
    prepare: Callable[[int], Awaitable[Any]] | None = None,
) -> None:
    """Cut ``call(n)`` at its n-th statement, for every n, after ``prepare(n)`` (not cut)."""
    problems: list[str] = []
    for statement in range(1, MAX_STATEMENTS + 1):
        if prepare is not None:
            await prepare(statement)
        cancelled = await cut_at(store, statement, functools.partial(call, statement))
        if cancelled is None:
            assert not problems, problems
            return
        if not await asyncio.to_thread(write_lock_free, db):  # every later write would wait for it: stop here
            pytest.fail(f"{[*problems, f'cut at statement {statement}: the lock is held']}")
        if not await landed(statement):
            problems.append(f"cut at statement {statement}: the transaction did not run to its end")
        del cancelled
    pytest.fail(f"the transaction runs more than {MAX_STATEMENTS} statements")


async def test_a_delivery_status_write_runs_to_its_end(db: Db, store: Store) -> None:
    assert await store.alerts.open(alert())

    async def call(n: int) -> None:
        await store.alerts.record("alrt-1", OPENED, {"ops": Delivery(attempts=n, state=DeliveryState.PENDING)})

    async def landed(n: int) -> bool:
        [row] = await store.alerts.listing()
        return row.opened_deliveries["ops"].attempts == n

    await every_cut(db, store, call, landed)


async def test_a_clear_runs_to_its_end(db: Db, store: Store) -> None:
    async def prepare(n: int) -> None:
        assert await store.alerts.open(alert(f"alrt-{n}", reason=f"r{n}"))

    async def call(n: int) -> None:
        await store.alerts.clear(f"alrt-{n}", node="node-a", at=datetime.now(UTC), deliveries={"ops": Delivery()})

    async def landed(n: int) -> bool:
        rows = await store.alerts.listing(include_cleared=True)
        return any(row.id == f"alrt-{n}" and row.cleared_at is not None for row in rows)

    await every_cut(db, store, call, landed, prepare)


async def test_a_take_over_runs_to_its_end(db: Db, store: Store) -> None:
    async def prepare(n: int) -> None:
        assert await store.alerts.open(alert(f"alrt-{n}", reason=f"r{n}"))

    async def call(n: int) -> None:
        await store.alerts.take_over(f"alrt-{n}", OPENED, gone="node-a", node="node-b")

    async def landed(n: int) -> bool:
        rows = await store.alerts.listing()
        return any(row.id == f"alrt-{n}" and row.opened_node == "node-b" for row in rows)

    await every_cut(db, store, call, landed, prepare)


async def test_an_idempotency_reservation_runs_to_its_end(db: Db, store: Store) -> None:
    holder = Holder("node-a", "run-1")

    async def call(n: int) -> None:
        await store.idempotency.reserve(f"key-{n}", "POST /v1/sessions", "hash", holder)

    async def landed(n: int) -> bool:
        return await store.idempotency.find(f"key-{n}", "POST /v1/sessions") is not None

    await every_cut(db, store, call, landed)
