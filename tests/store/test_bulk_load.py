"""Recovery's bulk load (``Store.load_sessions_bulk``) reads its rows raw and builds records without validating them
again (``store.bulk``): what it returns is what the ordinary, validated reads return, for every kind of item, every
status of a tool call and every column a call has, on both databases; rows it cannot vouch for go through the
ordinary read, which skips and reports the bad ones."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from switchboard.runtime import event_types as ev
from switchboard.runtime.chat import AgentHandoff, ChatItem, ChatMessage, FunctionCall, FunctionCallOutput
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit, Reported
from switchboard.runtime.tools import ProgressUpdate, ToolCallInfo, ToolStatus
from switchboard.store import SessionRecord, Store
from switchboard.store.text import ESC

from .conftest import Db

T0 = datetime(2026, 11, 28, 9, 0, 0, 123456, tzinfo=UTC)
# what the store encodes (NUL, a lone surrogate, its escape character) and what JSON escapes
ODD = f'nul\x00 lone\ud800 esc{ESC} quote" backslash\\ tab\t é 😀'
# in chat items, without the lone surrogate: pydantic's JSON parser refuses one, so an item holding one is read the
# ordinary way (``test_exact_text``)
ODD_ITEM = ODD.replace("\ud800", "")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def session_items(sid: str) -> list[ChatItem]:
    return [
        ChatMessage(id=f"{sid}-u", role="user", text="Book it.", created_at=at(0)),
        ChatMessage(id=f"{sid}-a", role="assistant", text=ODD_ITEM, interrupted=True, created_at=at(1)),
        FunctionCall(
            id=f"{sid}-c", call_id="c1", name="book", arguments={"when": ODD_ITEM, "n": [1, 2.5]}, created_at=at(2)
        ),
        ChatMessage(id=f"{sid}-late", role="user", text="and?", created_at=at(2)),  # same time: insertion order
        FunctionCallOutput(id=f"{sid}-o", call_id="c1", name="book", output=ODD_ITEM, is_error=True, created_at=at(3)),
        AgentHandoff(id=f"{sid}-h", from_agent=None, to_agent="billing", created_at=at(4)),
        FunctionCallOutput(id=f"{sid}-orphan", call_id="gone", name="x", output="", created_at=at(5)),
    ]


def session_calls() -> list[ToolCallInfo]:
    """A call of every status, with every optional column set on some and unset on others."""
    calls = []
    for n, status in enumerate(ToolStatus):
        ended = status not in (ToolStatus.RUNNING, ToolStatus.CANCELLING)
        calls.append(
            ToolCallInfo(
                call_id=f"call-{status.value}",
                name="book" if n % 2 else ODD,
                arguments={} if n % 3 == 0 else {"when": ODD, "nested": {"a": [None, True, 1.5]}},
                status=status,
                cancellable=n % 2 == 0,
                scope="session" if n % 2 else "agent",
                background=n % 3 == 1,
                progress=[ProgressUpdate(message=ODD, progress=0.5, at=at(n)), ProgressUpdate(message="more", at=at(n))]
                if n % 2
                else [],
                output=(ODD if n % 2 else "done") if ended else None,
                is_error=status in (ToolStatus.FAILED, ToolStatus.INTERRUPTED),
                error="boom" if status == ToolStatus.FAILED else None,
                speech_id=f"sp{n}" if n % 2 else None,
                agent="concierge" if n % 3 else None,
                speculative=status == ToolStatus.CANCELLED,
                started_at=at(n),
                ended_at=at(n + 1) if ended else None,
            )
        )
    return calls


def session_events(sid: str, items: list[ChatItem], calls: list[ToolCallInfo]) -> list[Event]:
    payloads: list[ev.EventPayload] = [ev.UserInput(item_id=f"{sid}-u", text="Book it.", final=True, role="user")]
    payloads += [ev.ChatItemAdded(item=it) for it in items[:-1]]  # the last item's event was lost (a crash)
    payloads += [
        ev.ToolEnded(call_id=c.call_id, name=c.name, status=c.status, output=c.output or "", is_error=c.is_error)
        for c in calls
        if c.ended
    ]
    payloads += [ev.SpeechCreated(speech_id="sp1", source="reply"), ev.SpeechDone(speech_id="sp1", interrupted=True)]
    payloads += [ev.AgentStateChanged(state="listening")]  # reports nothing
    return [Event(seq=n, session_id=sid, type=p.type, at=at(n), data=p.data()) for n, p in enumerate(payloads, 1)]


async def fill(store: Store, sid: str) -> tuple[list[ChatItem], list[ToolCallInfo], list[Event]]:
    items, calls = session_items(sid), session_calls()
    if await store.get_session(sid) is None:
        await store.create_session(SessionRecord(id=sid, agent="concierge"))
    await store.chat_store().commit(sid, Commit(items=items, tool_calls=calls))
    events = session_events(sid, items, calls)
    sink = store.event_sink()
    for event in events:
        done = sink.publish(event)
    await done
    return items, calls, events


def not_called(*args: object) -> None:
    raise AssertionError("the ordinary read was used")


def same_records(got: list[ToolCallInfo], expected: list[ToolCallInfo]) -> None:
    """Equal, and alike in what equality does not look at: the types of the values and the fields set."""
    assert got == expected
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.model_fields_set == theirs.model_fields_set
        assert mine.model_dump(mode="json") == theirs.model_dump(mode="json")
        assert {k: type(v) for k, v in vars(mine).items()} == {k: type(v) for k, v in vars(theirs).items()}
        assert mine.started_at.tzinfo is UTC and (mine.ended_at is None or mine.ended_at.tzinfo is UTC)


async def test_the_bulk_load_reads_what_the_ordinary_reads_read(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    written = {sid: await fill(store, sid) for sid in ("s1", "s2")}

    with monkeypatch.context() as patch:  # what the store wrote is read by the fast path alone
        for ordinary in ("tool_call_from_row", "items_from_texts", "item_from_row"):
            patch.setattr(f"switchboard.store.store.{ordinary}", not_called)
        loaded = await store.load_sessions_bulk(["s1", "s2", "none"])

    for sid, (items, calls, events) in written.items():
        data = loaded[sid]
        assert data.items == await store.chat_items(sid)
        assert [it.id for it in data.items] == [it.id for it in await store.chat_items(sid)]
        assert sorted(data.items, key=lambda it: it.id) == sorted(items, key=lambda it: it.id)
        same_records(data.tool_calls, await store.tool_calls(sid))
        assert sorted(data.tool_calls, key=lambda c: c.call_id) == sorted(calls, key=lambda c: c.call_id)
        assert data.reported == Reported.of(events)
        assert f"{sid}-orphan" not in data.reported.items and f"{sid}-h" in data.reported.items
        assert data.last_seq == len(events)
    assert loaded["none"].items == [] and loaded["none"].tool_calls == [] and loaded["none"].last_seq == 0
    assert store.read_errors == 0


async def test_rows_the_bulk_load_cannot_vouch_for_are_read_the_ordinary_way(db: Db, store: Store) -> None:
    for sid in ("s1", "s2"):
        await fill(store, sid)
    good_items, good_calls = await store.chat_items("s2"), await store.tool_calls("s2")
    cast = "" if db.kind == "sqlite" else "::jsonb"
    await db.sql(
        db.q(f"UPDATE chat_items SET data = ?{cast} WHERE session_id = 's1' AND item_id = 's1-a'"),
        '{"type": "bogus", "id": "s1-a"}',
    )
    await db.sql(
        db.q(f"UPDATE tool_calls SET progress = ?{cast} WHERE session_id = 's1' AND call_id = 'call-failed'"),
        '[{"message": 3}]',
    )
    await db.sql(db.q("UPDATE tool_calls SET status = 'lost' WHERE session_id = 's1' AND call_id = 'call-completed'"))

    loaded = await store.load_sessions_bulk(["s1", "s2"])

    assert "s1-a" not in [it.id for it in loaded["s1"].items]
    assert [it.id for it in loaded["s1"].items] == [it.id for it in await store.chat_items("s1")]
    assert {c.call_id for c in loaded["s1"].tool_calls} == {c.call_id for c in session_calls()} - {
        "call-failed",
        "call-completed",
    }
    assert loaded["s2"].items == good_items  # the other session of the chunk reads as before
    same_records(loaded["s2"].tool_calls, good_calls)
    reported = {(e.table, e.session_id, e.key) for e in store.read_error_log}
    assert ("chat_items", "s1", "1") in reported
    assert {("tool_calls", "s1", "call-failed"), ("tool_calls", "s1", "call-completed")} <= reported


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
async def test_a_json_text_that_is_not_json_is_read_the_ordinary_way(db: Db, store: Store) -> None:
    await fill(store, "s1")
    await db.sql("UPDATE tool_calls SET arguments = '1, 2' WHERE call_id = 'call-running'")  # two values in one
    await db.sql("UPDATE tool_calls SET arguments = '' WHERE call_id = 'call-rejected'")

    loaded = await store.load_sessions_bulk(["s1"])

    assert {c.call_id for c in loaded["s1"].tool_calls} == {c.call_id for c in session_calls()} - {
        "call-running",
        "call-rejected",
    }
    assert {e.key for e in store.read_error_log if e.table == "tool_calls"} == {"call-running", "call-rejected"}


async def test_a_session_whose_id_holds_what_the_store_encodes_is_read_whole(store: Store) -> None:
    sid = f"odd\x00{ESC}id"
    items, calls, events = await fill(store, sid)

    loaded = (await store.load_sessions_bulk([sid]))[sid]

    assert loaded.items == await store.chat_items(sid) and len(loaded.items) == len(items)
    same_records(loaded.tool_calls, await store.tool_calls(sid))
    assert len(loaded.tool_calls) == len(calls)
    assert loaded.reported == Reported.of(events)
