"""A long-lived session keeps bounded state in memory; the store keeps everything."""

from __future__ import annotations

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime import executor as executor_mod
from switchboard.runtime.llm import scripted

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
