"""An operator's takeover: the speech under way is interrupted, the model is asked for nothing while the operator
holds the session (input is committed, not answered; tools run on with their policies), the operator's words are
spoken as the agent, and the hand-back leaves a note for the model and answers what is left unanswered."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime import event_types as ev
from switchboard.runtime.chat import ChatMessage, utcnow
from switchboard.runtime.memory import MemoryEventLog, MemoryStore
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Reported
from switchboard.runtime.recovery import recover
from switchboard.runtime.session import AgentSession
from switchboard.runtime.speech import SpeechInfo, SpeechState
from switchboard.runtime.status import SessionClosed
from switchboard.runtime.takeover import HeldByOther, NotHeld, unanswered
from switchboard.runtime.tools import ToolStatus
from tests.waiting import WAIT_S

from .harness import WPS, Harness

# a speech that outlasts whatever a test does while it plays, however loaded the machine (60 s at the harness's
# 100 words a second, real time): the takeover is what ends it
LONG = " ".join(f"word{i}" for i in range(6000))
# a speech a test lets end by itself (under a second)
STORY = " ".join(f"word{i}" for i in range(60))


class Desk(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.release = asyncio.Event()
        self.booked: list[str] = []

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something (slow, not cancellable)."""
        await self.release.wait()
        self.booked.append(what)
        return f"booked {what}"

    @function_tool
    async def watch(self, ctx: RunContext, what: str) -> str:
        """Watch something in the background."""
        await ctx.update(f"watching {what}")
        await self.release.wait()
        return f"{what} is fine"


def requests(h: Harness) -> int:
    return len(h.llm.requests)


async def until(cond: Any) -> None:
    async with asyncio.timeout(WAIT_S):
        while not cond():
            await asyncio.sleep(0.005)


