"""Everything the runtime commits comes back as it went in, and the chat view follows the ordering rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from switchboard.runtime.chat import (
    AgentHandoff,
    ChatItem,
    ChatMessage,
    FunctionCall,
    FunctionCallOutput,
    validate,
)
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit, SessionState
from switchboard.runtime.speech import SpeechInfo, SpeechState
from switchboard.runtime.tools import ProgressUpdate, ToolCallInfo, ToolStatus
from switchboard.store import InvalidCursor, SessionExists, SessionRecord, Store, make_engine

T0 = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def call(call_id: str, seconds: float, **kw: object) -> FunctionCall:
    return FunctionCall(id=f"fc_{call_id}", call_id=call_id, name="lookup", created_at=at(seconds), **kw)


def output(call_id: str, seconds: float, text: str = "done") -> FunctionCallOutput:
    return FunctionCallOutput(id=f"out_{call_id}", call_id=call_id, name="lookup", output=text, created_at=at(seconds))


async def test_every_chat_item_type_round_trips(store: Store) -> None:
    items = [
        ChatMessage(id="m1", role="system", text="be nice", created_at=at(0)),
        ChatMessage(id="m2", role="user", text="héllo 👋", created_at=at(1)),
        ChatMessage(id="m3", role="assistant", text="Hi, let me", interrupted=True, created_at=at(2)),
        FunctionCall(
            id="fc1", call_id="c1", name="book", arguments={"city": "Oslo", "n": [1, {"x": None}]}, created_at=at(3)
        ),
        FunctionCallOutput(id="o1", call_id="c1", name="book", output="failed", is_error=True, created_at=at(4)),
        AgentHandoff(id="h1", from_agent=None, to_agent="concierge", created_at=at(5)),
        AgentHandoff(id="h2", from_agent="concierge", to_agent="billing", created_at=at(6)),
        ChatMessage(id="m4", role="developer", text="", created_at=at(7)),
    ]
    await store.chat_store().commit("s1", Commit(items=items))
    assert await store.chat_items("s1") == items
    assert await store.chat_items("unknown") == []


async def test_output_is_placed_right_after_its_call_whenever_it_was_committed(store: Store) -> None:
    chat = store.chat_store()
    await chat.commit("s1", Commit(items=[ChatMessage(id="u1", role="user", text="book it", created_at=at(0))]))
    await chat.commit("s1", Commit(items=[call("slow", 1), call("fast", 2)]))
    await chat.commit("s1", Commit(items=[ChatMessage(id="a1", role="assistant", text="working", created_at=at(3))]))
    await chat.commit("s1", Commit(items=[output("fast", 4)]))
    await chat.commit("s1", Commit(items=[ChatMessage(id="u2", role="user", text="and?", created_at=at(5))]))
    # committed last, with a created_at later than everything, and one even earlier than its call
    await chat.commit("s1", Commit(items=[output("slow", 9)]))
    await chat.commit("s1", Commit(items=[call("early", 6), output("early", 0.5)]))
    ids = [it.id for it in await store.chat_items("s1")]
    assert ids == ["u1", "fc_slow", "out_slow", "fc_fast", "out_fast", "a1", "u2", "fc_early", "out_early"]
    assert validate(await store.chat_items("s1")) == []


async def test_chat_pages_read_from_the_store_are_the_chat_cut_in_pages(store: Store) -> None:
    """A page used to be cut from the whole chat, read for every page (a 1-item page of a 24 MB chat: 0.13 s and
    30 MB); now only its rows are read, and the pages, whatever their size, are the chat in the same order."""
    chat = store.chat_store()
    same = at(10)
    commits: list[list[ChatItem]] = [
        [ChatMessage(id="u1", role="user", text="book it", created_at=at(0))],
        [call("slow", 1), call("fast", 2)],
        [ChatMessage(id="a1", role="assistant", text="working", created_at=at(3))],
        [output("fast", 4)],
        [ChatMessage(id="u2", role="user", text="and?", created_at=at(5))],
        [output("slow", 9)],  # committed late, after later items
        [call("early", 6), output("early", 0.5)],  # an output earlier than its call
        [output("orphan", 7)],  # its call is not in the chat: it keeps its own place
        [ChatMessage(id=f"t{i}", role="user", text="tie", created_at=same) for i in range(3)],
        [call("tie", 10), output("tie", 10), AgentHandoff(id="h1", from_agent=None, to_agent="b", created_at=same)],
        [ChatMessage(id="late", role="user", text="committed last, made first", created_at=at(-1))],
    ]
    for items in commits:
        await chat.commit("s1", Commit(items=items))
    whole = await store.chat_items("s1")
    assert len(whole) == 17
    for limit in (1, 2, 3, 5, 17, 50):
        pages, cursor, more = [], None, True
        while more:
            page, more = await store.chat_page("s1", cursor, limit)
            assert 0 < len(page) <= limit and (len(page) == limit or not more)
            pages += page
            cursor = page[-1].id
        assert pages == whole, limit
    for i, item in enumerate(whole):  # from any item, as a client resumes
        assert await store.chat_page("s1", item.id, 4) == (whole[i + 1 : i + 5], i + 5 < len(whole))
    assert await store.chat_page("s1", None, 1000) == (whole, False)
    assert await store.chat_page("empty", None, 10) == ([], False)
    with pytest.raises(KeyError):
        await store.chat_page("s1", "not-an-item", 10)


async def test_items_with_equal_created_at_keep_insertion_order(store: Store) -> None:
    same = [ChatMessage(id=f"m{i}", role="user", text=str(i), created_at=at(1)) for i in range(5)]
    await store.chat_store().commit("s1", Commit(items=same[:2]))
    await store.chat_store().commit("s1", Commit(items=same[2:]))
    assert [it.id for it in await store.chat_items("s1")] == ["m0", "m1", "m2", "m3", "m4"]


async def test_the_same_item_committed_twice_is_kept_once(store: Store) -> None:
    m1 = ChatMessage(id="m1", role="user", text="hi", created_at=at(0))
    m2 = ChatMessage(id="m2", role="user", text="again", created_at=at(1))
    await store.chat_store().commit("s1", Commit(items=[m1, m1]))
    await store.chat_store().commit("s1", Commit(items=[m1, m2]))
    assert await store.chat_items("s1") == [m1, m2]


async def test_tool_call_lifecycle_round_trips_with_progress(store: Store) -> None:
    running = ToolCallInfo(
        call_id="c1",
        name="search",
        arguments={"q": "tables", "party": 4},
        cancellable=True,
        scope="session",
        speech_id="sp1",
        agent="concierge",
        started_at=at(0),
    )
    chat = store.chat_store()
    await chat.commit("s1", Commit(tool_calls=[running]))
    assert await store.tool_call("s1", "c1") == running
    progressed = running.model_copy(
        update={
            "background": True,
            "progress": [
                ProgressUpdate(message="Searching Oslo", progress=0.1, at=at(1)),
                ProgressUpdate(message="almost", progress=None, at=at(2)),
            ],
        }
    )
    await chat.commit("s1", Commit(tool_calls=[progressed]))
    assert await store.running_tool_calls() == [("s1", progressed)]
    ended = progressed.model_copy(
        update={"status": ToolStatus.COMPLETED, "output": "3 tables free", "ended_at": at(3), "is_error": False}
    )
    other = ToolCallInfo(
        call_id="c2", name="pay", status=ToolStatus.FAILED, output="no", is_error=True, started_at=at(4)
    )
    await chat.commit("s1", Commit(tool_calls=[ended, other]))
    assert await store.tool_call("s1", "c1") == ended
    assert await store.tool_calls("s1") == [ended, other]
    assert await store.tool_calls("s1", status="failed") == [other]
    assert await store.running_tool_calls() == []
    assert await store.tool_call("s1", "nope") is None


async def test_running_tool_calls_across_sessions(store: Store) -> None:
    await store.create_session(SessionRecord(id="s2", agent="demo"))
    a = ToolCallInfo(call_id="a", name="t", started_at=at(2))
    b = ToolCallInfo(call_id="b", name="t", started_at=at(1))
    done = ToolCallInfo(call_id="c", name="t", status=ToolStatus.CANCELLED, started_at=at(0), ended_at=at(3))
    await store.chat_store().commit("s1", Commit(tool_calls=[a, done]))
    await store.chat_store().commit("s2", Commit(tool_calls=[b]))
    assert await store.running_tool_calls() == [("s2", b), ("s1", a)]
    assert await store.running_tool_calls(limit=1) == [("s2", b)]


async def test_a_cancelling_call_is_listed_as_running_until_it_ends(store: Store) -> None:
    running = ToolCallInfo(call_id="a", name="t", cancellable=True, started_at=at(1))
    cancelling = running.model_copy(update={"status": ToolStatus.CANCELLING})
    await store.chat_store().commit("s1", Commit(tool_calls=[cancelling]))
    assert await store.running_tool_calls() == [("s1", cancelling)]
    assert await store.tool_calls("s1", status="running") == [cancelling]
    assert await store.tool_calls_after("s1", None, 10, status="running") == [cancelling]
    assert await store.tool_calls("s1", status="cancelling") == [cancelling]
    ended = cancelling.model_copy(update={"status": ToolStatus.CANCELLED, "output": "late", "ended_at": at(2)})
    await store.chat_store().commit("s1", Commit(tool_calls=[ended]))
    assert await store.running_tool_calls() == []
    assert await store.tool_calls("s1", status="running") == []


async def test_running_tool_calls_that_started_at_the_same_instant_have_one_order(store: Store) -> None:
    """Calls of several sessions started within the clock's resolution: the list is by (started_at, session, call),
    so a limit cuts it at the same place on every read and in every database."""
    for sid in ("s3", "s2"):
        await store.create_session(SessionRecord(id=sid, agent="demo"))
    same = at(5)
    for sid in ("s3", "s1", "s2"):
        calls = [ToolCallInfo(call_id=c, name="t", started_at=same) for c in ("z", "a", "m")]
        await store.chat_store().commit(sid, Commit(tool_calls=calls))
    order = [(sid, c) for sid in ("s1", "s2", "s3") for c in ("a", "m", "z")]
    assert [(sid, info.call_id) for sid, info in await store.running_tool_calls()] == order
    for limit in range(1, len(order)):
        assert [(sid, info.call_id) for sid, info in await store.running_tool_calls(limit=limit)] == order[:limit]


async def test_speeches_round_trip_and_update(store: Store) -> None:
    sp = SpeechInfo(
        id="sp1",
        source="reply",
        state=SpeechState.PLAYING,
        interrupted=False,
        allow_interruptions=True,
        text="Hello there",
        played_text="Hello",
        created_at=at(0),
    )
    say = SpeechInfo(
        id="sp2",
        source="say",
        state=SpeechState.SCHEDULED,
        interrupted=False,
        allow_interruptions=False,
        text="",
        played_text="",
        created_at=at(1),
    )
    await store.chat_store().commit("s1", Commit(speeches=[sp, say]))
    done = sp.model_copy(update={"state": SpeechState.DONE, "interrupted": True})
    await store.chat_store().commit("s1", Commit(speeches=[done]))
    assert await store.speeches("s1") == [done, say]
    assert await store.speech("s1", "sp2") == say
    assert await store.speech("s1", "nope") is None


async def test_session_record_and_runtime_state(store: Store) -> None:
    rec = SessionRecord(
        id="s2",
        agent="concierge",
        state="initializing",
        config={"llm": {"provider": "scripted", "turns": [{"text": "hi"}]}, "playout": {"words_per_second": 3.5}},
        metadata={"customer": "acme", "tags": ["a", "b"]},
        created_at=at(0),
        updated_at=at(0),
    )
    await store.create_session(rec)
    assert await store.get_session("s2") == rec
    with pytest.raises(SessionExists):
        await store.create_session(rec.model_copy(update={"agent": "other"}))

    state = SessionState(agent="billing", state="active", llm_state={"turn": 2}, current_speech_id="sp9")
    await store.chat_store().commit("s2", Commit(session=state))
    got = await store.get_session("s2")
    assert got is not None
    assert (got.agent, got.state, got.llm_state, got.current_speech_id) == ("billing", "active", {"turn": 2}, "sp9")
    assert (got.config, got.metadata, got.created_at) == (rec.config, rec.metadata, rec.created_at)
    assert got.updated_at > rec.updated_at

    await store.chat_store().commit("s2", Commit(session=state.model_copy(update={"llm_state": None})))
    got = await store.get_session("s2")
    assert got is not None and got.llm_state is None
    assert await store.get_session("nope") is None


async def test_a_session_state_commit_creates_a_missing_session_row(store: Store) -> None:
    await store.chat_store().commit(
        "s9", Commit(session=SessionState(agent="demo"), items=[ChatMessage(id="m", role="user", text="x")])
    )
    got = await store.get_session("s9")
    assert got is not None and got.state == "active" and got.config == {}
    assert len(await store.chat_items("s9")) == 1


async def test_list_sessions_pages_newest_first_across_equal_creation_times(store: Store) -> None:
    # three sessions share one instant: the pages must order them by id, neither skipping nor repeating one
    created = {"a1": at(1), "t2": at(2), "t1": at(2), "t3": at(2), "z3": at(3), "b0": at(0)}
    for sid, created_at in created.items():
        await store.create_session(SessionRecord(id=sid, agent="demo", created_at=created_at))
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = await store.list_sessions(limit=2, cursor=cursor)
        assert len(page) <= 2
        seen += [r.id for r in page]
        if cursor is None:
            break
    assert seen == ["s1", "z3", "t3", "t2", "t1", "a1", "b0"]


async def test_list_live_and_mark_sessions(store: Store) -> None:
    for i, state in enumerate(["closed", "initializing", "closing", "failed", "active", "closed"]):
        await store.create_session(SessionRecord(id=f"x{i}", agent="demo", state=state, created_at=at(i)))
    # newest first: s1 was created now, so it comes first
    page1, cursor = await store.list_sessions(limit=3)
    assert [r.id for r in page1] == ["s1", "x5", "x4"] and cursor is not None
    page2, cursor = await store.list_sessions(limit=3, cursor=cursor)
    assert [r.id for r in page2] == ["x3", "x2", "x1"] and cursor is not None
    page3, cursor = await store.list_sessions(limit=3, cursor=cursor)
    assert [r.id for r in page3] == ["x0"] and cursor is None
    closed, cursor = await store.list_sessions(state="closed")
    assert [r.id for r in closed] == ["x5", "x0"] and cursor is None
    with pytest.raises(InvalidCursor):
        await store.list_sessions(cursor="garbage!")

    assert [r.id for r in await store.live_sessions()] == ["x1", "x2", "x4", "s1"]
    await store.mark_session("x4", "failed")
    assert [r.id for r in await store.live_sessions()] == ["x1", "x2", "s1"]
    got = await store.get_session("x4")
    assert got is not None and got.state == "failed"


async def test_events_round_trip_filter_and_cursor(store: Store) -> None:
    await store.create_session(SessionRecord(id="s2", agent="demo"))
    sink = store.event_sink()
    types = ["session.started", "tool.started", "tool.progress", "speech.created", "tool_x.y", "tool.ended"]
    s1 = [
        Event(seq=i + 1, session_id="s1", type=t, data={"i": i, "nested": {"a": [1, None]}})
        for i, t in enumerate(types)
    ]
    s2 = [Event(seq=i + 1, session_id="s2", type="agent.state", data={"state": "listening"}) for i in range(3)]
    for a, b in zip(s1, [*s2, None, None, None], strict=True):
        sink.publish(a)
        if b is not None:
            sink.publish(b)
    await sink.publish(s1[-1])  # the same (session, seq) again: stored once
    assert await store.events("s1") == s1
    assert await store.events("s1", since=2, limit=2) == s1[2:4]
    assert [e.type for e in await store.events("s1", types=["tool.*"])] == [
        "tool.started",
        "tool.progress",
        "tool.ended",
    ]
    assert [e.type for e in await store.events("s1", types=["speech.created", "session.*"])] == [
        "session.started",
        "speech.created",
    ]
    assert [e.type for e in await store.events("s1", types=["tool_?.y"])] == ["tool_x.y"]
    assert await store.last_seq("s1") == 6 and await store.last_seq("s2") == 3 and await store.last_seq("zz") == 0

    everything = await store.events_multi(session_ids=None, since_id=0, limit=100)
    assert [e for _, e in everything] == [s1[0], s2[0], s1[1], s2[1], s1[2], s2[2], *s1[3:]]
    ids = [i for i, _ in everything]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    tail = await store.events_multi(session_ids=["s2"], since_id=ids[1], limit=100)
    assert [e for _, e in tail] == s2[1:]
    assert await store.events_multi(session_ids=None, since_id=ids[-1], limit=10) == []
    assert await store.events_multi(session_ids=[], since_id=0, limit=10) == []


def test_in_memory_sqlite_is_refused() -> None:
    # The writer and the readers use different connections: each would see its own empty in-memory database.
    with pytest.raises(ValueError, match="in-memory"):
        make_engine("sqlite+aiosqlite:///:memory:")
