"""A session moved to another process (a drain, a graceful restart) keeps every obligation: what it owes is left
durable in the store, and the next owner, which knows only the store, pays it. A move never loses more than a
crash. Each test plays the first owner (suspended, as a drain does) and then the next one (recovered from the
store alone), with a scripted model on in-memory ports."""

from __future__ import annotations

import asyncio
from typing import Any

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import AgentHandoff, ChatMessage, FunctionCallOutput
from switchboard.runtime.memory import MemoryEventLog, MemoryStore
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Reported
from switchboard.runtime.recovery import RESTART_OUTPUT, recover
from switchboard.runtime.session import AgentSession
from switchboard.runtime.speech import SpeechState
from switchboard.runtime.status import SessionStatus
from switchboard.runtime.tools import ToolStatus
from tests.waiting import WAIT_S

from .harness import WPS, Harness

LONG = " ".join(f"w{i}" for i in range(300))  # 3 s at WPS
MEDIUM = " ".join(f"m{i}" for i in range(50))


class Booking(Agent):
    def __init__(self, gate: asyncio.Event | None = None) -> None:
        super().__init__(instructions="You book.")
        self.gate = gate or asyncio.Event()

    @function_tool  # cannot be cancelled: a drain gives it its grace to end
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something."""
        await self.gate.wait()
        return f"booked {what}"

    @function_tool
    async def lookup(self, ctx: RunContext) -> str:
        """Look something up in the background."""
        await ctx.update("looking", progress=0.1)
        await self.gate.wait()
        return "found it"


class Billing(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You bill.")

    async def on_enter(self) -> None:
        await self.session.say("Billing here.")


class Front(Agent):
    def __init__(self, gate: asyncio.Event | None = None) -> None:
        super().__init__(instructions="You route.")
        self.gate = gate or asyncio.Event()

    @function_tool
    async def refund(self, ctx: RunContext) -> tuple[Agent, str]:
        """Refund, then hand over to billing."""
        return Billing(), "refund issued"

    @function_tool
    async def audit(self, ctx: RunContext) -> str:
        """A long audit in the background (cannot be cancelled)."""
        await ctx.update("auditing")
        await self.gate.wait()
        return "audited"


def _first(agent: Agent, turns: list[dict[str, Any]], *, grace_s: float = 2.0) -> Harness:
    return Harness(agent, turns, shutdown_tool_grace_s=grace_s)


async def _next_owner(first: Harness, agent: Agent, turns: list[dict[str, Any]]) -> Harness:
    """A new process: a session rebuilt from ``first``'s store alone, recovered, with its own scripted model."""
    h = Harness(agent, turns)
    store: MemoryStore = first.store
    events: MemoryEventLog = first.events
    h.store, h.events = store, events
    state = store.sessions.get(first.sid)
    h.session = AgentSession(
        session_id=first.sid,
        agent=agent,
        llm=h.llm,
        playout=SimulatedPlayout(WPS),
        store=store,
        events=events,
        options=SessionOptions(trust_model_call_ids=True),
        items=store.chat(first.sid),
        last_seq=events.events[first.sid][-1].seq,
        entered=state.entered if state is not None else True,
    )
    await recover(
        h.session,
        tool_calls=list(store.tool_calls[first.sid].values()),
        speeches=list(store.speeches[first.sid].values()),
        reported=Reported.of(events.events[first.sid]),
    )
    return h


def _assistant(h: Harness) -> list[str]:
    return [it.text for it in h.store.chat(h.sid) if isinstance(it, ChatMessage) and it.role == "assistant"]


async def test_a_reply_still_thinking_when_the_session_moves_is_answered_by_the_next_owner() -> None:
    first = _first(Booking(), [{"text": "never heard", "ttft_ms": 5000}])
    await first.session.start()
    res = await first.session.input("are you there?")
    await first.wait_for("generation.started")
    await first.session.suspend()  # the drain, while the model has not answered yet
    assert first.store.speeches[first.sid][res.speech_id].state != SpeechState.DONE  # owed, not ended

    nxt = await _next_owner(first, Booking(), [{"text": "Yes, I am here."}])
    try:
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        assert _assistant(nxt) == ["Yes, I am here."]
        recovered = nxt.of_type("session.recovered")[-1].data
        assert recovered["resumed_speeches"] == [res.speech_id]
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


async def test_a_result_that_lands_during_a_move_is_replied_to_by_the_next_owner() -> None:
    agent = Booking()
    first = _first(agent, [{"text": "Booking.", "tool_calls": [{"name": "book", "arguments": {"what": "a table"}}]}])
    await first.session.start()
    await first.session.input("book a table")
    await first.wait_for("tool.started")
    await first.wait_for("chat.item", lambda e: e.data["item"].get("text") == "Booking.")

    async def complete_within_grace() -> None:
        await asyncio.sleep(0.1)
        agent.gate.set()

    done = asyncio.create_task(complete_within_grace())
    await first.session.suspend()  # the drain: the call gets its grace and commits its pair
    await done
    ended = [c for c in first.store.tool_calls[first.sid].values() if c.name == "book"]
    assert ended[0].status == ToolStatus.COMPLETED

    nxt = await _next_owner(first, Booking(), [{"text": "Your table is booked: {{tool_output:book}}."}])
    try:
        await nxt.wait_for("chat.item", lambda e: "Your table is booked" in str(e.data["item"].get("text")))
        assert _assistant(nxt)[-1] == "Your table is booked: booked a table."
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


