"""Scenario 15: closing a busy session, and I6: an event is published only after what it reports is durable."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.events import Event
from switchboard.runtime.memory import MemoryEventLog, MemoryStore
from switchboard.runtime.ports import Commit
from switchboard.runtime.status import SessionClosed
from tests.waiting import WAIT_S

from .harness import Harness

LONG = " ".join(f"word{i}" for i in range(40))


class Busy(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.log: list[str] = []
        self.gate = asyncio.Event()

    @function_tool(allow_cancellation=True)
    async def search(self, ctx: RunContext, q: str) -> str:
        """Cancellable background search."""
        await ctx.update(f"searching {q}", progress=0.2)
        try:
            await ctx.sleep(10)
        finally:
            self.log.append("search stopped")
        return "found"

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Non-cancellable booking."""
        await asyncio.sleep(0.1)
        self.log.append("booked")
        return f"booked {what}"

    @function_tool
    async def report(self, ctx: RunContext) -> str:
        """Async tool with progress, released by the test."""
        await ctx.update("started", progress=0.1)
        await self.gate.wait()
        await ctx.update("halfway", progress=0.5)
        return "report ready"

    @function_tool
    async def transfer(self, ctx: RunContext) -> Agent:
        """Hand off."""
        return Other()


def assert_every_speech_done_before_close(h: Harness) -> None:
    events = h.events.events[h.sid]
    assert events[-1].type == "session.closed"
    created = [e.data["speech_id"] for e in events if e.type == "speech.created"]
    done = [e.data["speech_id"] for e in events if e.type == "speech.done"]
    assert sorted(created) == sorted(done), "every speech ends exactly once, with its event"
    for sid in created:
        assert h.store.speeches[h.sid][sid].state == "done"


class Other(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="other agent", name="other")


async def test_close_with_speech_playing_and_tools_running():
    agent = Busy()
    turns = [
        {"text": "Working.", "tool_calls": [{"name": "search", "arguments": {"q": "x"}, "id": "s1"}]},
        {"text": "Searching."},  # answers the search's update: tools are off in this step
        {"text": LONG, "tool_calls": [{"name": "book", "arguments": {"what": "y"}, "id": "b1"}]},
    ]
    h = Harness(agent, turns)
    await h.session.start()
    try:
        await h.session.input("search")
        await h.wait_for("tool.progress")
        await h.idle()
        res = await h.session.input("book")
        await h.wait_for("tool.started", lambda e: e.data["call_id"] == "b1")
        await h.wait_for("speech.started")
        await asyncio.sleep(0.03)
        assert h.session.current_speech is not None and not h.session.current_speech.done
        assert {c.call_id for c in h.session.tool_calls("running")} == {"s1", "b1"}
    finally:
        async with asyncio.timeout(WAIT_S):
            await h.session.aclose()

    assert h.session.state == "closed"
    assert sorted(agent.log) == ["booked", "search stopped"]
    s1, b1 = h.session.tool_call("s1"), h.session.tool_call("b1")
    assert s1.status == "cancelled" and "session closed" in (s1.output or "")
    assert b1.status == "completed" and b1.output == "booked y", "a non-cancellable call is awaited and committed"
    assert h.store.tool_calls[h.sid]["b1"].status == "completed"
    assert h.store.tool_calls[h.sid]["s1"].status == "cancelled"
    speech = h.session.speech(res.speech_id)
    assert speech is not None and speech.done and speech.interrupted and not speech.forced
    assistant = [x for x in h.summary() if x[0] == "assistant"]
    assert assistant[0] == ("assistant", "Working.")
    assert assistant[-1][-1] == "interrupted" and LONG.startswith(assistant[-1][1])
    assert h.store.sessions[h.sid].state == "closed"
    assert h.types()[-1] == "session.closed"
    sources = [e.data["source"] for e in h.of_type("speech.created")]
    assert sources == ["reply", "reply"], "no reply scheduled by closing"
    assert len(h.llm.requests) == 3
    assert_every_speech_done_before_close(h)
    h.check_invariants()

    with pytest.raises(SessionClosed):
        await h.session.input("hello?")
    with pytest.raises(SessionClosed):
        await h.session.input("hel", final=False)
    with pytest.raises(SessionClosed):
        await h.session.say("hi")
    with pytest.raises(SessionClosed):
        await h.session.interrupt()
    with pytest.raises(SessionClosed):
        await h.session.generate_reply()
    n = len(h.types())
    await h.session.aclose()  # idempotent
    assert len(h.types()) == n


async def test_close_idle_session():
    async with Harness(Busy(), [{"text": "Hi."}]) as h:
        await h.session.input("hi")
        await h.idle()
    assert_every_speech_done_before_close(h)
    assert h.summary() == [("user", "hi"), ("assistant", "Hi.")]
    h.check_invariants()


async def test_close_with_queued_speeches_ends_them_unstarted():
    async with Harness(Busy(), [{"text": LONG}]) as h:
        first = await h.session.input("talk")
        await h.wait_for("speech.started")
        queued = await h.session.say("queued words", allow_interruptions=False)
        assert not queued.done
    assert queued.done and queued.interrupted and not queued.started
    done = {e.data["speech_id"]: e.data["interrupted"] for e in h.of_type("speech.done")}
    assert done == {first.speech_id: True, queued.id: True}
    assert "queued words" not in str(h.summary())
    assert_every_speech_done_before_close(h)
    h.check_invariants()


