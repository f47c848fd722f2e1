"""The simulated agents: a tool for every behaviour a live session must survive.

Each tool takes ``ms`` (how long it works, in virtual milliseconds) and ``out`` (what it returns: a key of
``OUTPUTS``, so a schedule can make a tool return NUL and other control characters, huge text or something that is
not serialisable). Tools record what they did in ``Effects`` so the oracles can tell a tool that ran twice.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from switchboard import Agent, RunContext, SpeechInterrupted, ToolError, function_tool


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque object>"


OUTPUTS: dict[str, Any] = {
    "plain": "done",
    "nul": "ref\x00-42 done",
    "control": "bell\x07 esc\x1b[31m red\x1b[0m tab\t end",
    "surrogate": "lone \ud800 half",
    "huge": "x" * 20_000,
    "opaque": _Opaque(),
    "none": None,
    "dict": {"ok": True, "n": 3},
}


@dataclass
class Effects:
    """Side effects of tools, across restarts (a booking that runs twice is a double booking)."""

    runs: list[tuple[str, str]] = field(default_factory=list)  # (tool, call_id) each time a body started
    completions: list[tuple[str, str]] = field(default_factory=list)  # (tool, call_id) each time a body finished
    playout_waits: list[tuple[float, float | None]] = field(default_factory=list)  # (released at, interrupted at)


EFFECTS = Effects()
TIMED_S = 0.5  # the ``timed`` tool's timeout: some of the durations drawn exceed it
DEAF_SWALLOWS = 100  # a stubborn tool told to swallow this many cancellations ignores them all
DEAF_WORK_S = 60.0


def _out(key: str) -> Any:
    return OUTPUTS.get(key, "done")


async def _work(ctx: RunContext, name: str, ms: int, out: str) -> Any:
    EFFECTS.runs.append((name, ctx.call_id))
    await asyncio.sleep(ms / 1000)
    EFFECTS.completions.append((name, ctx.call_id))
    return _out(out)


class Desk(Agent):
    """The front desk: most tools live here."""

    def __init__(self) -> None:
        super().__init__(instructions="You are the front desk.", name="desk")

    @function_tool(side_effects=False)
    async def lookup(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """A plain tool, free of side effects: a speculative reply runs it early."""
        return await _work(ctx, "lookup", ms, out)

    @function_tool(allow_cancellation=True, side_effects=False)
    async def search(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """A cancellable tool that stops cooperatively, free of side effects: a speculative reply runs it early."""
        EFFECTS.runs.append(("search", ctx.call_id))
        await ctx.sleep(ms / 1000)
        EFFECTS.completions.append(("search", ctx.call_id))
        return _out(out)

    @function_tool(on_duplicate="reject", on_restart="fail")
    async def book(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """A stateful booking: not cancellable, duplicates rejected."""
        return await _work(ctx, "book", ms, out)

    @function_tool(on_duplicate="replace", allow_cancellation=True)
    async def replace_me(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """A duplicate replaces the running call."""
        return await _work(ctx, "replace_me", ms, out)

    @function_tool(on_duplicate="confirm", duplicate_scope="name_and_args")
    async def transfer_money(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """A duplicate needs confirmation."""
        return await _work(ctx, "transfer_money", ms, out)

    @function_tool(allow_cancellation=True)
    async def background(self, ctx: RunContext, ms: int = 0, out: str = "plain", parallel: int = 1) -> Any:
        """Reports progress, from parallel subtasks when ``parallel`` > 1, then finishes later."""
        EFFECTS.runs.append(("background", ctx.call_id))

        async def report(i: int) -> None:
            await ctx.update(f"part {i}", progress=min(1.0, (i + 1) / max(parallel, 1)))

        await asyncio.gather(*(report(i) for i in range(max(parallel, 1))))
        await ctx.sleep(ms / 1000)
        await ctx.update("almost there", progress=0.9)
        EFFECTS.completions.append(("background", ctx.call_id))
        return _out(out)

    @function_tool
    async def preamble(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """Waits for its spoken preamble before working."""
        EFFECTS.runs.append(("preamble", ctx.call_id))
        loop = asyncio.get_running_loop()
        try:
            await ctx.wait_for_playout()
        except SpeechInterrupted:
            speech = ctx.speech
            EFFECTS.playout_waits.append((loop.time(), getattr(speech, "interrupted_at", None)))
            raise
        await asyncio.sleep(ms / 1000)
        EFFECTS.completions.append(("preamble", ctx.call_id))
        return _out(out)

    @function_tool
    async def fail(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """Raises: an expected failure for 'tool_error', an unexpected one otherwise."""
        EFFECTS.runs.append(("fail", ctx.call_id))
        await asyncio.sleep(ms / 1000)
        if out == "tool_error":
            raise ToolError("the tool failed as expected")
        raise RuntimeError("boom")

    @function_tool(allow_cancellation=True)
    async def stubborn(self, ctx: RunContext, ms: int = 0, out: str = "plain", swallow: int = 1) -> Any:
        """Swallows cancellation ``swallow`` times before it gives up (a badly written tool); from ``DEAF_SWALLOWS``
        on it swallows every cancellation and works for ``DEAF_WORK_S`` (longer than any close may take)."""
        EFFECTS.runs.append(("stubborn", ctx.call_id))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (DEAF_WORK_S if swallow >= DEAF_SWALLOWS else ms / 1000)
        swallowed = 0
        while loop.time() < deadline:
            try:
                await asyncio.sleep(deadline - loop.time())
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > swallow:
                    raise
        EFFECTS.completions.append(("stubborn", ctx.call_id))
        return _out(out)

    @function_tool
    async def handoff(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """Does some work, then hands the conversation to billing with a result."""
        result = await _work(ctx, "handoff", ms, out)
        return Billing(), result if isinstance(result, str) else "handed off"

    @function_tool(timeout_s=TIMED_S)
    async def timed(self, ctx: RunContext, ms: int = 0, out: str = "plain", silent: bool = False) -> Any:
        """Fails past its timeout; with ``silent`` it first moves to the background without a reply."""
        if silent:
            await ctx.update("working quietly", silent=True)
        return await _work(ctx, "timed", ms, out)

    @function_tool(scope="session")
    async def export(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """A session-scoped tool: survives a handoff."""
        await ctx.update("exporting")
        return await _work(ctx, "export", ms, out)


class Billing(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are billing.", name="billing")

    @function_tool(side_effects=False)
    async def lookup(self, ctx: RunContext, ms: int = 0, out: str = "plain") -> Any:
        """Billing's own lookup (free of side effects)."""
        return await _work(ctx, "lookup", ms, out)

    @function_tool
    async def back(self, ctx: RunContext) -> Any:
        """Hands back to the desk."""
        return Desk(), "back at the desk"


AGENTS = {"desk": Desk, "billing": Billing}
EARLY_TOOLS = frozenset({"lookup", "search"})  # declared free of side effects: a speculative reply may run them
TOOL_NAMES = (
    "lookup",
    "search",
    "book",
    "replace_me",
    "transfer_money",
    "background",
    "preamble",
    "fail",
    "stubborn",
    "timed",
    "handoff",
    "export",
    "back",
    "nonexistent",
)
