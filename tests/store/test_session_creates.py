"""Session creates go through the group-commit writer: creates queued together share a transaction, and one of an
id that is taken fails alone, writing nothing, while the others land."""

from __future__ import annotations

import asyncio

from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.ports import Commit
from switchboard.store import SessionExists, SessionRecord, Store


def rec(sid: str, **kw: object) -> SessionRecord:
    return SessionRecord(id=sid, agent="demo", state="active", **kw)  # type: ignore[arg-type]


async def test_creates_queued_together_share_one_transaction(store: Store) -> None:
    batches = store.writer.batches
    await asyncio.gather(*(store.create_session(rec(f"n{i}")) for i in range(20)))
    assert store.writer.batches - batches == 1
    for i in range(20):
        assert (await store.get_session(f"n{i}")) is not None


async def test_a_create_of_a_taken_id_fails_alone_and_writes_nothing(store: Store) -> None:
    """``s1`` is stored already (the fixture); ``twice`` is created twice in the same batch. Each bad create fails
    with ``SessionExists``, nothing of it is written, and the batch's other writes land."""
    failed_before = store.writer.failed_ops
    chat = store.chat_store()
    results = await asyncio.gather(
        store.create_session(rec("a")),
        store.create_session(rec("s1", metadata={"would": "overwrite"})),
        store.create_session(rec("twice", metadata={"first": True})),
        store.create_session(rec("twice", metadata={"second": True})),
        chat.commit("s1", Commit(items=[ChatMessage(id="m1", role="user", text="hi")])),
        store.create_session(rec("b")),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None and results[4] is None and results[5] is None
    assert isinstance(results[1], SessionExists) and isinstance(results[3], SessionExists)
    s1, twice = await store.get_session("s1"), await store.get_session("twice")
    assert s1 is not None and s1.metadata == {}
    assert twice is not None and twice.metadata == {"first": True}
    assert await store.get_session("a") is not None and await store.get_session("b") is not None
    assert [it.id for it in await store.chat_items("s1")] == ["m1"]
    assert store.writer.failed_ops == failed_before  # refused in the batch, not a failed write


async def test_a_create_with_a_store_not_started_is_written_at_once(store: Store) -> None:
    idle = Store(store.engine)  # its writer never runs: the create is a transaction of its own
    await idle.create_session(rec("alone"))
    assert await store.get_session("alone") is not None
    try:
        await idle.create_session(rec("alone"))
    except SessionExists:
        pass
    else:
        raise AssertionError("a second create of the same id must fail")
