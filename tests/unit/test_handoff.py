"""Scenario 13: agent handoff — draining agent-scoped calls, session-scoped calls surviving (I4, I1, I5)."""

from __future__ import annotations

import asyncio

from switchboard import Agent, RunContext, SpeechInterrupted, function_tool
from switchboard.runtime.chat import AgentHandoff, FunctionCallOutput
from tests.waiting import WAIT_S

from .harness import Harness

LONG = " ".join(f"word{i}" for i in range(40))


class Billing(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are billing.", name="billing")


class Front(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are the front desk.", name="front")
        self.session_gate = asyncio.Event()
        self.log: list[str] = []

    @function_tool(scope="session")
    async def export(self, ctx: RunContext, what: str) -> str:
        """A long export that survives a handoff."""
        await ctx.update(f"exporting {what}")
        await self.session_gate.wait()
        return f"exported {what}"

    @function_tool(allow_cancellation=True)
    async def search(self, ctx: RunContext, q: str) -> str:
        """A cancellable background search (agent-scoped)."""
        await ctx.update(f"searching {q}")
        try:
            await ctx.sleep(10)
        finally:
            self.log.append("search stopped")
        return "found"

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """A non-cancellable booking (agent-scoped): awaited by the handoff."""
        await asyncio.sleep(0.05)
        self.log.append("booked")
        return f"booked {what}"

    @function_tool
    async def transfer(self, ctx: RunContext) -> tuple[Agent, str]:
        """Transfer to billing."""
        self.log.append("transfer")
        return Billing(), "Transferring you to billing."

    @function_tool
    async def transfer_after_preamble(self, ctx: RunContext) -> Agent:
        """Transfer to billing once the preamble was heard."""
        await ctx.wait_for_playout()
        return Billing()

    @function_tool
    async def stubborn_transfer(self, ctx: RunContext) -> Agent:
        """Transfers even if the preamble was interrupted."""
        try:
            await ctx.wait_for_playout()
        except SpeechInterrupted:
            self.log.append("ignored interruption")
        return Billing()


async def test_I4_handoff_drains_agent_calls_and_session_call_reports_to_new_agent():
    agent = Front()
    turns = [
        {
            "text": "Starting.",
            "tool_calls": [
                {"name": "export", "arguments": {"what": "invoices"}, "id": "e1"},
                {"name": "search", "arguments": {"q": "plans"}, "id": "s1"},
                # in the same step: the step that answers the updates above may call no tool
                {"name": "book", "arguments": {"what": "call"}, "id": "b1"},
                {"name": "transfer", "id": "t1"},
            ],
        },
        {"text": "Billing here. {{tool_output:transfer}}"},
        {"text": "Your export: {{tool_output:export}}"},
    ]
    async with Harness(agent, turns) as h:
        first = await h.session.input("help")
        await h.wait_for("tool.ended", lambda e: e.data["call_id"] == "t1")
        assert h.session.agent.name == "billing"
        assert agent.log[0] == "transfer" and sorted(agent.log[1:]) == ["booked", "search stopped"]
        assert h.session.tool_call("s1").status == "cancelled"
        assert "agent handoff" in (h.session.tool_call("s1").output or "")
        assert h.session.tool_call("b1").status == "completed", "the non-cancellable call was awaited"
        assert h.session.tool_call("e1").status == "running", "the session-scoped call survives"
        ended = [e.data["call_id"] for e in h.of_type("tool.ended")]
        assert ended.index("s1") < ended.index("t1") and ended.index("b1") < ended.index("t1")
        await h.idle()

        handoffs = [it for it in h.chat() if isinstance(it, AgentHandoff)]
        assert [(it.from_agent, it.to_agent) for it in handoffs] == [("front", "billing")]
        ev = h.of_type("agent.handoff")
        assert [e.data for e in ev] == [{"from_agent": "front", "to_agent": "billing"}]
        # the tool reply after the transfer is generated with the new agent
        step1 = [r for r in h.llm.requests if r.speech_id == first.speech_id and r.step == 1]
        assert len(step1) == 1 and step1[0].instructions == "You are billing."
        assert ("assistant", "Billing here. Transferring you to billing.") in h.summary()
        assert h.store.sessions[h.sid].agent == "billing"

        agent.session_gate.set()
        await h.tools_done()
        await h.wait_for("speech.created", lambda e: e.data["source"] == "deferred_reply")
        await h.idle()
        e1 = h.session.tool_call("e1")
        assert e1.status == "completed" and e1.output == "exported invoices"
        deferred = h.llm.requests[-1]
        assert deferred.instructions == "You are billing."
        assert h.summary()[-1] == ("assistant", "Your export: exported invoices")
        # no deferred reply for the calls drained by the handoff
        assert [e.data["source"] for e in h.of_type("speech.created")] == ["reply", "deferred_reply"]
        h.check_invariants()


async def test_I4_handoff_with_agent_result_only():
    agent = Front()
    turns = [
        {"text": "One moment.", "tool_calls": [{"name": "transfer_after_preamble", "id": "t1"}]},
        {"text": "Billing: {{tool_output:transfer_after_preamble}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("billing please")
        await h.idle()
        assert h.session.agent.name == "billing"
        # a bare handoff: an empty output and no tool reply (the new agent would speak from its on_enter)
        assert h.session.tool_call("t1").output == ""
        assert h.summary() == [
            ("user", "billing please"),
            ("assistant", "One moment."),
            ("call", "transfer_after_preamble"),
            ("output", "transfer_after_preamble", ""),
            ("handoff", "front", "billing"),
        ]
        assert [(r.step, r.instructions) for r in h.llm.requests] == [(0, "You are the front desk.")]
        h.check_invariants()


async def test_I3_interrupted_handoff_leaves_agent_unchanged():
    agent = Front()
    turns = [
        {"text": LONG, "tool_calls": [{"name": "transfer_after_preamble", "id": "t1"}]},
        {"text": "Still the front desk."},
    ]
    async with Harness(agent, turns) as h:
        async with asyncio.timeout(WAIT_S):
            await h.session.input("billing please")
            await h.wait_for("tool.started")
            await asyncio.sleep(0.03)
            await h.session.input("no, stay", interrupt=True)
            await h.idle()
        assert h.session.agent.name == "front"
        t1 = h.session.tool_call("t1")
        assert t1.status == "interrupted" and t1.is_error
        outputs = [it for it in h.chat() if isinstance(it, FunctionCallOutput)]
        assert [(o.call_id, o.is_error) for o in outputs] == [("t1", True)]
        assert not any(isinstance(it, AgentHandoff) for it in h.chat())
        assert h.of_type("agent.handoff") == []
        assert h.summary()[-1] == ("assistant", "Still the front desk.")
        assert h.llm.requests[-1].instructions == "You are the front desk."
        h.check_invariants()


async def test_I3_handoff_returned_after_an_interruption_is_not_done():
    agent = Front()
    turns = [{"text": LONG, "tool_calls": [{"name": "stubborn_transfer", "id": "t1"}]}, {"text": "Front desk."}]
    async with Harness(agent, turns) as h:
        await h.session.input("billing please")
        await h.wait_for("tool.started")
        await asyncio.sleep(0.03)
        await h.session.interrupt()
        await h.tools_done()
        await h.idle()
        assert agent.log == ["ignored interruption"]
        assert h.session.agent.name == "front"
        t1 = h.session.tool_call("t1")
        assert t1.status == "interrupted" and t1.is_error and "not done" in (t1.output or "")
        assert not any(isinstance(it, AgentHandoff) for it in h.chat())
        h.check_invariants()


async def test_I5_two_handoffs_in_one_turn_do_not_deadlock():
    agent = Front()
    turns = [
        {"text": "Moving.", "tool_calls": [{"name": "transfer", "id": "t1"}, {"name": "transfer", "id": "t2"}]},
        {"text": "Billing here."},
    ]
    async with Harness(agent, turns, close_timeout_s=1.0) as h:
        await h.session.input("billing, billing")
        await h.tools_done(timeout=1.0)
        await h.idle(timeout=WAIT_S)
        assert h.session.agent.name == "billing"
        # one handoff at a time: the second is refused, and its result is kept with a note that it was not done
        outputs = sorted((c.status, c.is_error, c.output) for c in h.session.tool_calls())
        assert outputs == [
            ("completed", False, "Transferring you to billing."),
            (
                "completed",
                False,
                "Transferring you to billing.\n\n(The handoff to billing was not done: another handoff was in "
                "progress.)",
            ),
        ]
        handoffs = [it for it in h.chat() if isinstance(it, AgentHandoff)]
        assert [(it.from_agent, it.to_agent) for it in handoffs] == [("front", "billing")]
        assert h.summary()[-1] == ("assistant", "Billing here.")
        h.check_invariants()


class Stubborn(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are the front desk.", name="front")

    @function_tool
    async def book(self, ctx: RunContext) -> str:
        """A non-cancellable booking that ignores every request to stop."""
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if ctx.cancelled:
                    continue
                raise

    @function_tool
    async def transfer(self, ctx: RunContext) -> Agent:
        """Transfer to billing."""
        return Billing()


async def test_I5_close_during_a_handoff_ends_every_call_once():
    # the handoff waits for the booking to end; the close's timeout stops both, each ends once and no handoff is done
    turns = [{"text": "Moving.", "tool_calls": [{"name": "book", "id": "b1"}, {"name": "transfer", "id": "t1"}]}]
    h = Harness(Stubborn(), turns, close_timeout_s=0.2)
    async with h:
        await h.session.input("book, then billing")
        await h.wait_for("tool.started", lambda e: e.data["call_id"] == "t1")
        await asyncio.sleep(0.05)
        assert h.session.tool_call("t1").status == "running", "held until the booking ends"
    assert {c.call_id: c.status for c in h.session.tool_calls()} == {"b1": "interrupted", "t1": "interrupted"}
    assert h.session.agent.name == "front"
    assert not any(isinstance(it, AgentHandoff) for it in h.chat())
    assert h.of_type("agent.handoff") == []
    h.check_invariants()
