"""Scenario 12: on_duplicate policies, cancellation (REST-style and by the model), companion tools (I4, I5)."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from pydantic import ValidationError

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.executor import AlreadyEnded, NotCancellable, ToolCallNotFound
from switchboard.runtime.tools import CONFIRM_FIELD, ToolPolicy
from tests.waiting import WAIT_S

from .harness import Harness


class Dup(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()
        self.started: list[str] = []

    async def _work(self, ctx: RunContext, label: str) -> str:
        self.started.append(ctx.call_id)
        await ctx.wait_if_not_cancelled(self.gate.wait())
        return f"{label} done"

    @function_tool
    async def allowed(self, ctx: RunContext, x: int) -> str:
        """Duplicates allowed."""
        return await self._work(ctx, f"allowed {x}")

    @function_tool(on_duplicate="reject")
    async def rejected(self, ctx: RunContext, x: int) -> str:
        """Duplicates rejected (same name)."""
        return await self._work(ctx, f"rejected {x}")

    @function_tool(on_duplicate="reject", duplicate_scope="name_and_args")
    async def rejected_args(self, ctx: RunContext, x: int) -> str:
        """Duplicates rejected (same name and arguments)."""
        return await self._work(ctx, f"rejected_args {x}")

    @function_tool(on_duplicate="replace", allow_cancellation=True)
    async def replaced(self, ctx: RunContext, x: int) -> str:
        """A new call replaces the running one (which can be cancelled)."""
        return await self._work(ctx, f"replaced {x}")

    @function_tool(on_duplicate="confirm")
    async def confirmed(self, ctx: RunContext, x: int) -> str:
        """A duplicate needs the user's confirmation."""
        return await self._work(ctx, f"confirmed {x}")

    @function_tool(on_duplicate="confirm", duplicate_scope="name_and_args")
    async def confirmed_args(self, ctx: RunContext, x: int) -> str:
        """A duplicate with the same arguments needs the user's confirmation."""
        return await self._work(ctx, f"confirmed_args {x}")


def call(name: str, call_id: str, **arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments, "id": call_id}


@asynccontextmanager
async def run_calls(calls: list[dict[str, Any]], n_started: int) -> AsyncIterator[tuple[Harness, Dup]]:
    """Run one turn with ``calls``, let them all reach their policy decision, then release the gate."""
    agent = Dup()
    async with Harness(agent, [{"text": "Working.", "tool_calls": calls}, {"text": "All done."}]) as h:
        try:
            await h.session.input("go")
            async with asyncio.timeout(WAIT_S):
                while len(h.of_type("tool.started")) < len(calls) or len(agent.started) < n_started:
                    await asyncio.sleep(0.002)
            await asyncio.sleep(0.02)
            agent.gate.set()
            await h.tools_done()
            await h.idle()
            yield h, agent
        finally:
            agent.gate.set()


def statuses(h: Harness) -> dict[str, tuple[str, str]]:
    return {e.data["call_id"]: (e.data["status"], e.data["output"]) for e in h.of_type("tool.ended")}


async def test_I4_on_duplicate_allow_runs_both():
    async with run_calls([call("allowed", "a1", x=1), call("allowed", "a2", x=1)], 2) as (h, agent):
        assert statuses(h) == {"a1": ("completed", "allowed 1 done"), "a2": ("completed", "allowed 1 done")}
        assert sorted(agent.started) == ["a1", "a2"]
        h.check_invariants()


async def test_I4_on_duplicate_reject_scope_name():
    async with run_calls([call("rejected", "r1", x=1), call("rejected", "r2", x=2)], 1) as (h, agent):
        st = statuses(h)
        assert st["r1"] == ("completed", "rejected 1 done")
        assert st["r2"][0] == "rejected"
        assert "already running" in st["r2"][1] and "r1" in st["r2"][1]
        assert agent.started == ["r1"]
        assert h.session.tool_call("r2").is_error
        h.check_invariants()


