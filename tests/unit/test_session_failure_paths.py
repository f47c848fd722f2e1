"""A session on its failure paths: write errors, callers cut off mid-command, close and suspend racing commands,
stale speculative replies, and what a graceful restart owes the user."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.events import Event
from switchboard.runtime.memory import MemoryEventLog, MemoryStore
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Commit
from switchboard.runtime.recovery import recover
from switchboard.runtime.session import AgentSession
from switchboard.runtime.speech import SpeechHandle, SpeechState
from switchboard.runtime.status import SessionClosed
from tests.waiting import WAIT_S

from .harness import WPS, Harness

LONG = " ".join(f"word{i}" for i in range(40))


class Plain(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")


class Faulty(MemoryStore):
    """A store whose writes can be held (a stalled database) or rejected for good, chosen by what they carry."""

    def __init__(self) -> None:
        super().__init__()
        self.hold_items = False  # hold writes that carry chat items until ``release`` is set
        self.holding = asyncio.Event()
        self.release = asyncio.Event()
        self.reject_speech_end = 0  # reject this many writes of a speech's own end (the write after its last message)
        self.rejecting = asyncio.Event()  # set when a write that ends a speech is about to be rejected
        self.reject_after_s = 0.0  # how long the store takes to reject it

    async def write(self, session_id: str, commit: Commit) -> None:
        ends = not commit.items and any(sp.state == SpeechState.DONE for sp in commit.speeches)
        if self.reject_speech_end and ends:
            self.reject_speech_end -= 1
            self.rejecting.set()
            await asyncio.sleep(self.reject_after_s)
            raise ValueError("rejected by the store")
        if self.hold_items and commit.items:
            self.holding.set()
            await self.release.wait()
        await super().write(session_id, commit)


def harness(turns: list[dict] | None = None, **options: object) -> Harness:
    h = Harness(Plain(), turns, **options)
    h.store = Faulty()
    h.session.writes.store = h.store
    return h


def live_texts(h: Harness) -> list[str]:
    return [it.text for it in h.session.chat.items if isinstance(it, ChatMessage)]


def stored_texts(h: Harness) -> list[str]:
    return [it.text for it in h.chat() if isinstance(it, ChatMessage)]


async def test_a_rejected_speech_end_does_not_leave_the_session_deaf(caplog: pytest.LogCaptureFixture):
    async with harness() as h:
        first = await h.session.say("one two three")
        queued = await h.session.say("never played")
        queued.interrupt()  # ended without playing when its turn comes: that write is rejected
        h.store.reject_speech_end = 1
        await asyncio.wait_for(first.wait_done(), WAIT_S)
        await h.idle()
        res = await h.session.input("are you there?")
        started = await h.wait_for("generation.started", lambda e: e.data["speech_id"] == res.speech_id)
        assert started.data["step"] == 0
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
    assert "could not be written" in caplog.text


async def test_a_speech_end_rejected_once_is_still_written_and_reported():
    async with harness() as h:
        h.store.reject_speech_end = 1
        speech = await h.session.say("hello there")
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == speech.id)
        assert h.store.speeches[h.sid][speech.id].state == SpeechState.DONE
        h.check_invariants()


async def test_a_speech_end_the_store_keeps_rejecting_is_written_again_at_last_without_its_text():
    """Rejected again and again (a store refusing its text, or writes it shares a transaction with): the end is
    written again after a pause, the last attempts without the text, so the store never keeps a speech the live
    session has ended as unfinished (I8), and its speech.done is reported once it is durable (I6)."""
    async with harness() as h:
        h.store.reject_speech_end = 2
        speech = await h.session.say("hello there", add_to_chat=False)
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == speech.id, timeout=WAIT_S)
        stored = h.store.speeches[h.sid][speech.id]
        assert stored.state == SpeechState.DONE and not stored.interrupted
        assert stored.played_text == "" and speech.played_text == "hello there"
        h.check_invariants()


async def test_a_close_during_a_rejected_speech_end_is_the_last_write_and_reports_the_end_first():
    """A closed session is never recovered: a speech's end written again after a store error must land (and be
    reported) before the close, never after it, or nothing ever reports it."""
    async with harness() as h:
        h.store.reject_speech_end = 1
        h.store.reject_after_s = 0.05
        speech = await h.session.say("hello there", add_to_chat=False)
        await asyncio.wait_for(h.store.rejecting.wait(), WAIT_S)
        await h.session.aclose()
        types = [(e.type, e.data.get("speech_id")) for e in h.events.events[h.sid]]
        assert types[-1] == ("session.closed", None)
        assert ("speech.done", speech.id) in types
        assert h.store.speeches[h.sid][speech.id].state == SpeechState.DONE
        assert h.store.sessions[h.sid].state == "closed"


class LateEvents(MemoryEventLog):
    """An event sink that makes each event durable a while after it was emitted (a busy event writer)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.durable: list[Event] = []

    def publish(self, event: Event) -> Awaitable[None]:
        super().publish(event)
        durable: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def land() -> None:
            self.durable.append(event)
            durable.set_result(None)

        asyncio.get_running_loop().call_later(self.delay_s, land)
        return durable


