"""Agents used by the API and end-to-end tests (loaded by the server with SWITCHBOARD_AGENTS)."""

from __future__ import annotations

import asyncio

from switchboard import Agent, RunContext, StopResponse, ToolError, function_tool


class Other(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are the other agent.")


class Tester(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are the test agent.")

    @function_tool(on_duplicate="reject")
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something at once."""
        return f"booked {what}"

    @function_tool
    async def slow(self, ctx: RunContext, seconds: float) -> str:
        """Work for a while; cannot be cancelled."""
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @function_tool(on_restart="retry")
    async def rerun(self, ctx: RunContext, seconds: float) -> str:
        """Work for a while; run again from the start when its process died meanwhile."""
        await asyncio.sleep(seconds)
        return f"reran {seconds}"

    @function_tool(allow_cancellation=True)
    async def search(self, ctx: RunContext, query: str, seconds: float = 5.0) -> str:
        """A long search that can be cancelled."""
        await ctx.update(f"searching {query}", progress=0.0)
        await ctx.sleep(seconds)
        return f"found {query}"

    @function_tool
    async def progress(self, ctx: RunContext, steps: int, step_s: float = 0.05) -> str:
        """Report progress in steps, in the background."""
        for i in range(steps):
            await ctx.update(f"step {i + 1}/{steps}", progress=round((i + 1) / steps, 3))
            await asyncio.sleep(step_s)
        return f"all {steps} steps done"

    @function_tool
    async def heard(self, ctx: RunContext) -> str:
        """Wait until the preamble was heard."""
        await ctx.wait_for_playout()
        return "the preamble was heard"

    @function_tool
    async def transfer(self, ctx: RunContext) -> Agent:
        """Hand off to the other agent after the preamble."""
        await ctx.wait_for_playout()
        return Other()

    @function_tool
    async def fail(self, ctx: RunContext, expected: bool = True) -> str:
        """Fail."""
        if expected:
            raise ToolError("that did not work")
        raise RuntimeError("secret internal detail")

    @function_tool
    async def vague(self, ctx: RunContext, step_s: float = 1.0) -> str:
        """Report progress without a fraction, then a fraction short of the end, then complete."""
        await ctx.update("working, no idea how long")
        await asyncio.sleep(step_s)
        await ctx.update("two thirds there", progress=0.67)
        await asyncio.sleep(step_s)
        return "vague result"

    @function_tool
    async def quiet(self, ctx: RunContext) -> str:
        """End without a reply."""
        raise StopResponse


AGENTS = {"tester": Tester, "other": Other}

# Registered on a first server only (SWITCHBOARD_AGENTS=...,tests.agents_fixture:RETIRED_AGENTS): on a second server
# over the same database their sessions cannot be recovered and end `session.failed`.
RETIRED_AGENTS = {"retired": Other}


class Stubborn(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You run a badly written tool.")

    @function_tool(allow_cancellation=True)
    async def deaf(self, ctx: RunContext) -> str:
        """Work for an hour, ignoring every request to stop."""
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue


# Registered only by the tests of a tool that ignores cancellation (SWITCHBOARD_AGENTS=...,:STUBBORN_AGENTS)
STUBBORN_AGENTS = {"stubborn": Stubborn}