async def test_I4_on_duplicate_reject_scope_name_and_args():
    calls = [call("rejected_args", "r1", x=1), call("rejected_args", "r2", x=2), call("rejected_args", "r3", x=1)]
    async with run_calls(calls, 2) as (h, agent):
        st = statuses(h)
        assert st["r1"] == ("completed", "rejected_args 1 done")
        assert st["r2"] == ("completed", "rejected_args 2 done"), "other arguments are not a duplicate"
        assert st["r3"][0] == "rejected" and "r1" in st["r3"][1] and "r2" not in st["r3"][1]
        assert sorted(agent.started) == ["r1", "r2"]
        h.check_invariants()


async def test_I4_on_duplicate_replace_cancels_the_older_call():
    async with run_calls([call("replaced", "p1", x=1), call("replaced", "p2", x=2)], 2) as (h, _):
        st = statuses(h)
        assert st["p1"][0] == "cancelled" and "replaced by p2" in st["p1"][1]
        assert st["p2"] == ("completed", "replaced 2 done")
        assert h.session.tool_call("p1").is_error
        ended = [e.data["call_id"] for e in h.of_type("tool.ended")]
        assert ended.index("p1") < ended.index("p2")
        h.check_invariants()


async def test_I4_on_duplicate_confirm_needs_confirm_duplicate_true():
    calls = [
        call("confirmed", "k1", x=1),
        call("confirmed", "k2", x=2),
        call("confirmed", "k3", x=3, **{CONFIRM_FIELD: True}),
    ]
    async with run_calls(calls, 2) as (h, agent):
        st = statuses(h)
        assert st["k1"] == ("completed", "confirmed 1 done")
        assert st["k2"][0] == "rejected" and f"{CONFIRM_FIELD}=true" in st["k2"][1]
        assert st["k3"] == ("completed", "confirmed 3 done")
        assert sorted(agent.started) == ["k1", "k3"]
        schema = {t["name"]: t for t in h.llm.requests[0].tools}
        assert CONFIRM_FIELD in schema["confirmed"]["parameters"]["properties"]
        assert CONFIRM_FIELD not in schema["rejected"]["parameters"]["properties"]
        h.check_invariants()


async def test_I4_on_duplicate_confirm_scope_name_and_args():
    calls = [call("confirmed_args", "k1", x=1), call("confirmed_args", "k2", x=2), call("confirmed_args", "k3", x=1)]
    async with run_calls(calls, 2) as (h, _):
        st = statuses(h)
        assert st["k1"][0] == st["k2"][0] == "completed"
        assert st["k3"][0] == "rejected" and CONFIRM_FIELD in st["k3"][1]
        h.check_invariants()