async def test_a_suspend_returns_once_the_events_of_what_it_wrote_are_durable():
    """A shutdown flushes every pending write, events included: when suspend returns, what was heard of the speech
    it handed over is durable and so is its ``chat.item`` (nothing durable without its event, I6); the speech itself
    stays owed for the next owner."""
    async with harness([{"text": LONG}]) as h:
        late = LateEvents(0.2)
        h.session.events._sink = h.events = late  # from here on, events become durable late
        res = await h.session.input("talk")
        await h.wait_for("speech.started", lambda e: e.data["speech_id"] == res.speech_id)
        await asyncio.sleep(0.05)
        await h.session.suspend()
        heard = [it for it in h.store.chat(h.sid) if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert len(heard) == 1 and heard[0].interrupted
        assert ("chat.item", heard[0].id) in [(e.type, e.data.get("item", {}).get("id")) for e in late.durable]
        assert h.store.speeches[h.sid][res.speech_id].state != SpeechState.DONE


async def test_input_whose_caller_is_cut_off_during_a_stalled_commit_is_applied_live():
    async with harness() as h:
        h.store.hold_items = True
        caller = asyncio.create_task(h.session.input("book a table"))
        await asyncio.wait_for(h.store.holding.wait(), WAIT_S)
        caller.cancel()  # the request deadline fires while the database is stalled
        with pytest.raises(asyncio.CancelledError):
            await caller
        h.store.hold_items = False
        h.store.release.set()
        user = await h.wait_for("user.input", lambda e: e.data["final"])
        assert live_texts(h)[0] == "book a table" and stored_texts(h)[0] == "book a table"
        created = await h.wait_for("speech.created")
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == created.data["speech_id"])
        assert user.data["item_id"] == h.session.chat.items[0].id
        assert {it.id for it in h.session.chat.items} == {it.id for it in h.chat()}


async def test_a_forced_speech_cancel_during_a_slow_commit_keeps_the_message_live():
    async with harness([{"text": LONG}], interrupt_force_timeout_s=0.05) as h:
        forced_before = SpeechHandle.forced_cancels
        res = await h.session.input("talk", interrupt=False)
        await h.wait_for("speech.started", lambda e: e.data["speech_id"] == res.speech_id)
        await asyncio.sleep(0.05)
        h.store.hold_items = True  # the interrupted message's write stalls past the forced-cancel timeout
        h.store.release.clear()
        speech = h.session.speech(res.speech_id)
        assert speech is not None
        speech.interrupt()
        await asyncio.wait_for(h.store.holding.wait(), WAIT_S)
        await asyncio.sleep(0.2)
        assert SpeechHandle.forced_cancels == forced_before + 1
        SpeechHandle.forced_cancels = forced_before  # fired on purpose here
        h.store.hold_items = False
        h.store.release.set()
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        await h.idle()
        assert [it.id for it in h.session.chat.items] == [it.id for it in h.chat()]
        assert live_texts(h)[-1] == stored_texts(h)[-1]


async def test_close_racing_an_input_answers_it_fully_or_refuses_it():
    async with harness() as h:
        h.store.hold_items = True
        caller = asyncio.create_task(h.session.input("last words"))
        await asyncio.wait_for(h.store.holding.wait(), WAIT_S)
        closing = asyncio.create_task(h.session.aclose())
        await asyncio.sleep(0.01)
        h.store.hold_items = False
        h.store.release.set()
        res = await caller
        await asyncio.wait_for(closing, WAIT_S)
        done = [e.data["speech_id"] for e in h.of_type("speech.done")]
        assert res.speech_id in done, "an accepted input's speech must end, also when a close follows"
        assert h.store.speeches[h.sid][res.speech_id].state == SpeechState.DONE
        with pytest.raises(SessionClosed):
            await h.session.input("too late")