async def test_takeover_during_speech_holds_input_and_speaks_the_operators_words():
    async with Harness(Desk(), [{"text": LONG}, {"text": "Back to you: I can help with that."}]) as h:
        await h.session.input("tell me a story")
        await h.wait_for("speech.started")
        await asyncio.sleep(0.05)
        hold = await h.session.take_over("alice")
        assert hold.operator == "alice" and h.session.seat.hold == hold
        assert h.store.sessions[h.sid].takeover == hold  # durable with the session
        taken = h.of_type("session.taken_over")[0]
        assert taken.data["operator"] == "alice" and "interrupted_speech_id" in taken.data
        heard = [it for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert len(heard) == 1 and heard[0].interrupted and len(heard[0].text.split()) < len(LONG.split())

        asked = requests(h)
        result = await h.session.input("is anyone there?")
        assert result.item_id is not None and result.speech_id is None  # committed, not answered
        speech = await h.session.operator_say("alice", "Hi, this is Alice from support.")
        await h.idle()
        assert speech.source == "operator"
        spoke = await h.wait_for("operator.spoke")
        assert spoke.data["operator"] == "alice" and spoke.data["text"] == "Hi, this is Alice from support."
        assert spoke.data["speech_id"] == speech.id
        assert requests(h) == asked  # the model was asked for nothing while held

        await h.session.input("thanks, and my refund?")
        assert requests(h) == asked
        back = await h.session.hand_back("alice")
        assert back.speech_id is not None  # the user's last input is answered by the agent
        await h.idle()
        assert requests(h) == asked + 1
        assert h.summary()[-4:] == [
            ("assistant", "Hi, this is Alice from support."),
            ("user", "thanks, and my refund?"),
            ("developer", h.chat()[-2].text),
            ("assistant", "Back to you: I can help with that."),
        ]
        note = h.chat()[-2]
        assert isinstance(note, ChatMessage) and "human operator (alice)" in note.text
        assert h.llm.requests[-1].items[-1] == note  # the model reads the note
        handed = h.of_type("session.handed_back")[0]
        assert handed.data["operator"] == "alice" and handed.data["reply_speech_id"] == back.speech_id
        assert h.store.sessions[h.sid].takeover is None
        assert h.session.seat.hold is None
        h.check_invariants()


async def test_handback_without_unanswered_input_queues_no_reply():
    async with Harness(Desk(), [{"text": "Hello there."}]) as h:
        await h.session.input("hi")
        await h.idle()
        await h.session.take_over("alice")
        await h.session.operator_say("alice", "Alice here, all sorted.")
        await h.idle()
        asked = requests(h)
        back = await h.session.hand_back("alice")
        assert back.speech_id is None
        await h.idle()
        assert requests(h) == asked
        assert "reply_speech_id" not in h.of_type("session.handed_back")[0].data
        h.check_invariants()


async def test_takeover_during_a_tool_call_lets_it_end_and_replies_only_after_handback():
    agent = Desk()
    turns = [
        {"text": "Booking.", "tool_calls": [{"id": "c1", "name": "book", "arguments": {"what": "table"}}]},
        {"text": "Done: {{tool_output:book}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("book a table")
        await until(lambda: h.session.tool_calls(ToolStatus.RUNNING))
        asked = requests(h)
        await h.session.take_over("alice")
        agent.release.set()  # the call keeps its policy: not cancellable, it runs on and commits its pair (I1)
        await h.tools_done()
        await h.idle()
        assert h.session.tool_call("c1").status == ToolStatus.COMPLETED
        assert ("output", "book", "booked table") in h.summary()
        assert requests(h) == asked  # no tool reply, no deferred reply while held
        back = await h.session.hand_back("alice")
        assert back.speech_id is not None  # the result is unanswered: the agent replies to it
        await h.idle()
        assert h.summary()[-1] == ("assistant", "Done: booked table")
        h.check_invariants()


async def test_a_background_result_while_held_gets_no_deferred_reply():
    agent = Desk()
    turns = [
        {"text": "Watching.", "tool_calls": [{"id": "c1", "name": "watch", "arguments": {"what": "the oven"}}]},
        {"text": "I am on it."},
        {"text": "Result: {{tool_output:watch}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("watch the oven")
        await h.wait_for("tool.progress")
        await h.idle()
        asked = requests(h)
        await h.session.take_over("alice")
        agent.release.set()
        await h.tools_done()
        await h.idle()
        assert requests(h) == asked
        await h.session.hand_back("alice")
        await h.idle()
        assert requests(h) == asked + 1
        assert h.summary()[-1] == ("assistant", "Result: the oven is fine")
        h.check_invariants()


async def test_a_second_operator_gets_a_conflict_unless_forced():
    async with Harness(Desk()) as h:
        first = await h.session.take_over("alice")
        assert await h.session.take_over("alice") == first  # the holder again: a heartbeat
        with pytest.raises(HeldByOther):
            await h.session.take_over("bob")
        with pytest.raises(HeldByOther):
            await h.session.operator_say("bob", "I am not the holder")
        with pytest.raises(HeldByOther):
            await h.session.hand_back("bob")
        second = await h.session.take_over("bob", force=True)
        assert second.operator == "bob" and second.displaced == "alice"
        assert h.of_type("session.taken_over")[-1].data["displaced"] == "alice"
        await h.session.hand_back("alice", force=True)
        assert h.of_type("session.handed_back")[-1].data["by"] == "alice"
        assert h.session.seat.hold is None


async def test_only_a_held_session_has_a_quiet_operator():
    async with Harness(Desk()) as h:
        later = utcnow() + timedelta(hours=1)
        assert h.session.seat.quiet_for_s(later) is None
        await h.session.take_over("alice")
        assert h.session.seat.quiet_for_s(later) >= 3599
        await h.session.operator_say("alice", "still here")
        assert h.session.seat.quiet_for_s(h.session.seat.last_seen) == 0
        await h.session.hand_back("alice")
        assert h.session.seat.quiet_for_s(later) is None


async def test_commands_that_need_a_hold_refuse_without_one():
    async with Harness(Desk()) as h:
        with pytest.raises(NotHeld):
            await h.session.hand_back("alice")
        with pytest.raises(NotHeld):
            await h.session.operator_say("alice", "hello")
        assert h.session.seat.hold is None
        assert not h.of_type("session.handed_back")


async def test_takeover_of_a_closed_session_is_refused():
    h = Harness(Desk())
    await h.session.start()
    await h.session.aclose()
    with pytest.raises(SessionClosed):
        await h.session.take_over("alice")
    with pytest.raises(SessionClosed):
        await h.session.hand_back("alice")


async def test_interim_input_starts_no_speculative_reply_while_held():
    async with Harness(Desk(), preemptive_generation=True) as h:
        await h.session.take_over("alice")
        await h.session.input("i want", final=False)
        await h.session.input("i want a table")
        await h.idle()
        assert requests(h) == 0
        assert not h.of_type("generation.speculative")


async def test_an_agent_reply_asked_for_while_held_is_held_back():
    async with Harness(Desk()) as h:
        await h.session.take_over("alice")
        speech = await h.session.generate_reply()
        await speech.wait_done()
        assert speech.interrupted and requests(h) == 0


def test_unanswered_reads_the_last_word():
    from switchboard.runtime.chat import message

    assert unanswered([message("user", "hi")])
    assert not unanswered([message("user", "hi"), message("assistant", "hello")])
    assert unanswered([message("assistant", "hello"), message("user", "and?"), message("developer", "note")])
    assert not unanswered([])


def _next_owner(h: Harness, turns: list[dict[str, Any]]) -> Harness:
    """The session rebuilt from the store alone, as the next process that runs it does."""
    store: MemoryStore = h.store
    events: MemoryEventLog = h.events
    state = store.sessions[h.sid]
    nxt = Harness(Desk(), turns)
    nxt.store, nxt.events = store, events
    nxt.session = AgentSession(
        session_id=h.sid,
        agent=nxt.agent,
        llm=nxt.llm,
        playout=SimulatedPlayout(WPS),
        store=store,
        events=events,
        options=SessionOptions(trust_model_call_ids=True, tool_cancel_grace_s=0.2),
        items=store.chat(h.sid),
        last_seq=events.events[h.sid][-1].seq,
        takeover=state.takeover,
    )
    return nxt


@pytest.mark.parametrize("how", ["drain", "crash"])
async def test_a_held_session_is_held_where_it_runs_next(how: str):
    h = Harness(Desk(), [{"text": "never"}], shutdown_tool_grace_s=0.05)
    await h.session.start()
    await h.session.take_over("alice")
    await h.session.input("hello?")
    await h.session.suspend(tool_grace=how == "drain")

    nxt = _next_owner(h, [{"text": "Hello, the agent is back."}])
    sid = h.sid
    await recover(
        nxt.session,
        tool_calls=list(nxt.store.tool_calls[sid].values()),
        speeches=list(nxt.store.speeches[sid].values()),
        reported=Reported.of(nxt.events.events[sid]),
    )
    try:
        assert nxt.session.seat.hold is not None and nxt.session.seat.hold.operator == "alice"
        await nxt.session.input("still there?")
        await nxt.idle()
        assert requests(nxt) == 0  # recovered held: no model turn
        await nxt.session.operator_say("alice", "Yes, Alice here.")
        await nxt.idle()
        await nxt.session.input("ok bye")
        await nxt.session.hand_back("alice")
        await nxt.idle()
        assert requests(nxt) == 1
        assert nxt.summary()[-1] == ("assistant", "Hello, the agent is back.")
        nxt.check_invariants()
    finally:
        await nxt.session.aclose()


async def test_an_owed_reply_recovered_while_held_is_held_back_then_answered_on_handback():
    h = Harness(Desk(), [{"text": "never", "ttft_ms": 10_000}])
    await h.session.start()
    await h.session.input("hi")  # its reply is owed: generating when the process stops
    await h.wait_for("generation.started")
    hold = await h.session.take_over("alice")
    # the takeover's commit is durable; the process stops before the interrupted reply's end is written (a crash)
    await h.session.suspend(tool_grace=False)
    state = h.store.sessions[h.sid]
    assert state.takeover == hold
    # and a deferred reply a tool's end made owed while held, which the crash stopped before it was played
    owed = SpeechInfo(
        id="speech_owed",
        source="deferred_reply",
        state=SpeechState.SCHEDULED,
        interrupted=False,
        allow_interruptions=True,
        text="",
        played_text="",
        created_at=utcnow(),
    )
    h.store.speeches[h.sid][owed.id] = owed

    nxt = _next_owner(h, [{"text": "Hi, how can I help?"}])
    sid = h.sid
    await recover(
        nxt.session,
        tool_calls=list(nxt.store.tool_calls[sid].values()),
        speeches=list(nxt.store.speeches[sid].values()),
        reported=Reported.of(nxt.events.events[sid]),
    )
    try:
        assert nxt.of_type("session.recovered")[-1].data["resumed_speeches"] == ["speech_owed"]
        await nxt.idle()
        assert requests(nxt) == 0
        assert nxt.store.speeches[sid]["speech_owed"].state == SpeechState.DONE  # held back: ended, not played
        back = await nxt.session.hand_back("alice")
        assert back.speech_id is not None
        await nxt.idle()
        assert nxt.summary()[-1] == ("assistant", "Hi, how can I help?")
        nxt.check_invariants()
    finally:
        await nxt.session.aclose()


async def test_a_media_edge_speaks_the_operators_words_and_a_barge_in_cuts_them():
    from switchboard.runtime.media import EdgePlayout

    from .test_media_edge import Setup

    playout = EdgePlayout(SimulatedPlayout(WPS))
    async with Harness(Desk(), [{"text": LONG}], playout=playout) as h:
        s = Setup(h, playout)
        await h.session.take_over("alice")
        speech = await h.session.operator_say("alice", "Hello, Alice speaking.")
        await s.until_sent("speech.end")
        assert s.text(speech.id) == "Hello, Alice speaking."
        await s.frame(type="playback.started", speech_id=speech.id)
        await s.frame(type="playback.finished", speech_id=speech.id, interrupted=False)
        await h.wait_for("operator.spoke")
        assert h.summary()[-1] == ("assistant", "Hello, Alice speaking.")

        second = await h.session.operator_say("alice", "One more thing about your order number")
        await s.until_sent("speech.end")
        await s.frame(type="playback.started", speech_id=second.id)
        await s.frame(type="playback.progress", speech_id=second.id, played_chars=len("One more thing"))
        await s.frame(type="user.speech_started")  # the user talks over the operator: cut like the agent
        await second.wait_done()
        assert second.interrupted
        spoke = h.of_type("operator.spoke")[-1].data
        assert spoke["speech_id"] == second.id and spoke["text"] == "One more thing"
        assert requests(h) == 0
        h.check_invariants()


async def test_an_operator_speech_cut_by_a_move_is_said_again_whole_where_the_session_runs_next():
    h = Harness(Desk(), shutdown_tool_grace_s=0.05)
    await h.session.start()
    await h.session.take_over("alice")
    speech = await h.session.operator_say("alice", STORY)
    await h.wait_for("speech.started", lambda e: e.data["speech_id"] == speech.id)
    await asyncio.sleep(0.05)
    await h.session.suspend()

    nxt = _next_owner(h, [])
    sid = h.sid
    await recover(
        nxt.session,
        tool_calls=list(nxt.store.tool_calls[sid].values()),
        speeches=list(nxt.store.speeches[sid].values()),
        reported=Reported.of(nxt.events.events[sid]),
    )
    try:
        await nxt.idle()
        said = [it for it in nxt.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert [m.text for m in said] == [STORY]  # once, whole: nothing of the cut first attempt
        spoke = nxt.of_type("operator.spoke")
        assert [e.data["speech_id"] for e in spoke] == [speech.id] and spoke[0].data["operator"] == "alice"
        assert requests(nxt) == 0
        nxt.check_invariants()
    finally:
        await nxt.session.aclose()


def _crash_before(h: Harness, event_type: str) -> None:
    """The process died after the last ``event_type``'s change was durable and before that event (and any later one)
    was written."""
    log = h.events.events[h.sid]
    cut = max(i for i, e in enumerate(log) if e.type == event_type)
    del log[cut:]


async def _recovered(h: Harness, turns: list[dict[str, Any]]) -> Harness:
    nxt = _next_owner(h, turns)
    sid = h.sid
    await recover(
        nxt.session,
        tool_calls=list(nxt.store.tool_calls[sid].values()),
        speeches=list(nxt.store.speeches[sid].values()),
        reported=Reported.of(nxt.events.events[sid]),
    )
    return nxt


async def test_a_takeover_whose_event_a_crash_lost_is_reported_by_recovery():
    h = Harness(Desk())
    await h.session.start()
    hold = await h.session.take_over("alice")
    await h.session.suspend(tool_grace=False)
    _crash_before(h, "session.taken_over")
    nxt = await _recovered(h, [])
    try:
        taken = nxt.of_type("session.taken_over")
        assert len(taken) == 1 and taken[0].data["operator"] == "alice"
        assert taken[0].data["since"] == ev.SessionTakenOver(operator="alice", since=hold.since).data()["since"]
        nxt.check_invariants()
    finally:
        await nxt.session.aclose()
    again = await _recovered(nxt, [])  # reported once: the next recovery emits nothing more
    try:
        assert len(again.of_type("session.taken_over")) == 1
    finally:
        await again.session.aclose()


async def test_a_handback_whose_event_a_crash_lost_is_reported_by_recovery():
    h = Harness(Desk())
    await h.session.start()
    await h.session.take_over("alice")
    await h.session.hand_back("alice")
    await h.session.suspend(tool_grace=False)
    _crash_before(h, "session.handed_back")
    nxt = await _recovered(h, [])
    try:
        back = nxt.of_type("session.handed_back")
        assert len(back) == 1 and back[0].data["operator"] == "alice"
        assert nxt.session.seat.hold is None
        assert len(nxt.of_type("session.taken_over")) == 1  # the one before the crash, not reported again
        nxt.check_invariants()
    finally:
        await nxt.session.aclose()


class RefusesTakeovers(MemoryStore):
    """A store that rejects, for good, the write that would make the session held."""

    async def write(self, session_id: str, commit: Any) -> None:
        if commit.session is not None and commit.session.takeover is not None:
            raise ValueError("rejected by the store")
        await super().write(session_id, commit)


async def test_a_takeover_the_store_rejects_leaves_the_session_to_its_agent():
    h = Harness(Desk(), [{"text": STORY}, {"text": "Still here."}])
    h.store = RefusesTakeovers()
    h.session.writes.store = h.store
    async with h:
        await h.session.input("talk")
        await h.wait_for("speech.started")
        with pytest.raises(ValueError):
            await h.session.take_over("alice")
        assert h.session.seat.hold is None and not h.session.seat.held
        assert not h.of_type("session.taken_over")
        result = await h.session.input("are you there?")
        assert result.speech_id is not None  # not deaf, not held: the agent answers
        await h.idle()
        assert h.summary()[-1] == ("assistant", "Still here.")
