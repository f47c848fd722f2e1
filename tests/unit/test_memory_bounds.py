"""A long-lived session keeps bounded state in memory; the store keeps everything."""

from __future__ import annotations

import asyncio

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime import executor as executor_mod
from switchboard.runtime.llm import build_llm, scripted
from switchboard.runtime.llm.scripted import ScriptedLLM
from tests.waiting import WAIT_S

from .harness import Harness


class Quick(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")

    @function_tool
    async def ping(self, ctx: RunContext, n: int) -> str:
        """Answer at once."""
        return f"pong {n}"


async def test_ended_calls_and_requests_are_bounded_in_memory(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(executor_mod, "KEEP_ENDED_CALLS", 5)
    monkeypatch.setattr(scripted, "KEEP_REQUESTS", 4)
    turns = []
    for i in range(12):
        turns.append({"text": "", "tool_calls": [{"name": "ping", "arguments": {"n": i}, "id": f"c{i}"}]})
        turns.append({"text": f"got {{{{tool_output:ping}}}} {i}"})
    async with Harness(Quick(), turns) as h:
        h.llm.requests = type(h.llm.requests)(maxlen=scripted.KEEP_REQUESTS)
        for i in range(12):
            await h.session.input(f"ping {i}")
            await h.idle()
        in_memory = [c.call_id for c in h.session.tool_calls()]
        assert in_memory == [f"c{i}" for i in range(7, 12)]
        assert h.session.executor.forgotten == 7
        assert sorted(h.store.tool_calls[h.sid]) == sorted(f"c{i}" for i in range(12))  # the store has them all
        assert len(h.llm.requests) == 4
        assert h.summary()[-1] == ("assistant", "got pong 11 11")
        h.check_invariants()


async def test_an_idle_session_holds_no_task():
    """The speech loop runs only while something is queued or playing: an idle session (10,000 of them per process)
    holds no task, and the loop comes back for the next speech."""
    before = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    async with Harness(Quick(), [{"text": "first"}, {"text": "second"}]) as h:
        await h.idle()
        await _no_task_left(before)  # (its agent's on_enter ends on its own)
        for text in ("one", "two"):
            await h.session.input(text)
            await h.idle()
            await _no_task_left(before)
        assert [s for role, s, *_ in h.summary() if role == "assistant"] == ["first", "second"]
        h.check_invariants()


async def _no_task_left(before: set[asyncio.Task[object]]) -> None:
    """Until the session's tasks have all ended (bounded by WAIT_S: a task that stays fails the test)."""
    async with asyncio.timeout(WAIT_S):
        while [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()]:
            await asyncio.sleep(0.01)


def test_sessions_running_one_script_share_its_parsed_form_and_keep_their_own_position():
    """An agent's default script is parsed once per process, not held once per session; each model keeps its own
    place in it, and a bad script is still refused with its error."""
    config = {
        "provider": "scripted",
        "turns": [{"text": "one"}, {"text": "two"}],
        "on_user": [{"match": "hi", "turn": {"text": "hello"}}],
    }
    first, second = build_llm(config), build_llm(dict(config))
    assert isinstance(first, ScriptedLLM) and isinstance(second, ScriptedLLM)
    assert first.rules is second.rules and first.turns == second.turns
    first.load_state({"position": 1})
    assert first.save_state() == {"position": 1} and second.save_state() == {"position": 0}
    with pytest.raises(ValueError, match="turns"):
        build_llm({"provider": "scripted", "turns": "not a list"})
