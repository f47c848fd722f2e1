"""Scenario 14: tool errors reach the model as is_error outputs; internals stay in the logs; max_tool_steps (I5)."""

from __future__ import annotations

import logging
from typing import Any

from switchboard import Agent, RunContext, StopResponse, ToolError, function_tool
from switchboard.runtime.chat import FunctionCallOutput
from switchboard.runtime.executor import INTERNAL_ERROR_OUTPUT

from .harness import Harness


class Faulty(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.runs: list[str] = []

    @function_tool
    async def book(self, ctx: RunContext, city: str, party: int) -> str:
        """Book a table."""
        self.runs.append(f"{city}/{party}")
        return f"booked {party} in {city}"

    @function_tool
    async def explode(self, ctx: RunContext) -> str:
        """Fails unexpectedly."""
        raise RuntimeError("db password is hunter2")

    @function_tool
    async def refuse(self, ctx: RunContext) -> str:
        """Fails expectedly."""
        raise ToolError("No tables left in Paris.")

    @function_tool
    async def hang_up(self, ctx: RunContext) -> str:
        """Ends the turn without a reply."""
        self.runs.append("hang_up")
        raise StopResponse()


async def one_call(tool_call: dict[str, Any]) -> tuple[Harness, Faulty]:
    agent = Faulty()
    h = Harness(
        agent,
        [
            {"text": "Trying.", "tool_calls": [{**tool_call, "id": "c1"}]},
            {"text": "Saw: {{tool_output:" + tool_call["name"] + "}}"},
        ],
    )
    async with h:
        await h.session.input("go")
        await h.tools_done()
        await h.idle()
        h.check_invariants()
    return h, agent


def output_of(h: Harness, call_id: str = "c1") -> FunctionCallOutput:
    (out,) = [it for it in h.chat() if isinstance(it, FunctionCallOutput) and it.call_id == call_id]
    return out


async def test_I5_unknown_tool_lists_available_tools():
    h, _ = await one_call({"name": "teleport", "arguments": {}})
    out = output_of(h)
    assert out.is_error
    assert out.output == "Unknown tool 'teleport'. Available tools: book, explode, hang_up, refuse."
    assert h.store.tool_calls[h.sid]["c1"].status == "failed"
    assert h.summary()[-1] == ("assistant", f"Saw: {out.output}"), "the model gets a reply step to recover"


async def test_I5_bad_arguments_name_the_field():
    h, agent = await one_call({"name": "book", "arguments": {"city": "Paris", "party": "many"}})
    out = output_of(h)
    assert out.is_error and out.output.startswith("Invalid arguments for book:")
    assert "party" in out.output and "city" not in out.output
    assert agent.runs == []
    assert h.store.tool_calls[h.sid]["c1"].status == "failed"


async def test_I5_missing_and_unexpected_arguments_name_the_fields():
    h, agent = await one_call({"name": "book", "arguments": {"town": "Paris", "party": 2}})
    out = output_of(h)
    assert out.is_error and "city" in out.output and "town" in out.output
    assert agent.runs == []


async def test_I5_invalid_json_arguments():
    # arguments that no repair makes an object of (a cut-off object is repaired: see the parity tests)
    h, agent = await one_call({"name": "book", "arguments": 'city="Paris", party='})
    out = output_of(h)
    assert out.is_error and out.output.startswith("Invalid arguments for book: arguments are not valid JSON")
    assert agent.runs == []
    assert h.store.tool_calls[h.sid]["c1"].status == "failed"


async def test_I5_non_object_json_arguments():
    h, agent = await one_call({"name": "book", "arguments": "[1, 2]"})
    out = output_of(h)
    assert out.is_error and "must be a JSON object" in out.output
    assert agent.runs == []


async def test_I5_unexpected_exception_is_internal_error_with_traceback_only_in_logs(caplog):
    caplog.set_level(logging.INFO)
    h, _ = await one_call({"name": "explode"})
    out = output_of(h)
    assert out.is_error and out.output == INTERNAL_ERROR_OUTPUT == "An internal error occurred"
    assert "hunter2" not in out.output
    for r in h.llm.requests:
        assert "hunter2" not in r.model_dump_json()
    assert h.store.tool_calls[h.sid]["c1"].status == "failed"
    records = [r for r in caplog.records if r.exc_info and "explode" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert isinstance(records[0].exc_info[1], RuntimeError)
    assert "hunter2" in caplog.text  # the details are in the logs


async def test_I5_tool_error_message_goes_to_model_logged_without_traceback(caplog):
    caplog.set_level(logging.INFO)
    h, _ = await one_call({"name": "refuse"})
    out = output_of(h)
    assert out.is_error and out.output == "No tables left in Paris."
    assert h.summary()[-1] == ("assistant", "Saw: No tables left in Paris.")
    assert h.store.tool_calls[h.sid]["c1"].status == "failed"
    records = [r for r in caplog.records if "refuse" in r.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.WARNING and not records[0].exc_info
    assert "Traceback" not in caplog.text


async def test_I5_stop_response_ends_without_tool_reply():
    h, agent = await one_call({"name": "hang_up"})
    assert agent.runs == ["hang_up"]
    out = output_of(h)
    assert not out.is_error
    assert h.store.tool_calls[h.sid]["c1"].status == "completed"
    assert len(h.llm.requests) == 1, "no tool reply"
    assert h.summary()[-1][0] == "output"


async def test_max_tool_steps_last_step_runs_with_tool_choice_none(caplog):
    agent = Faulty()
    book = {"name": "book", "arguments": {"city": "Rome", "party": 2}}
    turns = [{"text": f"Step {i}.", "tool_calls": [book]} for i in range(5)]
    async with Harness(agent, turns, max_tool_steps=2) as h:
        res = await h.session.input("book again and again")
        await h.idle()
        reqs = [r for r in h.llm.requests if r.speech_id == res.speech_id]
        assert [(r.step, r.tool_choice) for r in reqs] == [(0, "auto"), (1, "auto"), (2, "none")]
        assert agent.runs == ["Rome/2", "Rome/2"], "the tool call of the last step is not run"
        assert [x for x in h.summary() if x[0] == "assistant"] == [
            ("assistant", "Step 0."),
            ("assistant", "Step 1."),
            ("assistant", "Step 2."),
        ]
        h.check_invariants()


async def test_max_tool_steps_zero_means_no_tools():
    agent = Faulty()
    turns = [{"text": "No tools.", "tool_calls": [{"name": "book", "arguments": {"city": "Rome", "party": 2}}]}]
    async with Harness(agent, turns, max_tool_steps=0) as h:
        await h.session.input("book")
        await h.idle()
        assert [r.tool_choice for r in h.llm.requests] == ["none"]
        assert agent.runs == []
        assert h.summary() == [("user", "book"), ("assistant", "No tools.")]
        h.check_invariants()
