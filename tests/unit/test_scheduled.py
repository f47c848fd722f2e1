"""Scheduled commands (input, say, interrupt at a point of the conversation) and coaching notes: each applies once at
its point, in arrival order, is durable until then (a drain or a crash keeps it, recovery applies it exactly once),
and is cancelled, reported, when the session closes first."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.memory import MemoryEventLog, MemoryStore
from switchboard.runtime.options import SessionOptions
from switchboard.runtime.pending import COACH_PREFIX, PendingCommand
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.ports import Reported
from switchboard.runtime.recovery import recover
from switchboard.runtime.scheduled import PendingEnded, TooManyPending, UnknownPending, UnknownToolCall
from switchboard.runtime.session import AgentSession
from switchboard.runtime.status import SessionClosed
from tests.waiting import WAIT_S

from .harness import WPS, Harness

# a speech that outlasts whatever a test does while it plays, however loaded the machine (60 s at the harness's
# 100 words a second, real time); a test that needs it over interrupts it
LONG = " ".join(f"word{i}" for i in range(6000))


class Gated(Agent):
    """A tool that runs until the test lets it end."""

    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()

    @function_tool
    async def lookup(self, ctx: RunContext, what: str) -> str:
        """Look something up."""
        await self.gate.wait()
        return f"found {what}"


def user_texts(h: Harness) -> list[str]:
    return [it.text for it in h.chat() if isinstance(it, ChatMessage) and it.role == "user"]


def stored(h: Harness, command_id: str) -> PendingCommand:
    return h.store.pending[h.sid][command_id]


async def test_input_at_idle_waits_for_the_speech_and_applies_once() -> None:
    async with Harness(Gated(), [{"text": LONG}, {"text": "second"}]) as h:
        await h.session.input("talk")
        await h.wait_for("speech.started")
        cmd = await h.session.scheduled.schedule("input", {"text": "later"}, at="idle")
        assert cmd.state == "pending" and stored(h, cmd.id).state == "pending"
        await h.wait_for("scheduled.created", lambda e: e.data["id"] == cmd.id)
        assert user_texts(h) == ["talk"]  # the speech plays on: it is not cut off
        assert stored(h, cmd.id).state == "pending"
        await h.session.interrupt()  # the speech ends: the agent is idle
        applied = await h.wait_for("scheduled.applied", lambda e: e.data["id"] == cmd.id)
        assert user_texts(h) == ["talk", "later"]
        ended = await h.wait_for("speech.done")
        assert ended.seq < applied.seq  # applied after the speech, never during it
        record = stored(h, cmd.id)
        assert record.state == "applied" and record.result["item_id"] == applied.data["item_id"]
        await h.idle()
        assert h.session.scheduled.pending == []
        assert len(h.of_type("scheduled.applied")) == 1
        h.check_invariants()


async def test_after_speech_says_after_the_current_speech_in_arrival_order() -> None:
    async with Harness(Gated(), [{"text": LONG}]) as h:
        res = await h.session.input("talk")
        await h.wait_for("speech.started")
        first = await h.session.scheduled.schedule("say", {"text": "one"}, at="after_speech")
        second = await h.session.scheduled.schedule("say", {"text": "two"}, at="after_speech")
        assert first.speech_id == res.speech_id
        assert h.of_type("scheduled.applied") == []  # the speech plays on
        await h.session.interrupt()
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == second.id)
        await h.idle()
        said = [it.text for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]
        *cut, one, two = said  # the interrupted speech is there if a word of it was heard
        assert [one, two] == ["one", "two"] and len(cut) <= 1 and all(LONG.startswith(c) for c in cut)
        ids = [e.data["id"] for e in h.of_type("scheduled.applied")]
        assert ids == [first.id, second.id]


async def test_after_tool_applies_when_the_call_ends() -> None:
    agent = Gated()
    turns = [{"text": "", "tool_calls": [{"id": "c1", "name": "lookup", "arguments": {"what": "x"}}]}]
    async with Harness(agent, turns, fallback={"text": "done"}) as h:
        await h.session.input("look")
        await h.wait_for("tool.started")
        cmd = await h.session.scheduled.schedule("say", {"text": "the lookup ended"}, at="after_tool", call_id="c1")
        await asyncio.sleep(0.05)
        assert stored(h, cmd.id).state == "pending"
        agent.gate.set()
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == cmd.id)
        ended = h.of_type("tool.ended")[0].seq
        assert h.wait_for  # the command applied after the call's end
        assert next(e for e in h.of_type("scheduled.applied")).seq > ended
        # a call that has already ended: at once
        late = await h.session.scheduled.schedule("say", {"text": "again"}, at="after_tool", call_id="c1")
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == late.id)
        with pytest.raises(UnknownToolCall):
            await h.session.scheduled.schedule("say", {"text": "x"}, at="after_tool", call_id="nope")


async def test_interrupt_after_tool_cuts_the_speech_playing_then() -> None:
    agent = Gated()
    turns = [{"text": LONG, "tool_calls": [{"id": "c1", "name": "lookup", "arguments": {"what": "x"}}]}]
    async with Harness(agent, turns) as h:
        await h.session.input("look")
        await h.wait_for("tool.started")
        cmd = await h.session.scheduled.schedule("interrupt", {}, at="after_tool", call_id="c1")
        await h.wait_for("speech.started")
        agent.gate.set()
        applied = await h.wait_for("scheduled.applied", lambda e: e.data["id"] == cmd.id)
        assert applied.data["interrupted"] is True
        await h.idle()
        h.check_invariants()


async def test_cancel_and_errors() -> None:
    async with Harness(Gated(), [{"text": LONG}]) as h:
        await h.session.input("talk")
        await h.wait_for("speech.started")
        cmd = await h.session.scheduled.schedule("say", {"text": "never"}, at="idle")
        cancelled = await h.session.scheduled.cancel(cmd.id)
        assert cancelled.state == "cancelled" and cancelled.reason == "cancelled_by_operator"
        assert stored(h, cmd.id).state == "cancelled"
        with pytest.raises(PendingEnded):
            await h.session.scheduled.cancel(cmd.id)
        with pytest.raises(UnknownPending):
            await h.session.scheduled.cancel("sched_nope")
        await h.session.interrupt()
        await h.idle()
        await asyncio.sleep(0.05)
        assert "never" not in [it.text for it in h.chat() if isinstance(it, ChatMessage)]
        assert h.of_type("scheduled.cancelled")[0].data == {
            "id": cmd.id,
            "kind": "say",
            "reason": "cancelled_by_operator",
        }


async def test_a_cap_on_pending_commands() -> None:
    async with Harness(Gated(), [{"text": LONG}]) as h:
        await h.session.input("talk")
        await h.wait_for("speech.started")
        h.session.scheduled.limit = 2
        await h.session.scheduled.schedule("say", {"text": "a"}, at="idle")
        await h.session.scheduled.schedule("say", {"text": "b"}, at="idle")
        with pytest.raises(TooManyPending):
            await h.session.scheduled.schedule("say", {"text": "c"}, at="idle")
        assert len(h.store.pending[h.sid]) == 2


async def test_close_cancels_what_is_pending_and_reports_it() -> None:
    h = Harness(Gated(), [{"text": LONG}])
    await h.session.start()
    await h.session.input("talk")
    await h.wait_for("speech.started")
    cmd = await h.session.scheduled.schedule("input", {"text": "too late"}, at="idle")
    note = await h.session.coach.coach("be brief")
    await h.session.aclose()
    for command_id in (cmd.id, note.id):
        assert stored(h, command_id).state == "cancelled"
        assert stored(h, command_id).reason == "session_closed"
    types = h.types()
    assert types[-1] == "session.closed"
    assert types.count("scheduled.cancelled") == 2
    assert "too late" not in user_texts(h)
    with pytest.raises(SessionClosed):
        await h.session.scheduled.schedule("say", {"text": "x"}, at="idle")


async def test_a_coaching_note_reaches_the_next_request_only_and_never_the_chat() -> None:
    turns = [{"text": "first {{coach}}"}, {"text": "second {{coach}}"}]
    async with Harness(Gated(), turns) as h:
        note = await h.session.coach.coach("offer the upgrade")
        coached = await h.wait_for("session.coached")
        assert coached.data == {"id": note.id, "note": "offer the upgrade"}
        await h.session.input("hello")
        await h.idle()
        await h.session.input("and?")
        await h.idle()
        said = [it.text for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert said == ["first offer the upgrade", "second <none>"]
        first, second = h.llm.requests[0], h.llm.requests[1]
        assert first.items[-1].id == note.id and first.items[-1].role == "system"  # the end of the context
        assert not any(it.id.startswith(COACH_PREFIX) for it in second.items)
        assert not any(it.id.startswith(COACH_PREFIX) for it in h.chat())  # not in the transcript
        assert not any(e.data.get("item", {}).get("id", "").startswith(COACH_PREFIX) for e in h.of_type("chat.item"))
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == note.id)
        assert stored(h, note.id).state == "applied"
        assert h.session.coach.pending == []


async def next_owner(h: Harness, agent: Agent, turns: list[dict[str, Any]]) -> Harness:
    """The session rebuilt from the store alone (another process, or this one restarted) and recovered."""
    nxt = Harness(agent, turns)
    store: MemoryStore = h.store
    events: MemoryEventLog = h.events
    nxt.store, nxt.events = store, events
    sid = h.sid
    nxt.session = AgentSession(
        session_id=sid,
        agent=agent,
        llm=nxt.llm,
        playout=SimulatedPlayout(WPS),
        store=store,
        events=events,
        options=SessionOptions(trust_model_call_ids=True, tool_cancel_grace_s=0.2),
        items=store.chat(sid),
        last_seq=events.events[sid][-1].seq,
    )
    await recover(
        nxt.session,
        tool_calls=list(store.tool_calls[sid].values()),
        speeches=list(store.speeches[sid].values()),
        reported=Reported.of(events.events[sid]),
        pending=[c for c in store.pending[sid].values() if c.pending],
    )
    return nxt


@pytest.mark.parametrize("how", ["drain", "crash"])
async def test_a_move_keeps_scheduled_commands_and_notes_and_applies_them_once(how: str) -> None:
    h = Harness(Gated(), [{"text": LONG}])
    await h.session.start()
    await h.session.input("talk")
    await h.wait_for("speech.started")
    cmd = await h.session.scheduled.schedule("input", {"text": "after the move"}, at="idle")
    note = await h.session.coach.coach("mention the refund")
    await h.session.suspend(tool_grace=how == "drain")
    assert stored(h, cmd.id).state == "pending" and stored(h, note.id).state == "pending"
    # the reply owed to "talk" is generated anew there: the next model request, the one the note is for
    nxt = await next_owner(h, Gated(), [{"text": "again: {{coach}}"}, {"text": "then: {{coach}}"}])
    third: Harness | None = None
    try:
        assert [c.id for c in nxt.session.scheduled.pending] == [cmd.id]
        await nxt.wait_for("scheduled.applied", lambda e: e.data["id"] == cmd.id)
        await nxt.idle()
        await nxt.wait_for("scheduled.applied", lambda e: e.data["id"] == note.id)
        await nxt.idle()
        assert user_texts(nxt).count("after the move") == 1
        said = [it.text for it in nxt.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert said[-2:] == ["again: mention the refund", "then: <none>"]
        assert stored(nxt, cmd.id).state == "applied" and stored(nxt, note.id).state == "applied"
        # a third owner finds nothing pending: applied exactly once
        await nxt.session.suspend()
        third = await next_owner(nxt, Gated(), [])
        assert third.session.scheduled.pending == [] and third.session.coach.pending == []
        assert user_texts(third).count("after the move") == 1
        third.check_invariants()
    finally:
        await (third or nxt).session.aclose()


async def test_an_applied_mark_lands_with_its_effect() -> None:
    """The commit that adds the scheduled input carries its applied record: one write, never one without the
    other (a crash between two writes would apply it twice)."""
    async with Harness(Gated(), []) as h:
        cmd = await h.session.scheduled.schedule("input", {"text": "now-ish", "reply": False}, at="idle")
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == cmd.id)
        carrying = [c for _, c in h.store.commits if any(it.type == "message" for it in c.items)]
        assert len(carrying) == 1
        marks = [r for r in carrying[0].receipts if getattr(r, "command", None) is not None]
        assert [m.command.id for m in marks] == [cmd.id]  # type: ignore[attr-defined]


async def test_a_store_failure_while_scheduling_leaves_nothing_pending() -> None:
    class Refusing(MemoryStore):
        async def write(self, session_id: str, commit: Any) -> None:
            if commit.pending:
                raise RuntimeError("disk full")
            await super().write(session_id, commit)

    h = Harness(Gated(), [])
    h.store = Refusing()
    h.session.writes.store = h.store
    await h.session.start()
    try:
        with pytest.raises(RuntimeError):
            await h.session.scheduled.schedule("say", {"text": "x"}, at="idle")
        assert h.session.scheduled.pending == []
        assert h.of_type("scheduled.created") == []
    finally:
        async with asyncio.timeout(WAIT_S):
            await h.session.aclose()


async def test_an_effect_the_store_refuses_cancels_the_command_without_its_effect() -> None:
    """The commit that carries a scheduled input and its applied mark is refused for good: neither lands, and the
    command ends cancelled (``failed``), reported; the commands after it still apply."""
    from switchboard.runtime.pending import PendingMark

    class RefusesMarkedInput(MemoryStore):
        async def write(self, session_id: str, commit: Any) -> None:
            if commit.items and any(isinstance(r, PendingMark) for r in commit.receipts):
                raise ValueError("rejected by the store")
            await super().write(session_id, commit)

    h = Harness(Gated(), [{"text": "hi"}])
    h.store = RefusesMarkedInput()
    h.session.writes.store = h.store
    await h.session.start()
    try:
        first = await h.session.scheduled.schedule("input", {"text": "refused"}, at="idle")
        second = await h.session.scheduled.schedule("say", {"text": "still said"}, at="idle")
        cancelled = await h.wait_for("scheduled.cancelled", lambda e: e.data["id"] == first.id)
        assert cancelled.data["reason"] == "failed"
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == second.id)
        assert stored(h, first.id).state == "cancelled"
        assert "refused" not in user_texts(h)
    finally:
        await h.session.aclose()


async def test_a_session_being_handed_over_keeps_its_commands_pending() -> None:
    """A cancel during a hand-over is refused (to be retried where the session runs next); a command accepted
    during it is durable for the next owner, and this process applies nothing more."""
    from switchboard.runtime.status import SessionSuspended

    h = Harness(Gated(), [{"text": LONG}])
    await h.session.start()
    await h.session.input("talk")
    await h.wait_for("speech.started")
    cmd = await h.session.scheduled.schedule("say", {"text": "later"}, at="idle")
    await h.session.suspend()
    with pytest.raises(SessionSuspended):
        await h.session.scheduled.cancel(cmd.id)
    assert stored(h, cmd.id).state == "pending"
    assert h.of_type("scheduled.applied") == []


async def test_recovery_reports_a_command_a_crash_left_without_its_event() -> None:
    """A crash between a scheduled command's write and its ``scheduled.created``: the next owner reports it, then
    applies it (nothing durable without its event, I6)."""
    from switchboard.runtime.chat import utcnow

    h = Harness(Gated(), [])
    await h.session.start()
    await h.session.suspend(tool_grace=False)  # the process stops (nothing more is written here)
    lost = PendingCommand(id="sched_lost", kind="say", at="idle", args={"text": "owed"}, created_at=utcnow())
    h.store.pending[h.sid][lost.id] = lost  # durable, its event never written
    nxt = await next_owner(h, Gated(), [])
    try:
        created = await nxt.wait_for("scheduled.created", lambda e: e.data["id"] == lost.id)
        applied = await nxt.wait_for("scheduled.applied", lambda e: e.data["id"] == lost.id)
        assert created.seq < applied.seq
        assert len(nxt.of_type("scheduled.created")) == 1
    finally:
        await nxt.session.aclose()


async def test_a_call_found_ended_in_the_store_applies_at_once() -> None:
    """A call this process no longer remembers (it keeps the latest ones) but the store has ended: at once."""
    async with Harness(Gated(), []) as h:
        cmd = await h.session.scheduled.schedule(
            "say", {"text": "after it"}, at="after_tool", call_id="c_old", ended_call=True
        )
        await h.wait_for("scheduled.applied", lambda e: e.data["id"] == cmd.id)