async def test_a_close_whose_caller_is_cancelled_still_closes():
    async with harness() as h:
        speech = await h.session.say(LONG)
        await h.wait_for("speech.started", lambda e: e.data["speech_id"] == speech.id)
        await asyncio.sleep(0.05)  # a few words heard
        h.store.hold_items = True  # the close's write of what was heard stalls
        closing = asyncio.create_task(h.session.aclose())
        await asyncio.wait_for(h.store.holding.wait(), WAIT_S)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        h.store.hold_items = False
        h.store.release.set()
        await h.wait_for("session.closed")
        assert h.store.sessions[h.sid].state == "closed"


async def test_suspend_racing_an_input_leaves_it_queued_for_recovery():
    async with harness() as h:
        await h.session.say(LONG, allow_interruptions=False)
        h.store.hold_items = True
        caller = asyncio.create_task(h.session.input("just before the deploy", interrupt=False))
        await asyncio.wait_for(h.store.holding.wait(), WAIT_S)
        suspending = asyncio.create_task(h.session.suspend())
        await asyncio.sleep(0.01)
        h.store.hold_items = False
        h.store.release.set()
        res = await caller
        await asyncio.wait_for(suspending, WAIT_S)
        stored = h.store.speeches[h.sid][res.speech_id]
        assert stored.state == SpeechState.SCHEDULED and not stored.interrupted
        h.session.state = "closed"  # stopped; nothing left for the harness to close


async def test_a_speculative_reply_is_not_used_when_a_speech_before_it_changed_the_context():
    turns = [{"text": "first answer"}]
    async with harness(turns, preemptive_generation=True) as h:
        say = await h.session.say(LONG, allow_interruptions=False)
        await h.wait_for("speech.started", lambda e: e.data["speech_id"] == say.id)
        await h.session.input("what time is it", final=False)
        # the final input cannot interrupt the say: the reply waits behind it, and the say's message lands first
        res = await h.session.input("what time is it")
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id, timeout=WAIT_S)
        started = [e.data for e in h.of_type("generation.started") if e.data["speech_id"] == res.speech_id]
        assert started == [{"speech_id": res.speech_id, "step": 0, "preemptive": False}]
        assert [r.preemptive for r in h.llm.requests] == [True, False]
        seen = [it.text for it in h.llm.requests[-1].items if isinstance(it, ChatMessage)]
        assert seen[:2] == [LONG, "what time is it"]


async def test_recovery_answers_input_accepted_just_before_a_restart():
    store = Faulty()
    first = AgentSession(
        session_id="s1",
        agent=Plain(),
        llm=Harness(Plain()).llm,
        playout=SimulatedPlayout(WPS),
        store=store,
        events=Harness(Plain()).events,
        options=SessionOptions(),
    )
    await first.start()
    busy = await first.say(LONG, allow_interruptions=False)
    res = await first.input("hello?", interrupt=False)  # 202: queued behind the say
    await first.suspend()  # the deploy
    assert busy.done and store.speeches["s1"][res.speech_id].state == SpeechState.SCHEDULED

    h = Harness(Plain(), [{"text": "hello again"}])
    h.store = store
    h.session = AgentSession(
        session_id="s1",
        agent=Plain(),
        llm=h.llm,
        playout=SimulatedPlayout(WPS),
        store=store,
        events=h.events,
        options=SessionOptions(),
        items=store.chat("s1"),
    )
    await recover(h.session, tool_calls=[], speeches=list(store.speeches["s1"].values()))
    try:
        started = await h.wait_for("generation.started", lambda e: e.data["speech_id"] == res.speech_id)
        assert started.data["step"] == 0
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        assert stored_texts(h)[-1] == "hello again"
        recovered = h.of_type("session.recovered")[0].data
        assert res.speech_id not in recovered["interrupted_speeches"]
    finally:
        await h.session.aclose()


class Booking(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="books")

    @function_tool
    async def book(self, ctx: RunContext) -> str:
        """Book (cannot be cancelled)."""
        await asyncio.sleep(0.1)
        return "booked"


async def test_shutdown_lets_a_call_that_cannot_be_cancelled_finish_within_its_grace():
    turns = [{"text": "", "tool_calls": [{"name": "book", "arguments": {}}]}]
    async with Harness(Booking(), turns, shutdown_tool_grace_s=2.0) as h:
        await h.session.input("book it")
        await h.wait_for("tool.started")
        await h.session.suspend()
        (info,) = h.store.tool_calls[h.sid].values()
        assert info.status == "completed" and info.output == "booked"
        h.session.state = "closed"  # stopped; nothing left for the harness to close