async def test_I4_on_duplicate_reject_across_turns():
    agent = Dup()
    long_text = " ".join(f"w{i}" for i in range(40))
    turns = [
        {"text": long_text, "tool_calls": [call("rejected", "r1", x=1)]},
        {"text": "Let me try.", "tool_calls": [call("rejected", "r2", x=1)]},
        {"text": "Answer: {{tool_output:rejected}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        await h.wait_for("tool.started")
        await h.session.interrupt()  # r1 is not cancellable: it runs on
        await h.session.input("again")
        await h.wait_for("tool.ended", lambda e: e.data["call_id"] == "r2")
        await h.idle()
        assert h.session.tool_call("r1").status == "running"
        assert h.session.tool_call("r2").status == "rejected"
        assert h.summary()[-1][0:1] == ("assistant",) and "already running (call r1)" in h.summary()[-1][1]
        agent.gate.set()
        await h.tools_done()
        assert h.session.tool_call("r1").status == "completed"
        assert agent.started == ["r1"]
        h.check_invariants()


# -- cancellation ---------------------------------------------------------------------------------------------


class Cancellable(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()
        self.log: list[str] = []

    @function_tool(allow_cancellation=True)
    async def sleeper(self, ctx: RunContext) -> str:
        """Cooperative: sleeps with ctx.sleep."""
        await ctx.sleep(10)
        return "slept"

    @function_tool(allow_cancellation=True)
    async def poller(self, ctx: RunContext) -> str:
        """Cooperative: polls ctx.cancelled and returns what it has."""
        while not ctx.cancelled:
            await asyncio.sleep(0.005)
        self.log.append("noticed")
        return "partial result"

    @function_tool(allow_cancellation=True)
    async def stubborn(self, ctx: RunContext) -> str:
        """Ignores ctx.cancelled."""
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.log.append("forced")
            raise
        return "never"

    @function_tool
    async def fixed(self, ctx: RunContext) -> str:
        """Not cancellable."""
        await self.gate.wait()
        return "fixed done"

    @function_tool(allow_cancellation=True)
    async def searcher(self, ctx: RunContext, q: str) -> str:
        """Cancellable background search."""
        await ctx.update(f"searching {q}")
        await ctx.sleep(10)
        return "found"


class Plain(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")

    @function_tool
    async def fixed(self, ctx: RunContext) -> str:
        """Not cancellable."""
        return "fixed done"


async def _start_one(h: Harness, name: str) -> str:
    await h.session.input("go")
    ev = await h.wait_for("tool.started", lambda e: e.data["name"] == name)
    return str(ev.data["call_id"])


async def test_I4_cancel_cooperative_ctx_sleep():
    loop = asyncio.get_running_loop()
    async with Harness(Cancellable(), [{"tool_calls": [{"name": "sleeper", "id": "c1"}]}]) as h:
        call_id = await _start_one(h, "sleeper")
        assert h.session.tool_call(call_id).cancellable
        t0 = loop.time()
        info = await h.session.cancel_tool(call_id)
        assert loop.time() - t0 < 0.2, "cooperative: ended before the grace period"
        assert info.status == "cancelled" and info.is_error and "cancelled by an operator" in (info.output or "")
        await h.idle()
        with pytest.raises(AlreadyEnded):
            await h.session.cancel_tool(call_id)
        h.check_invariants()


async def test_I4_cancel_cooperative_ctx_cancelled_keeps_partial_result():
    agent = Cancellable()
    async with Harness(agent, [{"tool_calls": [{"name": "poller", "id": "c1"}]}]) as h:
        call_id = await _start_one(h, "poller")
        info = await h.session.cancel_tool(call_id)
        assert agent.log == ["noticed"]
        assert (info.status, info.output, info.is_error) == ("cancelled", "partial result", False)
        await h.idle()
        h.check_invariants()


async def test_I4_cancel_non_cooperative_is_forced_after_grace():
    agent = Cancellable()
    async with Harness(agent, [{"tool_calls": [{"name": "stubborn", "id": "c1"}]}], tool_cancel_grace_s=0.05) as h:
        call_id = await _start_one(h, "stubborn")
        async with asyncio.timeout(WAIT_S):
            info = await h.session.cancel_tool(call_id)
        assert agent.log == ["forced"]
        assert info.status == "cancelled" and info.is_error
        await h.idle()
        h.check_invariants()


async def test_I4_cancel_refused_for_non_cancellable_and_unknown_calls():
    agent = Cancellable()
    async with Harness(agent, [{"tool_calls": [{"name": "fixed", "id": "c1"}]}]) as h:
        call_id = await _start_one(h, "fixed")
        assert not h.session.tool_call(call_id).cancellable
        with pytest.raises(NotCancellable):
            await h.session.cancel_tool(call_id)
        with pytest.raises(ToolCallNotFound):
            await h.session.cancel_tool("nope")
        assert h.session.tool_call(call_id).status == "running"
        agent.gate.set()
        await h.tools_done()
        with pytest.raises(AlreadyEnded) as err:
            await h.session.cancel_tool(call_id)
        assert err.value.info.status == "completed"
        await h.idle()
        h.check_invariants()


async def test_I4_companion_tools_offered_only_with_a_cancellable_tool():
    async with Harness(Plain(), [{"text": "Hi."}]) as h:
        await h.session.input("hi")
        await h.idle()
        assert {t["name"] for t in h.llm.requests[0].tools} == {"fixed"}
        h.check_invariants()
    async with Harness(Cancellable(), [{"text": "Hi."}]) as h:
        await h.session.input("hi")
        await h.idle()
        names = {t["name"] for t in h.llm.requests[0].tools}
        assert {"list_running_tool_calls", "cancel_tool_call"} <= names
        assert {"sleeper", "fixed", "searcher"} <= names
        h.check_invariants()


async def test_I4_model_lists_and_cancels_a_running_call_through_companion_tools():
    turns = [
        {"text": "Searching.", "tool_calls": [{"name": "searcher", "arguments": {"q": "flights"}, "id": "s1"}]},
        {"text": "It is running."},
        # the user asks to cancel: the model lists, then cancels
        {"tool_calls": [{"name": "list_running_tool_calls", "id": "l1"}]},
        {"tool_calls": [{"name": "cancel_tool_call", "arguments": {"call_id": "s1"}, "id": "x1"}]},
        {"text": "Done: {{tool_output:cancel_tool_call}}"},
    ]
    async with Harness(Cancellable(), turns) as h:
        await h.session.input("search flights")
        await h.wait_for("tool.progress")
        await h.idle()
        assert h.session.tool_call("s1").status == "running"
        await h.session.input("cancel the search")
        await h.tools_done()
        await h.idle()
        listed = h.session.tool_call("l1")
        assert listed is not None and listed.status == "completed"
        rows = json.loads(listed.output or "")
        assert [(r["call_id"], r["name"], r["cancellable"], r["progress"]) for r in rows] == [
            ("s1", "searcher", True, "searching flights")
        ]
        assert h.session.tool_call("x1").status == "completed"
        s1 = h.session.tool_call("s1")
        assert s1.status == "cancelled" and "at the user's request" in (s1.output or "")
        assert ("assistant", "Done: Cancelled searcher (s1).") in h.summary()
        h.check_invariants()


async def test_I4_companion_cancel_of_a_non_cancellable_call_is_an_error_output():
    agent = Cancellable()
    turns = [
        {"text": "Booking.", "tool_calls": [{"name": "fixed", "id": "f1"}]},
        {"tool_calls": [{"name": "cancel_tool_call", "arguments": {"call_id": "f1"}, "id": "x1"}]},
        {"text": "Result: {{tool_output:cancel_tool_call}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("book")
        await h.wait_for("tool.started")
        await h.session.interrupt()  # the non-cancellable call runs on
        await h.session.input("cancel it")
        await h.wait_for("tool.ended", lambda e: e.data["call_id"] == "x1")
        x1 = h.session.tool_call("x1")
        assert x1.status == "failed" and x1.is_error and "cannot be cancelled" in (x1.output or "")
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        assert h.session.tool_call("f1").status == "completed"
        h.check_invariants()


async def test_I5_cancel_before_the_tool_body_started_ends_the_call_once():
    # the call's first commit is slow (the store fails once and is retried): cancel it in that window
    agent = Cancellable()
    async with Harness(agent, [{"ttft_ms": 30, "tool_calls": [{"name": "sleeper", "id": "c1"}]}]) as h:
        await h.session.input("go")
        await h.wait_for("generation.started")
        await asyncio.sleep(0.01)
        h.store.fail_next = 1
        async with asyncio.timeout(WAIT_S):
            while h.session.executor.get("c1") is None:
                await asyncio.sleep(0)
            assert "tool.started" not in h.types()
            info = await h.session.cancel_tool("c1")
        assert info.status == "cancelled"
        await h.idle()
        assert [e.data["status"] for e in h.of_type("tool.ended")] == ["cancelled"]
        h.check_invariants()


def test_function_tool_keeps_its_policy_keywords_and_gathers_them_in_one_tool_policy():
    params = inspect.signature(function_tool).parameters
    # the policy's fields, then the call's own limit (``timeout_s``, not a policy field: webhook and MCP tools bound
    # their calls themselves)
    assert list(params) == ["fn", "name", "description", *ToolPolicy.model_fields, "timeout_s"]
    for field, info in ToolPolicy.model_fields.items():
        assert params[field].kind is inspect.Parameter.KEYWORD_ONLY and params[field].default == info.default

    @function_tool(
        on_duplicate="confirm",
        duplicate_scope="name_and_args",
        allow_cancellation=True,
        on_restart="retry",
        scope="session",
    )
    async def book(what: str) -> str:
        """Book it."""
        return what

    @function_tool
    async def look(what: str) -> str:
        """Look it up."""
        return what

    assert book.policy == ToolPolicy(
        on_duplicate="confirm",
        duplicate_scope="name_and_args",
        allow_cancellation=True,
        on_restart="retry",
        scope="session",
    )
    assert CONFIRM_FIELD in book.parameters["properties"]
    assert look.policy == ToolPolicy() and CONFIRM_FIELD not in look.parameters["properties"]
    with pytest.raises(ValidationError):
        function_tool(on_duplicate="sometimes")  # type: ignore[arg-type]