async def test_a_background_result_that_lands_during_a_move_gets_its_deferred_reply() -> None:
    agent = Booking()
    turns = [{"text": "Let me look.", "tool_calls": [{"name": "lookup"}]}, {"text": "Still looking."}]
    first = _first(agent, turns)
    await first.session.start()
    await first.session.input("look it up")
    await first.wait_for("tool.progress")
    await first.idle()  # the reply is over; the lookup runs on in the background

    async def complete_within_grace() -> None:
        await asyncio.sleep(0.1)
        agent.gate.set()

    done = asyncio.create_task(complete_within_grace())
    await first.session.suspend()
    await done
    owed = [sp for sp in first.store.speeches[first.sid].values() if sp.source == "deferred_reply"]
    assert [sp.state for sp in owed] == [SpeechState.SCHEDULED]  # written with the result, in its transaction

    nxt = await _next_owner(first, Booking(), [{"text": "Found: {{tool_output:lookup}}."}])
    try:
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == owed[0].id)
        assert _assistant(nxt)[-1] == "Found: found it."
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


async def test_a_handoff_under_way_when_the_session_moves_keeps_its_result_and_is_done() -> None:
    """The tool did its work (the refund went out) and asked for a handoff, which waits for the agent's other call;
    a drain comes. The result is committed with the handoff, and the new agent enters where the session runs next."""
    agent = Front()
    turns = [
        {"text": "Checking.", "tool_calls": [{"name": "audit"}]},
        {"text": "Auditing in the background."},
        {"text": "Refunding.", "tool_calls": [{"name": "refund"}]},
    ]
    first = _first(agent, turns, grace_s=0.2)  # the audit outlasts the grace
    await first.session.start()
    await first.session.input("audit")
    await first.wait_for("tool.started", lambda e: e.data["name"] == "audit")
    await first.idle()
    await first.session.input("refund please", interrupt=False)
    await first.wait_for("tool.started", lambda e: e.data["name"] == "refund")
    await asyncio.sleep(0.2)  # the refund returned; its handoff waits for the audit
    await first.session.suspend()

    calls = {c.name: c for c in first.store.tool_calls[first.sid].values()}
    assert calls["refund"].status == ToolStatus.COMPLETED and calls["refund"].output == "refund issued"
    assert any(isinstance(it, AgentHandoff) for it in first.store.chat(first.sid))
    state = first.store.sessions[first.sid]
    assert state.agent == "billing" and not state.entered  # its on_enter is owed
    assert state.state == SessionStatus.ACTIVE  # live in the store, for its next owner (never stored `suspended`)

    nxt = await _next_owner(first, Billing(), [])
    try:
        await nxt.wait_for("chat.item", lambda e: e.data["item"].get("text") == "Billing here.")
        outputs = [it for it in nxt.store.chat(nxt.sid) if isinstance(it, FunctionCallOutput) and it.name == "refund"]
        assert [o.output for o in outputs] == ["refund issued"]  # one output, the result (I1, I5)
        audit = nxt.store.tool_calls[nxt.sid][calls["audit"].call_id]
        assert audit.status == ToolStatus.INTERRUPTED and audit.output == RESTART_OUTPUT
    finally:
        agent.gate.set()
        await nxt.session.aclose()
    nxt.check_invariants()


async def test_input_that_arrives_during_a_move_is_accepted_and_answered_by_the_next_owner() -> None:
    agent = Booking()
    first = _first(agent, [{"text": "Booking.", "tool_calls": [{"name": "book", "arguments": {"what": "x"}}]}])
    await first.session.start()
    await first.session.input("book")
    await first.wait_for("tool.started")
    suspending = asyncio.create_task(first.session.suspend())  # the booking holds the drain in its grace
    await asyncio.sleep(0.05)
    res = await first.session.input("and a taxi too", interrupt=True)  # I3: never dropped
    agent.gate.set()
    await suspending
    assert first.store.speeches[first.sid][res.speech_id].state == SpeechState.SCHEDULED

    nxt = await _next_owner(first, Booking(), [{"text": "Booked, and a taxi."}])
    try:
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        assert "Booked, and a taxi." in _assistant(nxt)
        texts = [it.text for it in nxt.store.chat(nxt.sid) if isinstance(it, ChatMessage) and it.role == "user"]
        assert texts.count("and a taxi too") == 1
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


