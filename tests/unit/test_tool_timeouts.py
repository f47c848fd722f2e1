"""Per-tool timeouts (``function_tool(timeout_s=...)``): one terminal status, `failed`, whatever the body does."""

from __future__ import annotations

import asyncio

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import FunctionCallOutput
from switchboard.runtime.executor import AlreadyEnded

from .harness import Harness


class Clock(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()
        self.seen: list[str | None] = []

    @function_tool(timeout_s=0.2, allow_cancellation=True)
    async def cooperative(self, ctx: RunContext) -> str:
        """Waits cooperatively (``ctx.wait_if_not_cancelled``) past its timeout."""
        try:
            await ctx.wait_if_not_cancelled(self.gate.wait())
        finally:
            self.seen.append(ctx.cancel_reason)
        return "never"

    @function_tool(timeout_s=0.2)
    async def returns_when_stopped(self, ctx: RunContext) -> str:
        """Returns a result once it is stopped: the call failed all the same."""
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            return "a partial result"
        return "never"


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive"):

        @function_tool(timeout_s=0)
        async def nothing() -> None:
            """Nothing."""


async def test_a_cooperative_tool_past_its_timeout_ends_failed_not_cancelled() -> None:
    agent = Clock()
    turns = [{"text": "On it.", "tool_calls": [{"name": "cooperative", "arguments": {}, "id": "c1"}]}]
    async with Harness(agent, turns, fallback={"text": "{{tool_output:cooperative}}"}) as h:
        await h.session.input("go")
        await h.wait_for("tool.ended")
        await h.idle()
        h.check_invariants()
        ended = [(e.data["call_id"], e.data["status"]) for e in h.of_type("tool.ended")]
        assert ended == [("c1", "failed")]
        assert agent.seen == ["timed out"]
        outputs = [it.output for it in h.chat() if isinstance(it, FunctionCallOutput)]
        assert outputs == ["cooperative failed: it timed out after 0.2 s and was stopped."]
        assert h.summary()[-1] == ("assistant", "cooperative failed: it timed out after 0.2 s and was stopped.")
        with pytest.raises(AlreadyEnded):  # a late cancel changes nothing: one terminal status
            await h.session.cancel_tool("c1")


async def test_a_cancel_before_the_timeout_keeps_the_call_cancelled() -> None:
    agent = Clock()
    turns = [{"text": "On it.", "tool_calls": [{"name": "cooperative", "arguments": {}, "id": "c1"}]}]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        await h.wait_for("tool.started")
        info = await h.session.cancel_tool("c1")
        assert info.status == "cancelled"
        await asyncio.sleep(0.3)  # bound: past the 0.2 s timeout, which must not end the call a second time
        await h.idle()
        h.check_invariants()
        assert [e.data["status"] for e in h.of_type("tool.ended")] == ["cancelled"]


async def test_a_result_returned_after_the_timeout_is_not_the_calls_output() -> None:
    agent = Clock()
    turns = [{"text": "On it.", "tool_calls": [{"name": "returns_when_stopped", "arguments": {}, "id": "r1"}]}]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        await h.wait_for("tool.ended")
        await h.idle()
        h.check_invariants()
        assert [e.data["status"] for e in h.of_type("tool.ended")] == ["failed"]
        assert (
            h.store.tool_calls[h.sid]["r1"].output
            == "returns_when_stopped failed: it timed out after 0.2 s and was stopped."
        )
        assert h.store.tool_calls[h.sid]["r1"].error == "timed out after 0.2 s"
