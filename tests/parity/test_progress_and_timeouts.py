"""LiveKit 1.8 and Pipecat 1.14 parity: silent progress, tools off on the step that answers an update, per-tool
timeouts, and which ends ask the model for nothing (docs/livekit-parity.md, section "Tools"), on the virtual clock.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.tools import ToolStatus

from ..unit.harness import Harness
from .clock import on_virtual_clock


class Desk(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()
        self.runs: list[tuple[str, Any]] = []

    @function_tool
    async def quiet_report(self, ctx: RunContext) -> str:
        """A long report whose updates are silent."""
        await ctx.update("gathering figures", progress=0.2, silent=True)
        await ctx.update("adding them up", progress=0.6, silent=True)
        await self.gate.wait()
        return "report ready"

    @function_tool
    async def loud_report(self, ctx: RunContext) -> str:
        """A long report whose first update is spoken about."""
        await ctx.update("gathering figures", progress=0.2)
        await self.gate.wait()
        return "report ready"

    @function_tool
    async def instant(self) -> str:
        """Answers at once."""
        return "instant answer"

    @function_tool(timeout_s=2)
    async def slow(self, ctx: RunContext) -> str:
        """Takes longer than its timeout and does not look at its context."""
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.runs.append(("slow", ctx.cancel_reason))
            raise
        return "never"

    @function_tool(timeout_s=2)
    async def slow_in_the_background(self, ctx: RunContext) -> str:
        """Moves to the background, then takes longer than its timeout."""
        await ctx.update("working", silent=True)
        await ctx.sleep(60)
        return "never"

    @function_tool(timeout_s=2)
    async def fast(self) -> str:
        """Ends well within its timeout."""
        return "fast answer"

    @function_tool(timeout_s=2, allow_cancellation=True)
    async def deaf(self, ctx: RunContext) -> str:
        """Ignores the cancellation of its timeout and returns once the gate opens."""
        while not self.gate.is_set():
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.runs.append(("deaf", "swallowed a cancellation"))
        return "finished anyway"

    @function_tool(allow_cancellation=True)
    async def watch(self, ctx: RunContext) -> str:
        """Watches in the background until cancelled."""
        await ctx.update("watching")
        await ctx.wait_if_not_cancelled(self.gate.wait())
        return "seen"

    @function_tool
    async def chatty(self, ctx: RunContext) -> str:
        """Reports a great many updates."""
        for n in range(200):
            await ctx.update(f"item {n}", silent=True)
        await self.gate.wait()
        return "all items"

    @function_tool
    async def lookup(self, ctx: RunContext) -> str:
        """A lookup that finishes once the gate opens."""
        await self.gate.wait()
        return "looked up"


def call(name: str, call_id: str, arguments: Any = None) -> dict[str, Any]:
    return {"name": name, "arguments": {} if arguments is None else arguments, "id": call_id}


def ended(h: Harness) -> dict[str, dict[str, Any]]:
    return {e.data["call_id"]: e.data for e in h.of_type("tool.ended")}


def outputs(h: Harness) -> dict[str, FunctionCallOutput]:
    return {it.call_id: it for it in h.chat() if isinstance(it, FunctionCallOutput)}


# -- silent progress (LiveKit 1.8: ctx.update(..., silent=True)) ---------------------------------------------------


@on_virtual_clock
async def test_a_silent_update_moves_the_call_to_the_background_without_a_reply_of_its_own() -> None:
    agent = Desk()
    turns = [
        {"text": "Let me look.", "tool_calls": [call("quiet_report", "q1")]},
        {"text": "Here: {{tool_output:quiet_report}}"},
    ]
    async with Harness(agent, turns, fallback={"text": "unexpected"}) as h:
        await h.session.input("report please")
        await h.wait_for("tool.progress", lambda e: e.data["message"] == "adding them up")
        await h.idle()
        assert len(h.llm.requests) == 1, "no step answers a silent update"
        # observers and the record have every update
        assert [e.data["message"] for e in h.of_type("tool.progress")] == ["gathering figures", "adding them up"]
        info = h.session.tool_call("q1")
        assert (
            info is not None
            and info.background
            and [p.message for p in info.progress]
            == [
                "gathering figures",
                "adding them up",
            ]
        )
        assert "q1/update/2" in outputs(h), "the model sees the latest progress when it next replies"
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        h.check_invariants()
        sources = [e.data["source"] for e in h.of_type("speech.created")]
        assert sources == ["reply", "deferred_reply"], "the result itself is answered"
        assert h.summary()[-1] == ("assistant", "Here: report ready")


@on_virtual_clock
async def test_the_step_that_answers_an_update_runs_with_tools_off() -> None:
    agent = Desk()
    turns = [
        {"text": "Let me look.", "tool_calls": [call("loud_report", "r1")]},
        # the model tries to poll the call it was just told runs in the background
        {"text": "It is running.", "tool_calls": [call("loud_report", "poll")]},
        {"text": "Here: {{tool_output:loud_report}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("report please")
        await h.wait_for("tool.progress")
        await h.idle()
        assert [(r.step, r.tool_choice) for r in h.llm.requests] == [(0, "auto"), (1, "none")]
        assert h.llm.requests[1].tools, "the tools are still described"
        assert [e.data["call_id"] for e in h.of_type("tool.started")] == ["r1"], "the poll is never made"
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        h.check_invariants()
        assert h.llm.requests[-1].tool_choice == "auto", "the reply to the result may call tools"
        assert h.summary()[-1] == ("assistant", "Here: report ready")


@on_virtual_clock
async def test_a_step_that_answers_only_ended_calls_may_call_tools() -> None:
    agent = Desk()
    turns = [{"text": "Let me look.", "tool_calls": [call("instant", "i1")]}, {"text": "Got it."}]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        await h.tools_done()
        await h.idle()
        assert [(r.step, r.tool_choice) for r in h.llm.requests] == [(0, "auto"), (1, "auto")]


@on_virtual_clock
async def test_many_updates_keep_the_models_context_bounded() -> None:
    agent = Desk()
    turns = [{"text": "Working.", "tool_calls": [call("chatty", "c1")]}]
    async with Harness(agent, turns, fallback={"text": "Done: {{tool_output:chatty}}"}) as h:
        await h.session.input("go")
        await h.wait_for("tool.progress", lambda e: e.data["message"] == "item 199")
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        h.check_invariants()
        seen = [it.call_id for it in h.llm.requests[-1].items if isinstance(it, FunctionCall)]
        assert len(seen) <= 5, seen
        assert validate(h.llm.requests[-1].items) == []
        assert len(h.of_type("tool.progress")) == 200, "observers get every update"


# -- per-tool timeouts (Pipecat 1.14) ------------------------------------------------------------------------------


@on_virtual_clock
async def test_a_call_past_its_timeout_ends_failed_and_the_model_is_asked_to_reply() -> None:
    loop = asyncio.get_running_loop()
    agent = Desk()
    turns = [{"text": "Checking.", "tool_calls": [call("slow", "s1")]}, {"text": "Sorry: {{tool_output:slow}}"}]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        started = loop.time()
        await h.wait_for("tool.ended")
        assert loop.time() - started == pytest.approx(2.0, abs=0.1)
        await h.idle()
        h.check_invariants()
        assert [(e.data["call_id"], e.data["status"]) for e in h.of_type("tool.ended")] == [("s1", "failed")]
        output = outputs(h)["s1"]
        assert output.is_error and output.output == "slow failed: it timed out after 2 s and was stopped."
        assert h.store.tool_calls[h.sid]["s1"].error == "timed out after 2 s"
        assert agent.runs == [("slow", "timed out")], "the body was cancelled, told why"
        assert [r.step for r in h.llm.requests] == [0, 1], "a tool reply step answers it"
        assert h.summary()[-1] == ("assistant", "Sorry: slow failed: it timed out after 2 s and was stopped.")


@on_virtual_clock
async def test_a_background_call_past_its_timeout_gets_a_deferred_reply() -> None:
    agent = Desk()
    turns = [{"text": "Checking.", "tool_calls": [call("slow_in_the_background", "b1")]}]
    async with Harness(agent, turns, fallback={"text": "Sorry: {{tool_output:slow_in_the_background}}"}) as h:
        await h.session.input("go")
        await h.wait_for("tool.ended")
        await h.idle()
        h.check_invariants()
        assert ended(h)["b1"]["status"] == "failed"
        assert outputs(h)["b1/final"].output.endswith("timed out after 2 s and was stopped.")
        assert [e.data["source"] for e in h.of_type("speech.created")] == ["reply", "deferred_reply"]


@on_virtual_clock
async def test_a_call_within_its_timeout_completes() -> None:
    agent = Desk()
    turns = [{"text": "Checking.", "tool_calls": [call("fast", "f1")]}, {"text": "OK."}]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        await h.tools_done()
        await asyncio.sleep(5)
        await h.idle()
        assert [(e.data["call_id"], e.data["status"]) for e in h.of_type("tool.ended")] == [("f1", "completed")]


@on_virtual_clock
async def test_a_timed_out_call_whose_tool_ignores_it_is_cancelling_then_ends_failed_once() -> None:
    agent = Desk()
    turns = [{"text": "Checking.", "tool_calls": [call("deaf", "d1")]}]
    async with Harness(agent, turns, fallback={"text": "unexpected"}) as h:
        await h.session.input("go")
        await h.wait_for("tool.cancelling")
        assert [e.data for e in h.of_type("tool.cancelling")] == [{"call_id": "d1", "reason": "timed out"}]
        assert h.session.tool_call("d1").status == "cancelling"
        assert [c.call_id for c in h.session.tool_calls(ToolStatus.RUNNING)] == ["d1"], "it can still act"
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        h.check_invariants()
        assert [(e.data["call_id"], e.data["status"]) for e in h.of_type("tool.ended")] == [("d1", "failed")]
        assert "timed out" in outputs(h)["d1"].output
        assert ("deaf", "swallowed a cancellation") in agent.runs


# -- ends that ask the model for nothing (Pipecat 1.14) ------------------------------------------------------------


@on_virtual_clock
async def test_an_interruption_never_asks_the_model_for_a_reply() -> None:
    agent = Desk()
    turns = [{"text": "Looking it up now.", "tool_calls": [call("lookup", "l1")]}]
    async with Harness(agent, turns, fallback={"text": "unexpected"}) as h:
        await h.session.input("go")
        await h.wait_for("tool.started")
        await h.session.interrupt()
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        await asyncio.sleep(5)
        await h.idle()
        h.check_invariants()
        assert ended(h)["l1"]["status"] == "completed", "the work is kept (I1)"
        assert len(h.llm.requests) == 1, "neither the interruption nor the call's later end asks for inference"


@on_virtual_clock
async def test_a_cancel_requested_by_the_model_never_asks_for_a_reply_of_its_own() -> None:
    agent = Desk()
    turns = [
        {"text": "Watching.", "tool_calls": [call("watch", "w1")]},
        {"text": "It is watching."},
        {"text": "Stopping it.", "tool_calls": [call("cancel_tool_call", "k1", {"call_id": "w1"})]},
        {"text": "Stopped."},
    ]
    async with Harness(agent, turns, fallback={"text": "unexpected"}) as h:
        await h.session.input("watch")
        await h.wait_for("tool.progress")
        await h.idle()
        await h.session.input("stop watching")
        await h.wait_for("tool.ended", lambda e: e.data["call_id"] == "k1")
        await h.tools_done()
        await h.idle()
        await asyncio.sleep(5)
        await h.idle()
        h.check_invariants()
        assert ended(h)["w1"]["status"] == "cancelled"
        assert [e.data["source"] for e in h.of_type("speech.created")] == ["reply", "reply"]
        assert len(h.llm.requests) == 4, "the cancel tool's result is answered, the cancelled call's end is not"
        assert h.summary()[-1] == ("assistant", "Stopped.")


@on_virtual_clock
async def test_an_operator_cancel_of_a_background_call_is_still_answered() -> None:
    agent = Desk()
    turns = [{"text": "Watching.", "tool_calls": [call("watch", "w1")]}, {"text": "It is watching."}]
    async with Harness(agent, turns, fallback={"text": "It was cancelled."}) as h:
        await h.session.input("watch")
        await h.wait_for("tool.progress")
        await h.idle()
        await h.session.cancel_tool("w1")
        await h.tools_done()
        await h.idle()
        h.check_invariants()
        assert [e.data["source"] for e in h.of_type("speech.created")] == ["reply", "deferred_reply"]