class SlowDeferredStore(MemoryStore):
    """Commits of a deferred reply's speech take a while (so a close can overtake them); ``seen`` is set when one
    arrives. The deferred reply a background result needs is committed with the call's end."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    async def write(self, session_id: str, commit: Commit) -> None:
        if any(sp.source == "deferred_reply" and sp.state == "scheduled" for sp in commit.speeches):
            self.seen.set()
            await asyncio.sleep(0.05)
        await super().write(session_id, commit)


async def test_close_while_a_deferred_reply_is_being_scheduled():
    agent = Busy()
    turns = [{"text": "Starting.", "tool_calls": [{"name": "report", "id": "r1"}]}, {"text": "It runs."}]
    h = Harness(agent, turns)
    h.store = SlowDeferredStore()
    h.session.writes.store = h.store
    await h.session.start()
    try:
        await h.session.input("report")
        await h.wait_for("tool.progress")
        await h.idle()
        agent.gate.set()
        await asyncio.wait_for(h.store.seen.wait(), WAIT_S)  # the call's end, with its deferred reply, is being written
    finally:
        await h.session.aclose()
    created = [e.data for e in h.of_type("speech.created")]
    assert [d["source"] for d in created] == ["reply", "deferred_reply"]
    deferred = h.session.speech(created[1]["speech_id"])
    assert deferred is not None and deferred.done and deferred.interrupted and not deferred.started
    assert h.store.speeches[h.sid][deferred.id].state == "done"  # ended by the close, never left owed
    assert all(r.speech_id != deferred.id for r in h.llm.requests), "a deferred reply ended by the close ran"
    assert_every_speech_done_before_close(h)
    h.check_invariants()


# -- I6 -------------------------------------------------------------------------------------------------------


class DurabilityCheckingLog(MemoryEventLog):
    """Asserts, as each event is published, that what it reports is already in the store."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__()
        self.store = store
        self.checked: dict[str, int] = {}
        self.violations: list[str] = []

    def publish(self, event: Event) -> Awaitable[None]:
        try:
            self._check(event)
        except AssertionError as err:
            self.violations.append(f"seq {event.seq} {event.type}: {err}")
        return super().publish(event)

    def _check(self, event: Event) -> None:
        sid, d = event.session_id, event.data
        items = {it.id for it in self.store.items[sid]}
        calls = self.store.tool_calls[sid]
        speeches = self.store.speeches[sid]
        t = event.type
        if t == "chat.item":
            assert d["item"]["id"] in items, "chat item not stored yet"
        elif t == "tool.ended":
            info = calls.get(d["call_id"])
            assert info is not None and info.status == d["status"], f"stored status {info and info.status}"
            assert info.output == d["output"]
        elif t == "tool.started":
            assert d["call_id"] in calls, "tool call not stored yet"
        elif t == "tool.progress":
            info = calls[d["call_id"]]
            assert info.progress and info.progress[-1].message == d["message"], "progress not stored yet"
        elif t == "user.input" and d["final"]:
            assert d["item_id"] in items
        elif t == "speech.created":
            assert d["speech_id"] in speeches, "speech not stored yet"
        elif t == "speech.done":
            assert speeches[d["speech_id"]].state == "done"
        elif t == "agent.handoff":
            assert self.store.sessions[sid].agent == d["to_agent"]
        elif t == "session.closed":
            assert self.store.sessions[sid].state == "closed"
        else:
            return
        self.checked[t] = self.checked.get(t, 0) + 1


def checked_harness(agent: Agent, turns: list[dict[str, object]]) -> tuple[Harness, DurabilityCheckingLog]:
    h = Harness(agent, turns)
    log = DurabilityCheckingLog(h.store)
    h.events = log
    h.session.events._sink = log  # the session, its executor and its replies share this EventLog
    return h, log


async def test_I6_events_published_only_after_what_they_report_is_durable():
    agent = Busy()
    turns = [
        {"text": "Starting.", "tool_calls": [{"name": "report", "id": "r1"}]},
        {"text": "It runs."},
        {"text": LONG, "tool_calls": [{"name": "book", "arguments": {"what": "z"}, "id": "b1"}]},
        {"text": "Report: {{tool_output:report}}"},
        {"text": "Moving you.", "tool_calls": [{"name": "transfer", "id": "t1"}]},
        {"text": "Other agent here."},
    ]
    h, log = checked_harness(agent, turns)
    async with h:
        await h.session.input("start the report")
        await h.wait_for("tool.progress")
        await h.idle()
        await h.session.input("book z")
        await h.wait_for("tool.started", lambda e: e.data["call_id"] == "b1")
        await asyncio.sleep(0.03)
        await h.session.interrupt()
        agent.gate.set()
        await h.tools_done()
        await h.wait_for("speech.created", lambda e: e.data["source"] == "deferred_reply")
        await h.idle()
        await h.session.input("transfer me")
        await h.idle()
        await h.session.say("Goodbye.")
        await h.idle()
        assert h.session.agent.name == "other"
    assert log.violations == []
    for t in (
        "chat.item",
        "tool.ended",
        "tool.started",
        "tool.progress",
        "user.input",
        "speech.created",
        "speech.done",
        "agent.handoff",
        "session.closed",
    ):
        assert log.checked.get(t), f"no {t} event was checked"
    h.check_invariants()
