"""Recovery edge cases, with in-process hosts built as ``app.py`` builds them, on SQLite and PostgreSQL.

A "process" here is a store plus a ``SessionHost``; stopping it (``host.aclose()``) suspends its sessions: they stay
live in the store, with their tool calls still ``running``, exactly as a crash leaves them (the SIGKILL case itself
is ``test_crash_recovery``). The next process recovers them with ``recover_all()``.
"""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.control.host import SessionHost
from switchboard.control.hub import EventHub
from switchboard.control.session_config import PlayoutSettings, SessionConfig
from switchboard.control.settings import Settings
from switchboard.runtime.agent import AgentFactory, AgentRegistry
from switchboard.runtime.chat import ChatMessage, FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.events import Event
from switchboard.runtime.ports import Commit
from switchboard.runtime.recovery import RESTART_OUTPUT
from switchboard.runtime.speech import SpeechInfo, SpeechState
from switchboard.runtime.tools import ToolStatus
from switchboard.store import SessionRecord, Store

from .conftest import Db, wait_for

RUNS: Counter[str] = Counter()  # tool bodies started, by tool name


async def forever() -> None:
    await asyncio.Event().wait()


class Worker(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You work.")

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book at once."""
        return f"booked {what}"

    @function_tool
    async def hang(self, ctx: RunContext) -> str:
        """Never ends on its own."""
        RUNS["hang"] += 1
        await forever()
        return "never"

    @function_tool(on_restart="retry")
    async def reserve(self, ctx: RunContext, seat: str) -> str:
        """Safe to run again after a restart; the first run never ends."""
        RUNS["reserve"] += 1
        if RUNS["reserve"] == 1:
            await forever()
        return f"reserved {seat}"

    @function_tool
    async def crunch(self, ctx: RunContext) -> str:
        """Moves to the background, then never ends."""
        RUNS["crunch"] += 1
        await ctx.update("crunching", progress=0.5)
        await forever()
        return "never"

    @function_tool(on_restart="retry")
    async def fetch(self, ctx: RunContext) -> str:
        """Safe to run again; moves to the background; the first run never ends."""
        RUNS["fetch"] += 1
        await ctx.update("fetching", progress=0.1)
        if RUNS["fetch"] == 1:
            await forever()
        return "fetched"

    @function_tool(on_restart="retry", allow_cancellation=True)
    async def deaf_fetch(self, ctx: RunContext) -> str:
        """Safe to run again, but ignores its cancellation until released."""
        RUNS["deaf_fetch"] += 1
        await ctx.update("fetching")
        release = RELEASES[-1]
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # a badly written tool
        return "fetched"


RELEASES: list[asyncio.Event] = []  # one per test (an event belongs to its test's loop)


class Retired(Worker):
    pass


def broken() -> Agent:
    raise RuntimeError("this agent's factory fails now")


@pytest.fixture(autouse=True)
def runs() -> Iterator[Counter[str]]:
    RUNS.clear()
    yield RUNS
    RUNS.clear()


class Proc:
    """One service process on ``db``: a store and a host wired as in ``app.py``."""

    def __init__(self, db: Db, agents: Mapping[str, AgentFactory]) -> None:
        self.db = db
        self.agents = agents
        self.events: list[Event] = []  # durable events, as the hub gets them

    async def start(self, *, recover: bool = True) -> Proc:
        self.store: Store = self.db.store()
        await self.store.migrate()
        await self.store.start()
        # the tools here never end: a stop lets go of them at once instead of granting the uncancellable 10 s
        settings = Settings(database_url=self.db.url, words_per_second=500, shutdown_tool_grace_s=0)
        self.host = SessionHost(
            store=self.store,
            registry=AgentRegistry(self.agents),
            hub=EventHub(),
            settings=settings,
            on_event=self.events.append,
        )
        if recover:
            await self.host.recover_all()
        return self

    async def stop(self) -> None:
        await self.host.aclose()
        await self.store.aclose()

    async def create(self, sid: str, turns: list[dict[str, Any]], agent: str = "worker") -> None:
        llm = {"provider": "scripted", "turns": turns, "fallback": {"text": "fallback turn"}}
        config = SessionConfig(id=sid, agent=agent, llm=llm, playout=PlayoutSettings(words_per_second=500))
        await self.host.create(config, {})

    async def until(self, sid: str, type: str, pred: Callable[[dict[str, Any]], bool] = lambda d: True) -> Event:
        found: list[Event] = []

        def seen() -> bool:
            found[:] = [e for e in self.events if e.session_id == sid and e.type == type and pred(e.data)]
            return bool(found)

        await wait_for(seen)
        return found[0]

    async def said(self, sid: str, text: str) -> None:
        await self.until(sid, "chat.item", lambda d: d["item"].get("role") == "assistant" and d["item"]["text"] == text)

    async def idle(self, sid: str) -> None:
        session = self.host.sessions[sid]
        await wait_for(lambda: session.idle and not session.pending_writes)


AGENTS: dict[str, AgentFactory] = {"worker": Worker}


async def check_log(store: Store, sid: str) -> list[Event]:
    """The whole event log of ``sid``: seq 1..N with no gap and no reuse (I6)."""
    events = await store.events(sid, limit=100_000)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    return events


async def check_chat(store: Store, sid: str) -> list[Any]:
    """The chat of ``sid``: valid for a provider (I2): every call has exactly one output right after it."""
    items = await store.chat_items(sid)
    assert validate(items) == [], validate(items)
    return items


def outputs(items: list[Any], call_id: str) -> list[tuple[str, bool]]:
    return [(it.output, it.is_error) for it in items if isinstance(it, FunctionCallOutput) and it.call_id == call_id]


async def test_session_whose_agent_is_gone_fails_and_the_others_recover(db: Db) -> None:
    first = await Proc(db, {"worker": Worker, "retired": Retired, "broken": Worker}).start()
    await first.create("keep", [{"text": "Booking.", "tool_calls": [{"name": "book", "arguments": {"what": "a"}}]}])
    await first.create("gone", [{"text": "Working.", "tool_calls": [{"name": "hang"}]}], agent="retired")
    await first.create("crashy", [], agent="broken")
    await first.host.sessions["keep"].input("book a")
    await first.host.sessions["gone"].input("work")
    await first.until("gone", "tool.started")
    await first.said("keep", "Booking.")
    await first.idle("keep")
    hang = (await first.store.tool_calls("gone"))[0]
    await first.stop()

    second = await Proc(db, {"worker": Worker, "broken": broken}).start(recover=False)
    last_seq = {sid: await second.store.last_seq(sid) for sid in ("keep", "gone", "crashy")}
    await second.host.recover_all()
    try:
        assert sorted(second.host.failed) == ["crashy", "gone"]
        assert second.host.recovered == ["keep"]
        assert set(second.host.sessions) == {"keep"}
        for sid, reason in (("gone", "unknown agent 'retired'"), ("crashy", "this agent's factory fails now")):
            record = await second.store.get_session(sid)
            assert record is not None and record.state == "failed"
            events = await check_log(second.store, sid)
            assert events[-1].type == "session.failed" and reason in events[-1].data["reason"]
            assert events[-1].data["interrupted_calls"] == ([hang.call_id] if sid == "gone" else [])
            assert events[last_seq[sid]].type != "session.recovered"
        # the call the failed session left running still ends exactly once, with its output (I5)
        ended = await second.store.tool_call("gone", hang.call_id)
        assert ended is not None and ended.status == ToolStatus.INTERRUPTED and ended.output == RESTART_OUTPUT
        items = await check_chat(second.store, "gone")
        assert outputs(items, hang.call_id) == [(RESTART_OUTPUT, True)]
        assert await second.store.running_tool_calls() == []
        # the healthy session was started and answers
        await second.host.sessions["keep"].input("and now?")
        await second.said("keep", "fallback turn")
        await check_log(second.store, "keep")
    finally:
        await second.stop()

    third = await Proc(db, {"worker": Worker, "retired": Retired, "broken": Worker}).start()
    try:
        assert third.host.recovered == ["keep"] and third.host.failed == []  # a failed session stays failed
    finally:
        await third.stop()


async def test_retry_tool_left_running_is_run_again_once(db: Db, runs: Counter[str]) -> None:
    turns = [
        {"text": "Reserving.", "tool_calls": [{"name": "reserve", "arguments": {"seat": "12A"}}]},
        {"text": "One moment."},  # the reply that was waiting for the call when the process stopped: it is owed
        {"text": "Done: {{tool_output:reserve}}"},
    ]
    first = await Proc(db, AGENTS).start()
    await first.create("s", turns)
    await first.host.sessions["s"].input("reserve 12A")
    await wait_for(lambda: runs["reserve"] == 1)
    call = (await first.store.tool_calls("s"))[0]
    assert call.status == ToolStatus.RUNNING
    await first.stop()

    second = await Proc(db, AGENTS).start()
    try:
        recovered = await second.until("s", "session.recovered")
        assert recovered.data["retried_calls"] == [call.call_id] and recovered.data["interrupted_calls"] == []
        # the reply is played again (turn 2); the call is re-run once, its result committed as the call's one pair,
        # and a deferred reply speaks it (turn 3)
        await second.said("s", "One moment.")
        await second.said("s", "Done: reserved 12A")
        assert runs["reserve"] == 2
        ended = await second.store.tool_call("s", call.call_id)
        assert ended is not None and (ended.status, ended.output) == (ToolStatus.COMPLETED, "reserved 12A")
        items = await check_chat(second.store, "s")
        assert outputs(items, call.call_id) == [("reserved 12A", False)]
        assert sum(isinstance(it, FunctionCall) for it in items) == 1
        speeches = await second.store.speeches("s")
        assert [sp.source for sp in speeches if sp.state == SpeechState.DONE and not sp.interrupted][-1] == (
            "deferred_reply"
        )
        await second.idle("s")
        await check_log(second.store, "s")
    finally:
        await second.stop()
    assert runs["reserve"] == 2


async def test_a_cancelling_call_left_by_a_restart_ends_interrupted_and_is_never_run_again(
    db: Db, runs: Counter[str]
) -> None:
    RELEASES.append(release := asyncio.Event())
    turns = [{"text": "Fetching.", "tool_calls": [{"name": "deaf_fetch"}]}]
    first = await Proc(db, AGENTS).start()
    try:
        await first.create("s", turns)
        await first.host.sessions["s"].input("fetch")
        await first.until("s", "tool.progress")
        call_id = (await first.store.tool_calls("s"))[0].call_id
        info = await first.host.sessions["s"].cancel_tool(call_id)  # its tool ignores it: cancelling
        assert info.status == ToolStatus.CANCELLING
        await first.stop()
        second = await Proc(db, AGENTS).start()
        try:
            recovered = await second.until("s", "session.recovered")
            assert recovered.data["interrupted_calls"] == [call_id] and recovered.data["retried_calls"] == []
            ended = await second.store.tool_call("s", call_id)
            assert ended is not None and ended.status == ToolStatus.INTERRUPTED
            assert runs["deaf_fetch"] == 1, "a cancelled call is never run again"
            await check_chat(second.store, "s")
        finally:
            await second.stop()
    finally:
        release.set()  # the body the first process let go of ends now


async def test_retry_tool_already_in_the_background_keeps_one_pair(db: Db, runs: Counter[str]) -> None:
    turns = [
        {"text": "Fetching.", "tool_calls": [{"name": "fetch"}]},
        {"text": "It runs in the background."},
        {"text": "Fetch says {{tool_output:fetch}}"},
    ]
    first = await Proc(db, AGENTS).start()
    await first.create("s", turns)
    await first.host.sessions["s"].input("fetch")
    await first.said("s", "It runs in the background.")
    await first.idle("s")
    call = (await first.store.tool_calls("s"))[0]
    assert call.background and call.status == ToolStatus.RUNNING
    await first.stop()

    second = await Proc(db, AGENTS).start()
    try:
        # the re-run reports progress again and ends: still one call with the background output, its new update as
        # the next `/update/<n>` pair, and the result as its `/final` pair (never a second pair under one call id)
        await second.said("s", "Fetch says fetched")
        assert runs["fetch"] == 2
        items = await check_chat(second.store, "s")
        assert [it.call_id for it in items if isinstance(it, FunctionCall)] == [
            call.call_id,
            f"{call.call_id}/update/2",
            f"{call.call_id}/final",
        ]
        (background,) = outputs(items, call.call_id)
        assert "running in the background" in background[0]
        assert outputs(items, f"{call.call_id}/final") == [("fetched", False)]
        ended = await second.store.tool_call("s", call.call_id)
        assert ended is not None and ended.status == ToolStatus.COMPLETED and ended.background
        await second.idle("s")
        await check_log(second.store, "s")
    finally:
        await second.stop()


async def test_speeches_left_unfinished_are_played_again_in_order_and_one_an_interrupt_stopped_ends(db: Db) -> None:
    first = await Proc(db, AGENTS).start()
    await first.create("s", [])
    await first.stop()

    second = await Proc(db, AGENTS).start(recover=False)
    # what a crash in the middle of playout leaves: a speech row that is `playing`, and one still `scheduled`
    playing = SpeechInfo(
        id="speech_playing",
        source="reply",
        state=SpeechState.PLAYING,
        interrupted=False,
        allow_interruptions=True,
        text="Hello there, how are you",
        played_text="Hello there,",
        created_at=(await second.store.get_session("s")).created_at,  # type: ignore[union-attr]
    )
    queued = playing.model_copy(update={"id": "speech_queued", "state": SpeechState.SCHEDULED, "played_text": ""})
    # an interrupt had stopped this one, and its end was not written yet
    stopped = playing.model_copy(update={"id": "speech_stopped", "interrupted": True})
    await second.store.chat_store().commit("s", Commit(speeches=[stopped, playing, queued]))
    await second.host.recover_all()
    try:
        recovered = await second.until("s", "session.recovered")
        # the replies that were accepted and not finished are answered, not dropped: the user is still waiting; the
        # one the user interrupted ends as it was
        assert recovered.data["interrupted_speeches"] == ["speech_stopped"]
        assert recovered.data["resumed_speeches"] == ["speech_playing", "speech_queued"]
        await second.until("s", "speech.done", lambda d: d["speech_id"] == "speech_queued")
        done = [(e.data["speech_id"], e.data["interrupted"]) for e in second.events if e.type == "speech.done"]
        assert done == [("speech_stopped", True), ("speech_playing", False), ("speech_queued", False)]
        generated = [e.data["speech_id"] for e in second.events if e.type == "generation.started"]
        assert generated == ["speech_playing", "speech_queued"]
        states = {sp.id: (sp.state, sp.interrupted) for sp in await second.store.speeches("s")}
        assert states == {
            "speech_stopped": (SpeechState.DONE, True),
            "speech_playing": (SpeechState.DONE, False),
            "speech_queued": (SpeechState.DONE, False),
        }
        await check_log(second.store, "s")
    finally:
        await second.stop()


async def test_background_call_left_running_gets_its_final_pair(db: Db) -> None:
    turns = [
        {"text": "Starting.", "tool_calls": [{"name": "crunch"}]},
        {"text": "It runs in the background."},
        {"text": "Crunch says {{tool_output:crunch}}"},
    ]
    first = await Proc(db, AGENTS).start()
    await first.create("s", turns)
    await first.host.sessions["s"].input("crunch")
    await first.said("s", "It runs in the background.")
    await first.idle("s")
    call = (await first.store.tool_calls("s"))[0]
    assert call.background and call.status == ToolStatus.RUNNING
    await first.stop()

    second = await Proc(db, AGENTS).start()
    try:
        ended = await second.store.tool_call("s", call.call_id)
        assert ended is not None and ended.status == ToolStatus.INTERRUPTED and ended.is_error
        items = await check_chat(second.store, "s")
        (background,) = outputs(items, call.call_id)
        assert "running in the background" in background[0]
        assert outputs(items, f"{call.call_id}/final") == [(RESTART_OUTPUT, True)]
        # the model sees the final result, not the "running in the background" one
        await second.host.sessions["s"].input("and the crunch?")
        await second.said("s", f"Crunch says {RESTART_OUTPUT}")
        await check_log(second.store, "s")
    finally:
        await second.stop()


async def test_recovering_twice_duplicates_nothing(db: Db, runs: Counter[str]) -> None:
    turns = [
        {
            "text": "On it.",
            "tool_calls": [
                {"name": "book", "arguments": {"what": "b"}},
                {"name": "hang"},
                {"name": "crunch"},
                {"name": "reserve", "arguments": {"seat": "1C"}},
            ],
        },
    ]
    first = await Proc(db, AGENTS).start()
    await first.create("s", turns)
    await first.host.sessions["s"].input("do everything")
    await wait_for(lambda: runs["hang"] == 1 and runs["reserve"] == 1)
    await first.until("s", "tool.progress")
    await first.until("s", "tool.ended")  # book
    first_speech = (await first.until("s", "speech.created")).data["speech_id"]
    await first.stop()

    second = await Proc(db, AGENTS).start()
    await second.until("s", "tool.ended", lambda d: d["name"] == "reserve")
    await second.until("s", "speech.done", lambda d: d["speech_id"] == first_speech)  # the owed reply, played again
    await second.until("s", "speech.done", lambda d: d["speech_id"] != first_speech)  # the re-run's deferred reply
    await second.idle("s")
    await second.stop()
    items = await check_chat(second.store, "s")
    calls = sorted((c.name, c.status.value) for c in await second.store.tool_calls("s"))
    assert calls == [
        ("book", "completed"),
        ("crunch", "interrupted"),
        ("hang", "interrupted"),
        ("reserve", "completed"),
    ]
    log = await check_log(second.store, "s")

    third = await Proc(db, AGENTS).start()
    try:
        assert third.host.recovered == ["s"]
        recovered = await third.until("s", "session.recovered")
        assert recovered.data["interrupted_calls"] == recovered.data["retried_calls"] == []
        await third.idle("s")
        assert await check_chat(third.store, "s") == items
        assert sorted((c.name, c.status.value) for c in await third.store.tool_calls("s")) == calls
        new = (await check_log(third.store, "s"))[len(log) :]
        assert [e.type for e in new] == ["session.recovered", "agent.state"]
        assert runs == Counter({"hang": 1, "crunch": 1, "reserve": 2})
        # the reply that was waiting for its calls is played again, and the re-run's result gets a deferred reply
        texts = [it.text for it in items if isinstance(it, ChatMessage)]
        assert texts == ["do everything", "On it.", "fallback turn", "fallback turn"]
    finally:
        await third.stop()


async def test_a_session_stored_with_an_earlier_config_row_recovers(db: Db) -> None:
    """Rows keep the create body as JSON; rows written before the typed config (or by a state commit, with an empty
    config) still load."""
    store = db.store()
    await store.migrate()
    await store.start()
    llm = {"provider": "scripted", "turns": [{"text": "Still here."}]}
    old_body = {"id": "old", "agent": "worker", "llm": llm, "playout": {"words_per_second": 500}, "max_tool_steps": 1}
    await store.create_session(SessionRecord(id="old", agent="worker", state="active", config=old_body))
    await store.create_session(SessionRecord(id="bare", agent="worker", state="active", config={}))
    await store.aclose()
    proc = await Proc(db, AGENTS).start()
    try:
        assert sorted(proc.host.recovered) == ["bare", "old"] and proc.host.failed == []
        assert proc.host.sessions["old"].options.max_tool_steps == 1
        assert proc.host.sessions["old"].options.shutdown_tool_grace_s == 0  # the server's setting, not the default
        await proc.host.sessions["old"].input("hello?")
        await proc.said("old", "Still here.")
    finally:
        await proc.stop()


async def test_recovery_leaves_what_was_frozen_frozen(db: Db) -> None:
    """The server freezes what exists when it starts (``gc.freeze``: kept out of every later full collection). A
    recovery that moved its own objects to the oldest generation by a freeze and an unfreeze thawed all of it, at
    every recovery and adoption round (and made the simulations, whose drivers freeze their imports, 3x slower)."""
    first = await Proc(db, AGENTS).start()
    await first.create("s", [{"text": "Noted."}])
    await first.host.sessions["s"].input("hello")
    await first.said("s", "Noted.")
    await first.idle("s")
    await first.stop()

    thawed_before = gc.get_freeze_count() == 0
    gc.freeze()
    frozen = gc.get_freeze_count()
    second = await Proc(db, AGENTS).start()  # recovers "s"
    try:
        assert second.host.recovered == ["s"]
        # what is frozen and freed meanwhile leaves the count: a thaw empties it
        assert gc.get_freeze_count() > frozen * 0.9, (gc.get_freeze_count(), frozen)
    finally:
        await second.stop()
        if thawed_before:
            gc.unfreeze()
