"""Tool calls on failure paths: a store that refuses a call's end, a tool cancelled mid-update, progress racing the
end, a refused or interrupted handoff, and a tool that ignores cancellation (I1, I5, I8, liveness)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from switchboard import Agent, RunContext, SpeechInterrupted, function_tool
from switchboard.runtime import call_ends as call_ends_module
from switchboard.runtime.chat import AgentHandoff, FunctionCallOutput
from switchboard.runtime.memory import MemoryStore
from switchboard.runtime.ports import Commit
from tests.waiting import WAIT_S

from .harness import Harness

LONG = " ".join(f"word{i}" for i in range(40))


class RefusedWrite(Exception):
    """A write the store rejects for good."""


class PickyStore(MemoryStore):
    """A memory store that rejects chosen writes for good, and can make chosen writes slow."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: Callable[[Commit], bool] = lambda c: False
        self.slow: Callable[[Commit], float] = lambda c: 0.0
        self.refused = 0
        self.writing = asyncio.Event()  # set when a slow write has started

    async def write(self, session_id: str, commit: Commit) -> None:
        delay = self.slow(commit)
        if delay:
            self.writing.set()
            await asyncio.sleep(delay)
        if self.refuse(commit):
            self.refused += 1
            raise RefusedWrite("the store rejected this write")
        await super().write(session_id, commit)


def picky(h: Harness) -> PickyStore:
    store = PickyStore()
    h.store = store
    h.session.writes.store = store
    return store


def outputs_of(commit: Commit) -> list[str]:
    return [it.output for it in commit.items if isinstance(it, FunctionCallOutput)]


def live_outputs(h: Harness, call_id: str) -> list[str]:
    return [it.output for it in h.session.chat.items if isinstance(it, FunctionCallOutput) and it.call_id == call_id]


def stored_outputs(h: Harness, call_id: str) -> list[str]:
    return [it.output for it in h.chat() if isinstance(it, FunctionCallOutput) and it.call_id == call_id]


async def ended(h: Harness, call_id: str, timeout: float = WAIT_S) -> None:
    """Wait until the call has started and ended (in memory)."""
    async with asyncio.timeout(timeout):
        while (info := h.session.tool_call(call_id)) is None or not info.ended:
            await asyncio.sleep(0.005)


