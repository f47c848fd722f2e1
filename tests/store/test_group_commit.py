"""Group commit: batches are atomic per commit, ordered, isolated on failure, and events are durable first."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import UTC, datetime

import pytest
from sqlalchemy import exc as sa_exc

from switchboard.runtime import event_types as ev
from switchboard.runtime.chat import ChatMessage, FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.events import Event, EventLog
from switchboard.runtime.ports import Commit
from switchboard.runtime.tools import ProgressUpdate, ToolCallInfo, ToolStatus
from switchboard.store import SessionRecord, Store, StoreClosed
from tests.waiting import WAIT_S

from .conftest import Db


def msg(item_id: str) -> ChatMessage:
    return ChatMessage(id=item_id, role="user", text=item_id)


async def positions(db: Db, sid: str) -> list[tuple[int, str]]:
    rows = await db.sql(db.q("SELECT pos, item_id FROM chat_items WHERE session_id = ? ORDER BY pos"), sid)
    return [(int(pos), item_id) for pos, item_id in rows]


async def test_a_bad_commit_in_a_batch_fails_alone_and_atomically(
    db: Db, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    chat = store.chat_store()
    sink = store.event_sink()
    await chat.commit("s1", Commit(items=[msg("m0")]))
    # NOT NULL violation on tool_calls.name: it fails after the commit's chat item was already inserted.
    broken = ToolCallInfo.model_construct(
        **{**ToolCallInfo(call_id="c", name="x", started_at=datetime.now(UTC)).__dict__, "name": None}
    )
    batches_before = store.writer.batches
    # Queued together, before the writer runs: one batch.
    results = await asyncio.gather(
        chat.commit("s1", Commit(items=[msg("a1"), msg("a2")])),
        chat.commit("s1", Commit(items=[msg("bad")], tool_calls=[broken])),
        chat.commit("nope", Commit(items=[msg("orphan")])),  # no such session: foreign key violation
        chat.commit("s1", Commit(items=[msg("b1")])),
        sink.publish(Event(seq=1, session_id="s1", type="session.started")),
        return_exceptions=True,
    )
    assert results[0] is None and results[3] is None and results[4] is None
    assert isinstance(results[1], sa_exc.IntegrityError)
    assert isinstance(results[2], sa_exc.IntegrityError)
    assert "one by one" in caplog.text
    assert store.writer.batches - batches_before == 3  # each good operation alone after the batch failed
    assert store.writer.failed_ops == 2
    # nothing of the bad commits landed, and positions stay contiguous
    assert await positions(db, "s1") == [(0, "m0"), (1, "a1"), (2, "a2"), (3, "b1")]
    assert await store.chat_items("nope") == []
    assert await store.tool_calls("s1") == []
    assert [e.seq for e in await store.events("s1")] == [1]
    await chat.commit("s1", Commit(items=[msg("after")]))
    assert (await positions(db, "s1"))[-1] == (4, "after")


async def test_concurrent_writers_keep_positions_contiguous_and_seq_gap_free(db: Db, store: Store) -> None:
    chat = store.chat_store()
    durable: list[Event] = []
    log = EventLog("s1", store.event_sink(durable.extend))
    rng = random.Random(7)
    n_calls = 60

    async def tool(i: int) -> None:
        call_id = f"c{i}"
        item = FunctionCall(id=f"fc{i}", call_id=call_id, name="work", arguments={"i": i})
        info = ToolCallInfo(call_id=call_id, name="work", arguments={"i": i}, started_at=item.created_at)
        await chat.commit("s1", Commit(tool_calls=[info]))
        log.emit(ev.ToolStarted(call_id=call_id, name="work", arguments={"i": i}, cancellable=False, speech_id=None))
        await asyncio.sleep(rng.random() * 0.02)
        info = info.model_copy(
            update={
                "background": True,
                "progress": [ProgressUpdate(message="half", progress=0.5, at=datetime.now(UTC))],
            }
        )
        await chat.commit("s1", Commit(tool_calls=[info]))
        log.emit(ev.ToolProgress(call_id=call_id, message="half", progress=0.5))
        await asyncio.sleep(rng.random() * 0.02)
        out = FunctionCallOutput(id=f"out{i}", call_id=call_id, name="work", output=f"r{i}")
        info = info.model_copy(
            update={"status": ToolStatus.COMPLETED, "output": out.output, "ended_at": out.created_at}
        )
        await chat.commit("s1", Commit(items=[item, out], tool_calls=[info]))
        await log.emit(
            ev.ToolEnded(call_id=call_id, name="work", status=ToolStatus.COMPLETED, output=out.output, is_error=False)
        )

    async def chatter() -> None:
        for j in range(40):
            item = msg(f"u{j}")
            await chat.commit("s1", Commit(items=[item]))
            log.emit(ev.ChatItemAdded(item=item))
            await asyncio.sleep(0)

    await asyncio.gather(*(tool(i) for i in range(n_calls)), chatter())
    await wait_durable(store)

    pos = [p for p, _ in await positions(db, "s1")]
    assert pos == list(range(2 * n_calls + 40))
    events = await store.events("s1", limit=10_000)
    assert [e.seq for e in events] == list(range(1, 3 * n_calls + 40 + 1))
    assert [e.seq for e in durable] == [e.seq for e in events]  # on_durable saw every event, in seq order
    calls = await store.tool_calls("s1")
    assert len(calls) == n_calls
    assert all(c.status is ToolStatus.COMPLETED and len(c.progress) == 1 and c.background for c in calls)
    items = await store.chat_items("s1")
    assert validate(items) == []
    assert store.writer.batches < store.writer.ops_written  # operations really were grouped


async def wait_durable(store: Store) -> None:
    """Wait until the writer has nothing queued (``publish`` results that nobody awaited)."""
    sink = store.event_sink()
    marker = Event(seq=1, session_id="__marker__", type="x")
    await store.create_session(SessionRecord(id="__marker__", agent="x"))
    await sink.publish(marker)


async def test_publish_order_and_on_durable_after_commit(db: Db, store: Store) -> None:
    await store.create_session(SessionRecord(id="s2", agent="demo"))
    seen: list[tuple[str, int]] = []
    rows_when_called: list[int] = []

    def on_durable(events: list[Event]) -> None:
        # Read on a connection of our own: only committed rows are visible there.
        keys = [(e.session_id, e.seq) for e in events]
        found = 0
        for sid, seq in keys:
            found += len(db.sql_sync(db.q("SELECT 1 FROM events WHERE session_id = ? AND seq = ?"), sid, seq))
        rows_when_called.append(found - len(keys))
        seen.extend(keys)

    sink = store.event_sink(on_durable)
    published: list[tuple[str, int]] = []
    futures = []
    for seq in range(1, 31):
        for sid in ("s1", "s2"):
            futures.append(sink.publish(Event(seq=seq, session_id=sid, type="tool.progress", data={"seq": seq})))
            published.append((sid, seq))
        if seq % 7 == 0:
            await asyncio.sleep(0)  # let some batches go between publishes

    await asyncio.gather(*futures)
    assert seen == published  # in publish order (so each session's in seq order)
    assert rows_when_called and all(missing == 0 for missing in rows_when_called)
    assert len(rows_when_called) > 1  # several batches


async def test_aclose_flushes_queued_writes_and_then_refuses_more(db: Db) -> None:
    store = db.store()
    await store.migrate()
    await store.start()
    await store.create_session(SessionRecord(id="s1", agent="demo"))
    sink = store.event_sink()
    futures = [sink.publish(Event(seq=i, session_id="s1", type="agent.state")) for i in range(1, 501)]
    pending = asyncio.ensure_future(store.chat_store().commit("s1", Commit(items=[msg("last")])))
    await asyncio.sleep(0)
    await store.aclose()
    assert all(f.done() and f.exception() is None for f in futures)  # type: ignore[attr-defined]
    await pending
    with pytest.raises(StoreClosed):
        sink.publish(Event(seq=501, session_id="s1", type="agent.state"))
    with pytest.raises(StoreClosed):
        await store.chat_store().commit("s1", Commit(items=[msg("late")]))
    await store.aclose()  # idempotent

    reopened = db.store()
    assert await reopened.last_seq("s1") == 500
    assert [it.id for it in await reopened.chat_items("s1")] == ["last"]


async def test_a_failing_on_durable_callback_does_not_stop_the_writer(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(_events: list[Event]) -> None:
        raise RuntimeError("subscriber bug")

    with caplog.at_level(logging.ERROR, logger="switchboard.store"):
        await store.event_sink(explode).publish(Event(seq=1, session_id="s1", type="x"))
    await store.event_sink().publish(Event(seq=2, session_id="s1", type="x"))
    assert [e.seq for e in await store.events("s1")] == [1, 2]
    assert "on_durable callback failed" in caplog.text


async def test_writes_to_an_unmigrated_database_fail_instead_of_hanging(db: Db) -> None:
    store = db.store()
    await store.start()
    with pytest.raises(sa_exc.DBAPIError):
        await asyncio.wait_for(store.chat_store().commit("s1", Commit(items=[msg("m")])), timeout=WAIT_S)
    assert store.writer.retries == 0