async def test_a_say_queued_when_the_session_moves_is_said_by_the_next_owner() -> None:
    first = _first(Booking(), [])
    await first.session.start()
    playing = await first.session.say(MEDIUM)
    queued = await first.session.say("Thank you for waiting.")
    await first.wait_for("speech.started")
    await first.session.suspend()

    nxt = await _next_owner(first, Booking(), [])
    try:
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == queued.id, timeout=WAIT_S)
        # the say under way when it moved is said again whole, and is in the chat once (one say, one message)
        assert _assistant(nxt) == [MEDIUM, "Thank you for waiting."]
        assert nxt.of_type("session.recovered")[-1].data["resumed_speeches"] == [playing.id, queued.id]
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


def _crashed(first: Harness) -> Harness:
    """What survives ``first``'s process dying now: a copy of its store and of its durable events (the first
    session, still running, writes only to the originals, as a dead process writes nothing more)."""
    copy = Harness(first.agent)
    copy.session = first.session
    copy.store, copy.events = MemoryStore(), MemoryEventLog()
    for sid, items in first.store.items.items():
        copy.store.items[sid] = list(items)
    for table in ("tool_calls", "speeches"):
        for sid, rows in getattr(first.store, table).items():
            getattr(copy.store, table)[sid] = dict(rows)
    copy.store.sessions = dict(first.store.sessions)
    for sid, events in first.events.events.items():
        copy.events.events[sid] = list(events)
    return copy


async def test_a_crash_while_a_reply_plays_owes_the_reply_as_a_move_does() -> None:
    """A crash (no suspend, nothing flushed) leaves the same obligation: the reply that was playing is answered
    again by the next owner."""
    first = _first(Booking(), [{"text": LONG}])
    await first.session.start()
    res = await first.session.input("tell me everything")
    await first.wait_for("speech.started")
    dead = _crashed(first)
    await first.session.aclose()

    nxt = await _next_owner(dead, Booking(), [{"text": "In short: all is well."}])
    try:
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        assert _assistant(nxt)[-1] == "In short: all is well."
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


async def test_input_and_speeches_a_crash_left_without_their_events_get_them_on_recovery() -> None:
    """The commit of an input (its message and its reply's speech) landed, and the process died before its events
    did: the next owner reports them (I6: nothing durable without its event), and answers the input."""
    first = _first(Booking(), [{"text": "never heard", "ttft_ms": 5000}])
    await first.session.start()
    res = await first.session.input("hello?")
    say = await first.session.say("One moment.")
    await first.wait_for("generation.started")
    dead = _crashed(first)
    log = dead.events.events[first.sid]
    cut = next(i for i, e in enumerate(log) if e.type == "user.input")
    dead.events.events[first.sid] = log[:cut]  # the events of the input and after it never became durable
    await first.session.aclose()

    nxt = await _next_owner(dead, Booking(), [{"text": "Hello!"}])
    try:
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == say.id)
        inputs = [e.data for e in nxt.of_type("user.input")]
        assert [(d["item_id"], d["text"], d["final"]) for d in inputs] == [(res.item_id, "hello?", True)]
        created = sorted(e.data["speech_id"] for e in nxt.of_type("speech.created"))
        assert created == sorted([res.speech_id, say.id])
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


async def _crash_after_the_message_of(first: Harness, text: str) -> list[Harness]:
    """Arrange for ``first``'s process to die right after the commit that holds the assistant message ``text``
    lands, before anything after it (the speech's own end) does; the list gets what survives."""
    dead: list[Harness] = []
    write = first.store.write

    async def write_then_die(session_id: str, commit: Any) -> None:
        await write(session_id, commit)
        said = any(isinstance(it, ChatMessage) and it.role == "assistant" and it.text == text for it in commit.items)
        if said and not dead:
            dead.append(_crashed(first))

    first.store.write = write_then_die  # type: ignore[method-assign]
    return dead


async def test_a_say_heard_whole_is_not_said_again_when_its_end_was_not_yet_written() -> None:
    """The say's message is committed once it was heard whole; the process dies before the speech's end lands. The
    next owner must not say it again: the chat would hold it twice (one command, two effects)."""
    first = _first(Booking(), [])
    await first.session.start()
    dead = await _crash_after_the_message_of(first, "Thank you for waiting.")
    say = await first.session.say("Thank you for waiting.")
    await first.wait_for("speech.done", lambda e: e.data["speech_id"] == say.id)
    await first.session.aclose()
    assert dead, "the say's message was never committed"

    nxt = await _next_owner(dead[0], Booking(), [])
    try:
        await nxt.wait_for("session.recovered")
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == say.id)
        assert _assistant(nxt) == ["Thank you for waiting."]
        assert nxt.of_type("session.recovered")[-1].data["resumed_speeches"] == []
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()


async def test_a_reply_heard_whole_is_not_answered_again_when_its_end_was_not_yet_written() -> None:
    first = _first(Booking(), [{"text": "All booked."}])
    await first.session.start()
    dead = await _crash_after_the_message_of(first, "All booked.")
    res = await first.session.input("book it")
    await first.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
    await first.session.aclose()
    assert dead, "the reply's message was never committed"

    nxt = await _next_owner(dead[0], Booking(), [{"text": "All booked, again."}])
    try:
        await nxt.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        assert _assistant(nxt) == ["All booked."]
    finally:
        await nxt.session.aclose()
    nxt.check_invariants()
