"""Idempotency reservations in the store: one holder per key across processes, the completion committed with the
effect (or not at all), a dead holder's reservation taken over, and purging that spares live holders."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.ports import Commit, Completion
from switchboard.store import (
    Holder,
    IdempotencyState,
    NodeMode,
    NodeRecord,
    NodeState,
    ReceiptRefused,
    SessionExists,
    SessionRecord,
    Store,
)
from switchboard.store.records import now_utc

from .conftest import Db

SCOPE = "caller POST /v1/sessions/s1/input"
A = Holder("node-a", "a-1")
B = Holder("node-b", "b-1")


async def register(store: Store, holder: Holder, *, lease_s: float = 60.0) -> None:
    now = now_utc()
    me = NodeRecord(
        id=holder.node,
        url=f"http://{holder.node}",
        state=NodeState.LIVE,
        mode=NodeMode.CLUSTER,
        hostname="elsewhere",
        pid=1,
        started_at=now,
        heartbeat_at=now,
        lease_until=now + timedelta(seconds=lease_s),
        incarnation=holder.incarnation,
    )
    assert await store.nodes.register(me, conflicts=lambda _: False) == []


def done(holder: Holder, key: str = "k1", body: Any = None) -> Completion:
    return Completion(
        key=key,
        scope=SCOPE,
        holder_node=holder.node,
        holder_incarnation=holder.incarnation,
        status_code=202,
        body=body if body is not None else {"item_id": "i1"},
    )


async def user_items(db: Db) -> list[str]:
    rows = await db.sql(db.q("SELECT item_id FROM chat_items WHERE session_id = ? ORDER BY pos"), "s1")
    return [r[0] for r in rows]


async def test_one_holder_per_key_and_the_answer_lands_with_the_effect(store: Store, db: Db) -> None:
    await register(store, A)
    await register(store, B)
    assert (await store.idempotency.reserve("k1", SCOPE, "h", A)).held
    # another live process with the same key waits; the same key in another scope is another reservation
    other = await store.idempotency.reserve("k1", SCOPE, "h", B)
    assert not other.held and other.record is not None and other.record.state is IdempotencyState.PENDING
    assert other.record.held_by(A)
    assert (await store.idempotency.reserve("k1", SCOPE + "x", "h", B)).held
    # another body under the key: the caller learns it (409), whoever holds it
    assert (await store.idempotency.reserve("k1", SCOPE, "other", B)).record.request_hash == "h"  # type: ignore[union-attr]

    receipt = done(A)
    await store.chat_store().commit(
        "s1", Commit(items=[ChatMessage(id="i1", role="user", text="hi")], receipts=[receipt])
    )
    assert receipt.landed
    assert await user_items(db) == ["i1"]
    found = await store.idempotency.reserve("k1", SCOPE, "h", B)
    assert not found.held and found.record is not None
    assert (found.record.state, found.record.status_code, found.record.response_body) == (
        IdempotencyState.DONE,
        202,
        {"item_id": "i1"},
    )


async def test_a_commit_whose_reservation_was_taken_over_writes_nothing(store: Store, db: Db) -> None:
    """The holder was presumed dead and another request took the key over: its late effect must not land (the new
    holder applies the command), while the other writes of the same batch do."""
    await register(store, A, lease_s=-1)  # A's lease is over
    await register(store, B)
    assert (await store.idempotency.reserve("k1", SCOPE, "h", A)).held
    took = await store.idempotency.reserve("k1", SCOPE, "h", B)
    assert took.held and took.taken_from == A

    chat = store.chat_store()
    late = Commit(items=[ChatMessage(id="late", role="user", text="late")], receipts=[done(A)])
    fine = Commit(items=[ChatMessage(id="fine", role="user", text="fine")])
    store.writer.batch_max = 10
    results: list[Any] = []
    for commit in (late, fine):  # queued together: one batch, retried one by one
        try:
            await chat.commit("s1", commit)
            results.append("ok")
        except ReceiptRefused as err:
            results.append(err)
    assert isinstance(results[0], ReceiptRefused) and results[1] == "ok"
    assert await user_items(db) == ["fine"]
    assert not late.receipts[0].landed
    # B's own effect lands with its answer
    await chat.commit("s1", Commit(items=[ChatMessage(id="mine", role="user", text="x")], receipts=[done(B)]))
    record = await store.idempotency_get("k1", SCOPE)
    assert record is not None and record.state is IdempotencyState.DONE and record.held_by(B)


async def test_a_dead_holder_is_taken_over_and_a_live_one_is_waited_for(store: Store, db: Db) -> None:
    await register(store, A)
    await register(store, B)
    for key in ("gone", "restarted", "expired", "live"):
        assert (await store.idempotency.reserve(key, SCOPE, "h", A)).held
    await db.sql(db.q("UPDATE idempotency_keys SET holder_node = ? WHERE key = ?"), "node-gone", "gone")
    await db.sql(db.q("UPDATE idempotency_keys SET holder_incarnation = ? WHERE key = ?"), "a-0", "restarted")
    await db.sql(db.q("UPDATE nodes SET lease_until = ? WHERE id = ?"), now_utc() - timedelta(seconds=1), "node-a")
    # A's lease is over: every reservation of A is taken over, as is one whose node is gone or restarted
    for key in ("gone", "restarted", "expired"):
        claim = await store.idempotency.reserve(key, SCOPE, "h", B)
        assert claim.held and claim.taken_from is not None, key
    # A renews its lease before anyone buried it: alive again, its reservation is waited for
    await db.sql(db.q("UPDATE nodes SET lease_until = ? WHERE id = ?"), now_utc() + timedelta(seconds=60), "node-a")
    claim = await store.idempotency.reserve("live", SCOPE, "h", B)
    assert not claim.held
    # a request of the holder's own process finds its reservation free (no request of that process still runs it)
    claim = await store.idempotency.reserve("live", SCOPE, "h", A)
    assert claim.held and claim.taken_from is None


async def test_release_frees_only_a_pending_reservation_of_its_holder(store: Store) -> None:
    await register(store, A)
    await register(store, B)
    assert (await store.idempotency.reserve("k1", SCOPE, "h", A)).held
    assert not await store.idempotency.release("k1", SCOPE, B)
    assert await store.idempotency.release("k1", SCOPE, A)
    assert (await store.idempotency.reserve("k1", SCOPE, "h", B)).held
    assert await store.idempotency.complete(done(B))
    assert not await store.idempotency.release("k1", SCOPE, B)  # done: a record, never released
    assert not await store.idempotency.complete(done(A))  # another holder's row is never touched
    record = await store.idempotency_get("k1", SCOPE)
    assert record is not None and record.state is IdempotencyState.DONE and record.held_by(B)


async def test_a_create_and_its_answer_are_one_transaction(store: Store) -> None:
    await register(store, A)
    await register(store, B)
    assert (await store.idempotency.reserve("k1", SCOPE, "h", A)).held
    receipt = done(A, body={"id": "new"})
    await store.create_session(SessionRecord(id="new", agent="demo"), receipt=receipt)
    assert receipt.landed
    record = await store.idempotency_get("k1", SCOPE)
    assert record is not None and record.state is IdempotencyState.DONE and record.response_body == {"id": "new"}
    # a receipt no longer held: the session is not inserted
    assert (await store.idempotency.reserve("k2", SCOPE, "h", B)).held
    try:
        await store.create_session(SessionRecord(id="newer", agent="demo"), receipt=done(A, key="k2"))
    except ReceiptRefused:
        pass
    else:
        raise AssertionError("a create whose reservation another holder holds was inserted")
    assert await store.get_session("newer") is None
    # an id that exists: no answer is written either
    try:
        await store.create_session(SessionRecord(id="new", agent="demo"), receipt=done(B, key="k2"))
    except SessionExists:
        pass
    record = await store.idempotency_get("k2", SCOPE)
    assert record is not None and record.state is IdempotencyState.PENDING


def writes_an_answer(statement: str, context: Any) -> bool:
    """A statement that records a command's answer: the completion of its reservation (an UPDATE that sets the body),
    or an INSERT of a record with its body (how an answer was recorded before reservations)."""
    sql = " ".join(statement.split()).upper()
    if "IDEMPOTENCY_KEYS" not in sql:
        return False
    if sql.startswith("UPDATE") and "RESPONSE_BODY" in sql:
        return True
    rows = getattr(context, "compiled_parameters", None) or []
    return sql.startswith("INSERT") and any(row.get("response_body") is not None for row in rows)


@contextmanager
def answers_fail(times: int = 1) -> Iterator[list[str]]:
    """On every engine of this process, the first ``times`` statements that record an answer fail as a connection
    reset does (a transient error)."""
    failed: list[str] = []
    lock = threading.Lock()  # the SQLite writer runs on a thread of its own

    def before(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        if writes_an_answer(statement, context):
            with lock:
                if len(failed) < times:
                    failed.append(statement)
                    raise ConnectionResetError(104, "Connection reset by peer")

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", before)
    try:
        yield failed
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", before)


async def test_a_reset_on_the_answer_retries_the_whole_batch_so_effect_and_answer_land_together(
    store: Store, db: Db
) -> None:
    await register(store, A)
    assert (await store.idempotency.reserve("k1", SCOPE, "h", A)).held
    receipt = done(A)
    with answers_fail() as failed:
        await store.chat_store().commit(
            "s1", Commit(items=[ChatMessage(id="i1", role="user", text="hi")], receipts=[receipt])
        )
    assert failed, "the answer's statement was never written"
    assert store.writer.retries >= 1 and receipt.landed
    assert await user_items(db) == ["i1"]
    record = await store.idempotency_get("k1", SCOPE)
    assert record is not None and record.state is IdempotencyState.DONE


async def test_purge_forgets_old_records_and_dead_holders_reservations_only(store: Store, db: Db) -> None:
    await register(store, A)
    await register(store, B)
    assert (await store.idempotency.reserve("old-done", SCOPE, "h", A)).held
    assert await store.idempotency.complete(done(A, key="old-done"))
    for key in ("old-live", "old-dead", "new-dead"):
        assert (await store.idempotency.reserve(key, SCOPE, "h", A if key == "old-live" else B)).held
    old = now_utc() - timedelta(days=2)
    for key in ("old-done", "old-live", "old-dead"):
        await db.sql(db.q("UPDATE idempotency_keys SET created_at = ? WHERE key = ?"), old, key)
    await db.sql(db.q("UPDATE nodes SET lease_until = ? WHERE id = ?"), now_utc() - timedelta(seconds=1), "node-b")
    assert await store.idempotency_purge(now_utc() - timedelta(days=1)) == 2
    left = sorted(r[0] for r in await db.sql("SELECT key FROM idempotency_keys"))
    assert left == ["new-dead", "old-live"]
