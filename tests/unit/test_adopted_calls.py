"""What recovery builds cheaply is what it would build the ordinary way: a model made by ``trusted`` equals the
validated one, and an adopted (ended) call, whose futures, lock and item are made only when asked for, behaves as an
ended call: settled, ended, listed, never cancelled and never run again."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from switchboard.runtime.agent import Agent
from switchboard.runtime.chat import AgentHandoff, ChatMessage, FunctionCall, FunctionCallOutput
from switchboard.runtime.tool_call import AlreadyEnded
from switchboard.runtime.tools import (
    TERMINAL_STATUSES,
    ProgressUpdate,
    RunContext,
    ToolCallInfo,
    ToolStatus,
    function_tool,
)
from switchboard.runtime.trusted import trustable, trusted
from tests.waiting import WAIT_S

from .harness import Harness

T0 = datetime(2026, 11, 28, 9, 0, tzinfo=UTC)

VALID: list[tuple[type[BaseModel], dict[str, Any]]] = [
    (ChatMessage, {"id": "m", "created_at": T0, "type": "message", "role": "user", "text": "hi", "interrupted": False}),
    (
        FunctionCall,
        {"id": "c", "created_at": T0, "type": "function_call", "call_id": "c1", "name": "t", "arguments": {"a": 1}},
    ),
    (
        FunctionCallOutput,
        {
            "id": "o",
            "created_at": T0,
            "type": "function_call_output",
            "call_id": "c1",
            "name": "t",
            "output": "x",
            "is_error": True,
        },
    ),
    (AgentHandoff, {"id": "h", "created_at": T0, "type": "agent_handoff", "from_agent": None, "to_agent": "b"}),
    (
        ToolCallInfo,
        {
            "call_id": "c1",
            "name": "t",
            "arguments": {"a": [1, None]},
            "status": ToolStatus.FAILED,
            "cancellable": True,
            "scope": "session",
            "background": True,
            "progress": [ProgressUpdate(message="half", progress=0.5, at=T0)],
            "output": "boom",
            "is_error": True,
            "error": "ValueError",
            "speech_id": "sp1",
            "agent": "a",
            "speculative": False,
            "started_at": T0,
            "ended_at": T0,
        },
    ),
]


@pytest.mark.parametrize(("cls", "values"), VALID, ids=[cls.__name__ for cls, _ in VALID])
def test_a_trusted_model_equals_the_validated_one(cls: type[BaseModel], values: dict[str, Any]) -> None:
    assert trustable(cls)
    assert list(values) == list(cls.model_fields)  # every field, in order: what ``trusted`` asks of its caller
    validated = cls.model_validate(values)
    built = trusted(cls, dict(values))
    assert built == validated
    assert built.model_fields_set == validated.model_fields_set
    assert built.model_dump(mode="json") == validated.model_dump(mode="json")
    assert repr(built) == repr(validated)
    assert built.model_copy(update={"id" if "id" in values else "name": "other"}) != validated


class Booker(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You book.")
        self.runs = 0

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something."""
        self.runs += 1
        return f"booked {what}"


def ended(status: ToolStatus) -> ToolCallInfo:
    return ToolCallInfo(
        call_id=f"old-{status.value}",
        name="book",
        arguments={"what": status.value},
        status=status,
        cancellable=True,
        output="done",
        started_at=T0,
        ended_at=T0,
    )


async def test_an_adopted_call_is_ended_and_settled_and_is_never_cancelled_or_run_again() -> None:
    agent = Booker()
    calls = [ended(status) for status in sorted(TERMINAL_STATUSES)]
    reuse = {"tool_calls": [{"name": "book", "arguments": {"what": "again"}, "id": calls[0].call_id}]}
    async with Harness(agent, [reuse, {"text": "Done."}]) as h:
        executor = h.session.executor
        for info in calls:
            executor.adopt(info)
        executor.adopt(calls[0].model_copy(update={"output": "not this one"}))  # adopted once
        for info in calls:
            rc = executor.get(info.call_id)
            assert rc is not None and rc.adopted and rc.ended and rc.info == info
            assert "cancel_fut" not in vars(rc) and "write_lock" not in vars(rc)  # made only when asked for
            assert rc.settled_fut.done() and rc.ended_fut.done()
            await asyncio.wait_for(asyncio.shield(rc.ended_fut), WAIT_S)  # a waiter returns
            assert not rc.cancel_fut.done() and not rc.abandoned_fut.done() and not rc.verdict_fut.done()
            assert rc.item == FunctionCall(
                id=f"adopted:{info.call_id}",
                call_id=info.call_id,
                name="book",
                arguments=info.arguments,
                created_at=T0,
            )
            assert rc.item is rc.item
            with pytest.raises(AlreadyEnded):
                await h.session.cancel_tool(info.call_id)
        assert executor.running() == [] and {rc.call_id for rc in executor.calls()} == {c.call_id for c in calls}

        await h.session.input("book it again")  # the model reuses the id of an adopted call: a new call runs
        await h.idle()
        await h.tools_done()
        assert agent.runs == 1
        assert executor.get(calls[0].call_id).info == calls[0]  # type: ignore[union-attr]
        (new,) = [rc for rc in executor.calls() if not rc.adopted]
        assert new.call_id != calls[0].call_id and new.info.status is ToolStatus.COMPLETED
        h.check_invariants()