class Billing(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are billing.", name="billing")


class Desk(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You are the desk.", name="desk")
        self.release = asyncio.Event()
        self.late: list[asyncio.Task[Any]] = []

    @function_tool
    async def lookup(self, ctx: RunContext) -> str:
        """Returns text with a character some databases refuse."""
        return "ref\x00-42 done"

    @function_tool(allow_cancellation=True)
    async def search(self, ctx: RunContext) -> str:
        """Moves to the background at once, then works until cancelled."""
        await ctx.update("searching")
        await ctx.sleep(10)
        return "found"

    @function_tool
    async def fan_out(self, ctx: RunContext) -> str:
        """Reports progress from parallel subtasks."""
        await asyncio.gather(ctx.update("part 1"), ctx.update("part 2"))
        await asyncio.sleep(0.02)
        return "all parts done"

    @function_tool
    async def leaves_a_reporter(self, ctx: RunContext) -> str:
        """Moves to the background, then returns while a subtask still reports progress."""
        await ctx.update("started")

        async def late_report() -> None:
            await asyncio.sleep(0.005)
            await ctx.update("late news")

        self.late.append(asyncio.create_task(late_report()))
        return "finished"

    @function_tool
    async def refund(self, ctx: RunContext) -> tuple[Agent, str]:
        """Issues a refund, then hands over to billing."""
        return Billing(), "Refund of $50 issued"

    @function_tool
    async def refund_after_preamble(self, ctx: RunContext) -> tuple[Agent, str]:
        """Issues a refund even if its preamble is interrupted, then hands over to billing."""
        try:
            await ctx.wait_for_playout()
        except SpeechInterrupted:
            pass  # the refund is issued anyway
        return Billing(), "Refund of $50 issued"

    @function_tool(allow_cancellation=True)
    async def deaf_search(self, ctx: RunContext) -> str:
        """Ignores every request to stop until released."""
        return await self._deaf()

    @function_tool
    async def deaf_booking(self, ctx: RunContext) -> str:
        """A non-cancellable booking that ignores every request to stop until released."""
        return await self._deaf()

    async def _deaf(self) -> str:
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue  # a badly written tool
        return "finally"


# -- a call's end that the store refuses (a permanent write error) --------------------------------------------


async def test_I5_tool_end_refused_once_by_the_store_is_written_again():
    turns = [{"text": "", "tool_calls": [{"name": "lookup", "id": "c1"}]}]
    h = Harness(Desk(), turns)
    store = picky(h)
    store.refuse = lambda c: store.refused == 0 and any("\x00" in o for o in outputs_of(c))
    async with h:
        await h.session.input("look it up")
        await ended(h, "c1")
        await h.idle()
        assert store.refused == 1
        assert h.store.tool_calls[h.sid]["c1"].status == "completed"
        assert stored_outputs(h, "c1") == live_outputs(h, "c1") == ["ref\x00-42 done"]
        assert [e.data["status"] for e in h.of_type("tool.ended")] == ["completed"]
        h.check_invariants()


async def test_I5_tool_end_the_store_always_refuses_ends_with_a_note_instead_of_running(caplog):
    # whatever the store refuses for good in the output, the call ends: in memory, in the store, in the events
    turns = [{"text": "", "tool_calls": [{"name": "lookup", "id": "c1"}]}, {"text": "Done."}]
    h = Harness(Desk(), turns)
    store = picky(h)
    store.refuse = lambda c: any("\x00" in o for o in outputs_of(c))
    with caplog.at_level(logging.ERROR, logger="switchboard.runtime.tools"):
        async with h:
            await h.session.input("look it up")
            await ended(h, "c1", timeout=5.0)
            await h.idle(timeout=WAIT_S)
            info = h.session.tool_call("c1")
            stored = h.store.tool_calls[h.sid]["c1"]
            assert info.status == stored.status == "completed"
            assert stored.is_error and "could not be stored" in (stored.output or "")
            assert stored_outputs(h, "c1") == live_outputs(h, "c1") == [stored.output]
            reported = h.of_type("tool.ended")
            assert [(e.data["call_id"], e.data["output"]) for e in reported] == [("c1", stored.output)]
            assert h.llm.requests[-1].items[-1].call_id == "c1", "the model sees the call ended, not in progress"
            h.check_invariants()
    assert any("c1" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


async def test_I5_tool_end_no_write_can_store_still_ends_in_memory_and_close_returns(caplog):
    turns = [{"text": "", "tool_calls": [{"name": "lookup", "id": "c1"}]}]
    h = Harness(Desk(), turns)
    store = picky(h)
    store.refuse = lambda c: any(info.call_id == "c1" and info.ended for info in c.tool_calls)
    with caplog.at_level(logging.ERROR, logger="switchboard.runtime.tools"):
        async with asyncio.timeout(WAIT_S):
            async with h:
                await h.session.input("look it up")
                await ended(h, "c1", timeout=5.0)
                assert h.session.tool_call("c1").status == "completed"
                assert len(live_outputs(h, "c1")) == 1
                assert h.of_type("tool.ended") == [], "nothing is reported that is not durable"
    assert any("ended in memory only" in r.getMessage() for r in caplog.records)
    # never stored closed with a call running (I8): the store keeps the session live, and recovery settles the call
    assert h.store.tool_calls[h.sid]["c1"].status == "running"
    assert h.store.sessions[h.sid].state != "closed"


async def test_I5_tool_end_the_store_refused_for_a_while_is_written_again_while_the_session_runs(
    monkeypatch: pytest.MonkeyPatch,
):
    """Both the end and its note were refused: the call is not left `running` in the store for as long as the
    session lives; its end is written again in the background and reported once it is durable."""
    monkeypatch.setattr(call_ends_module, "END_REPAIR_FIRST_S", 0.05)
    turns = [{"text": "", "tool_calls": [{"name": "lookup", "id": "c1"}]}]
    h = Harness(Desk(), turns)
    store = picky(h)
    store.refuse = lambda c: store.refused < 6 and any(i.call_id == "c1" and i.ended for i in c.tool_calls)
    async with h:
        await h.session.input("look it up")
        await ended(h, "c1", timeout=5.0)
        event = await h.wait_for("tool.ended", timeout=WAIT_S)
        stored = h.store.tool_calls[h.sid]["c1"]
        assert stored.status == "completed" and event.data["output"] == stored.output
        assert stored_outputs(h, "c1") == live_outputs(h, "c1") == [stored.output]
        await h.session.input("and now?")  # the session went on meanwhile
        await h.idle()
        assert len(h.of_type("tool.ended")) == 1
        h.check_invariants()


async def test_I5_tool_end_the_store_refused_until_the_close_is_written_by_the_close():
    turns = [{"text": "", "tool_calls": [{"name": "lookup", "id": "c1"}]}]
    h = Harness(Desk(), turns)
    store = picky(h)
    closing = False
    store.refuse = lambda c: not closing and any(i.call_id == "c1" and i.ended for i in c.tool_calls)
    async with h:
        await h.session.input("look it up")
        await ended(h, "c1", timeout=5.0)
        await h.idle(timeout=WAIT_S)
        closing = True
    assert h.store.sessions[h.sid].state == "closed"
    assert h.store.tool_calls[h.sid]["c1"].status == "completed"
    assert len(stored_outputs(h, "c1")) == 1
    types = [(e.type, e.data.get("call_id")) for e in h.events.events[h.sid]]
    assert types.index(("tool.ended", "c1")) < types.index(("session.closed", None))


async def test_I5_tool_start_refused_by_the_store_ends_the_call_without_running_it():
    turns = [{"text": "", "tool_calls": [{"name": "lookup", "id": "c1"}]}]
    h = Harness(Desk(), turns)
    store = picky(h)
    store.refuse = lambda c: any(info.call_id == "c1" and not info.ended for info in c.tool_calls)
    async with h:
        await h.session.input("look it up")
        await ended(h, "c1")
        stored = h.store.tool_calls[h.sid]["c1"]
        assert stored.status == "failed" and "not run" in (stored.output or "")
        h.check_invariants()


# -- cancelled during the first update's commit ---------------------------------------------------------------


async def test_I5_tool_cancelled_during_its_first_update_commit_has_one_output():
    turns = [{"text": "", "tool_calls": [{"name": "search", "id": "s1"}]}, {"text": "OK."}]
    h = Harness(Desk(), turns, tool_cancel_grace_s=0.0)
    store = picky(h)
    store.slow = lambda c: 0.1 if any("background" in o for o in outputs_of(c)) else 0.0
    async with h:
        await h.session.input("search")
        await store.writing.wait()
        info = await asyncio.wait_for(h.session.cancel_tool("s1"), WAIT_S)
        assert info.status == "cancelled"
        await h.idle()
        assert len(live_outputs(h, "s1")) == len(stored_outputs(h, "s1")) == 1
        assert len(stored_outputs(h, "s1/final")) == 1
        h.check_invariants()


# -- progress and the end, one at a time per call ---------------------------------------------------------------


async def test_I5_parallel_updates_give_one_background_pair():
    turns = [{"text": "", "tool_calls": [{"name": "fan_out", "id": "f1"}]}, {"text": "OK."}]
    h = Harness(Desk(), turns)
    store = picky(h)
    store.slow = lambda c: 0.01 if c.tool_calls else 0.0
    async with h:
        await h.session.input("fan out")
        await ended(h, "f1")
        await h.idle()
        assert len(stored_outputs(h, "f1")) == len(live_outputs(h, "f1")) == 1
        assert stored_outputs(h, "f1/final") == ["all parts done"]
        h.check_invariants()


async def test_I5_update_in_flight_when_the_call_ends_never_reopens_it():
    agent = Desk()
    turns = [{"text": "", "tool_calls": [{"name": "leaves_a_reporter", "id": "r1"}]}, {"text": "OK."}]
    h = Harness(agent, turns)
    store = picky(h)
    store.slow = lambda c: 0.05 if c.tool_calls else 0.0
    async with h:
        await h.session.input("go")
        await h.wait_for("tool.ended")
        await asyncio.gather(*agent.late)
        await asyncio.sleep(0.1)
        assert h.session.tool_call("r1").status == "completed"
        assert h.store.tool_calls[h.sid]["r1"].status == "completed"
        types = [e.type for e in h.events.events[h.sid] if e.type.startswith("tool.")]
        assert types[types.index("tool.ended") :] == ["tool.ended"], "no progress after the end"
        h.check_invariants()


# -- a handoff that is not done keeps the tool's result ----------------------------------------------------------


async def test_I1_refused_handoff_keeps_the_tool_result():
    turns = [
        {"text": "", "tool_calls": [{"name": "refund", "id": "r1"}, {"name": "refund", "id": "r2"}]},
        {"text": "Billing here."},
    ]
    async with Harness(Desk(), turns) as h:
        await h.session.input("refund twice")
        await ended(h, "r1")
        await ended(h, "r2")
        await h.idle()
        refused = [c for c in h.session.tool_calls() if "not done" in (c.output or "")]
        assert len(refused) == 1
        assert refused[0].status == "completed" and not refused[0].is_error
        assert refused[0].output.startswith("Refund of $50 issued")
        h.check_invariants()


async def test_I1_handoff_interrupted_by_the_user_keeps_the_tool_result():
    turns = [{"text": LONG, "tool_calls": [{"name": "refund_after_preamble", "id": "r1"}]}, {"text": "Desk."}]
    async with Harness(Desk(), turns) as h:
        await h.session.input("refund please")
        await h.wait_for("tool.started")
        await asyncio.sleep(0.03)
        await h.session.interrupt()
        await h.tools_done()
        await h.idle()
        r1 = h.session.tool_call("r1")
        assert r1.status == "completed" and not r1.is_error
        assert r1.output.startswith("Refund of $50 issued") and "not done" in r1.output
        assert h.session.agent.name == "desk"
        assert not any(isinstance(it, AgentHandoff) for it in h.chat())
        h.check_invariants()


# -- a tool that ignores cancellation never holds up a cancel, a close or a shutdown -----------------------------


async def test_close_is_bounded_when_a_tool_swallows_cancellation(caplog):
    agent = Desk()
    turns = [{"text": "", "tool_calls": [{"name": "deaf_booking", "id": "b1"}]}]
    h = Harness(agent, turns, close_timeout_s=0.2)
    with caplog.at_level(logging.ERROR, logger="switchboard.runtime.tools"):
        try:
            await h.__aenter__()
            await h.session.input("book")
            await h.wait_for("tool.started")
            async with asyncio.timeout(3.0):  # bound: the 0.2 s it is given, not the default 30 s
                await h.session.aclose()
            stored = h.store.tool_calls[h.sid]["b1"]
            assert stored.status == "interrupted"
            assert len(stored_outputs(h, "b1")) == 1
            h.check_invariants()
        finally:
            agent.release.set()  # let the abandoned body end, so the test leaks nothing
    assert any("b1" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


async def test_rest_cancel_returns_when_a_tool_swallows_cancellation():
    agent = Desk()
    turns = [{"text": "", "tool_calls": [{"name": "deaf_search", "id": "d1"}]}, {"text": "OK."}]
    h = Harness(agent, turns, tool_cancel_grace_s=0.05)
    try:
        async with h:
            await h.session.input("search")
            await h.wait_for("tool.started")
            info = await asyncio.wait_for(h.session.cancel_tool("d1"), 3.0)  # bound: the cancel's graces, ~1 s
            assert info.status == "cancelling", "its body still runs: it is not shown ended"
            assert stored_outputs(h, "d1") == []
            agent.release.set()
            await ended(h, "d1")
            assert h.session.tool_call("d1").status == "cancelled"
            assert len(stored_outputs(h, "d1")) == 1
            h.check_invariants()
    finally:
        agent.release.set()


@pytest.mark.parametrize("swallowing_tool", ["deaf_booking", "deaf_search"])
async def test_suspend_is_bounded_when_a_tool_swallows_cancellation(swallowing_tool):
    agent = Desk()
    turns = [{"text": "", "tool_calls": [{"name": swallowing_tool, "id": "x1"}]}]
    h = Harness(agent, turns, shutdown_tool_grace_s=0.2)
    try:
        await h.__aenter__()
        await h.session.input("go")
        await h.wait_for("tool.started")
        async with asyncio.timeout(3.0):  # bound: the 0.2 s grace it is given, not the default 10 s
            await h.session.suspend()
        assert h.store.tool_calls[h.sid]["x1"].status == "running", "recovered on the next start"
    finally:
        agent.release.set()


async def test_rest_cancel_returns_when_the_store_refuses_the_calls_end():
    turns = [{"text": "", "tool_calls": [{"name": "search", "id": "s1"}]}, {"text": "OK."}]
    h = Harness(Desk(), turns)
    store = picky(h)
    store.refuse = lambda c: any(info.call_id == "s1" and info.ended for info in c.tool_calls)
    async with asyncio.timeout(WAIT_S):
        async with h:
            await h.session.input("search")
            await h.wait_for("tool.progress")
            info = await asyncio.wait_for(h.session.cancel_tool("s1"), WAIT_S)
            assert info.status == "cancelled"
            assert h.session.tool_call("s1").status == "cancelled"
