"""Scheduled commands and coaching notes in the store (SQLite and PostgreSQL): written whole, updated in place, their
applied mark landing in the transaction of the effect that carries it, read back for recovery (the pending ones) and
for the API (all of them), and deleted with their session."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.events import Event
from switchboard.runtime.pending import AppliedReceipt, PendingCommand
from switchboard.runtime.ports import Commit
from switchboard.runtime.receipt import completions
from switchboard.store import SessionRecord, Store

T0 = datetime(2026, 11, 28, 6, 0, 0, tzinfo=UTC)


def command(cid: str, seconds: float, **kw: object) -> PendingCommand:
    defaults: dict[str, object] = {"kind": "say", "at": "idle", "args": {"text": f"said {cid}"}}
    return PendingCommand(id=cid, created_at=T0 + timedelta(seconds=seconds), **{**defaults, **kw})


async def test_pending_commands_round_trip_and_recovery_reads_the_pending_ones(store: Store) -> None:
    chat = store.chat_store()
    first = command("sched_1", 1)
    note = command("coach_1", 2, kind="coach", at="next_turn", args={"note": "be brief"})
    tool = command("sched_2", 3, kind="input", at="after_tool", call_id="c1", args={"text": "hi", "force": True})
    await chat.commit("s1", Commit(pending=[first, note, tool]))
    assert await store.pending_commands("s1") == [first, note, tool]
    cancelled = first.model_copy(update={"state": "cancelled", "reason": "cancelled_by_operator", "ended_at": T0})
    await chat.commit("s1", Commit(pending=[cancelled]))
    assert await store.pending_commands("s1") == [cancelled, note, tool]
    loaded = await store.load_sessions_bulk(["s1"])
    assert loaded["s1"].pending == [note, tool]


async def test_the_applied_mark_lands_with_the_effect_that_carries_it(store: Store) -> None:
    chat = store.chat_store()
    pending = command("sched_1", 1, kind="input", args={"text": "later"})
    await chat.commit("s1", Commit(pending=[pending]))
    receipt = AppliedReceipt(pending, lambda item_id: {"item_id": item_id}, lambda: T0)
    item = ChatMessage(id="item_1", role="user", text="later", created_at=T0)
    await chat.commit("s1", Commit(items=[item], receipts=completions("item_1", receipt)))
    [stored] = await store.pending_commands("s1")
    assert stored.state == "applied" and stored.result == {"item_id": "item_1"}
    assert [it.id for it in await store.chat_items("s1")] == ["item_1"]
    assert (await store.load_sessions_bulk(["s1"]))["s1"].pending == []


async def test_the_accepting_event_is_what_recovery_checks(store: Store) -> None:
    chat = store.chat_store()
    await chat.commit("s1", Commit(pending=[command("sched_1", 1), command("sched_2", 2)]))
    event = Event(seq=1, session_id="s1", type="scheduled.created", data={"id": "sched_1", "kind": "say", "at": "idle"})
    await store.event_sink().publish(event)
    reported = (await store.load_sessions_bulk(["s1"]))["s1"].reported
    assert reported.pending == {"sched_1"}


async def test_they_go_with_their_session(store: Store) -> None:
    await store.create_session(SessionRecord(id="s2", agent="demo", state="closed"))
    await store.chat_store().commit("s2", Commit(pending=[command("sched_1", 1)]))
    purged = await store.purge_ended_sessions(datetime.now(UTC) + timedelta(days=1))
    assert purged == ["s2"]
    assert await store.pending_commands("s2") == []
