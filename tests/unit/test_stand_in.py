"""The stand-in for a model (a session that names none, of an agent without one): a user's message that calls a
tool by name runs it, the result is said, anything else gets one sentence on what to do."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import ChatMessage, FunctionCall, FunctionCallOutput, new_id, utcnow
from switchboard.runtime.llm import LLMRequest, TextDelta, build_llm
from switchboard.runtime.llm.stand_in import CONNECT_A_MODEL, StandInLLM, parse_call

from .harness import Harness


class Concierge(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You book tables.")
        self.gate = asyncio.Event()

    @function_tool
    async def search_tables(self, ctx: RunContext, city: str, party: int, terrace: bool = False) -> str:
        """Search free tables."""
        return f"3 tables free in {city} for {party}" + (" on the terrace" if terrace else "")

    @function_tool(allow_cancellation=True)  # which offers the model the companion tools too
    async def report(self, ctx: RunContext, topic: str) -> str:
        """Write a report (slow; reports progress)."""
        await ctx.update(f"collecting {topic}", progress=0.1)
        await self.gate.wait()
        await ctx.update("writing", progress=0.5)
        return f"report on {topic} is ready"

    @function_tool
    async def ping(self, ctx: RunContext) -> str:
        """Answer pong."""
        return "pong"

    @function_tool
    async def echo(self, ctx: RunContext, value: Any) -> str:
        """Echo a value."""
        return repr(value)


class Silent(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="No tools.")


def _said(h: Harness) -> list[str]:
    return [it.text for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]


async def _turn(h: Harness, text: str) -> None:
    await h.session.input(text)
    await h.tools_done()
    await h.idle()


@pytest.mark.parametrize(
    "text",
    [
        'search_tables(city="Rome", party=2, terrace=true)',
        'search_tables {"city": "Rome", "party": 2, "terrace": true}',
    ],
    ids=["python", "json"],
)
async def test_a_direct_call_runs_the_tool_and_its_result_is_said(text: str) -> None:
    async with Harness(Concierge(), llm=StandInLLM()) as h:
        await _turn(h, text)
        calls = [it for it in h.chat() if isinstance(it, FunctionCall)]
        assert [(c.name, c.arguments) for c in calls] == [
            ("search_tables", {"city": "Rome", "party": 2, "terrace": True})
        ]
        assert _said(h) == ["search_tables: 3 tables free in Rome for 2 on the terrace"]
        h.check_invariants()


async def test_bad_arguments_give_the_tools_own_error_and_it_is_said() -> None:
    async with Harness(Concierge(), llm=StandInLLM()) as h:
        await _turn(h, 'search_tables(city="Rome", party="many")')
        [output] = [it for it in h.chat() if isinstance(it, FunctionCallOutput)]
        assert output.is_error and "party" in output.output
        [said] = _said(h)
        assert said.startswith("search_tables failed: ") and "party" in said


async def test_a_background_tool_is_said_only_when_it_ends() -> None:
    agent = Concierge()
    async with Harness(agent, llm=StandInLLM()) as h:
        await h.session.input('report(topic="sales")')
        await h.wait_for("tool.progress")
        await h.idle()
        assert _said(h) == [], "a tool moving to the background is no result"
        agent.gate.set()
        await h.tools_done()
        await h.wait_for("chat.item", lambda e: e.data["item"].get("role") == "assistant")
        await h.idle()
        assert _said(h) == ["report: report on sales is ready"]
        h.check_invariants()


async def test_any_other_message_gets_how_to_call_the_agents_own_tools() -> None:
    async with Harness(Concierge(), llm=StandInLLM()) as h:
        await _turn(h, "Can I book a table in Rome?")
        assert _said(h) == [
            "No model is configured for this agent; call a tool by writing it, like "
            "search_tables(city=..., party=..., terrace=...), report(topic=...) or ping() (it has 1 more)."
        ]
        assert "cancel_tool_call" in h.session.model_tools(), "the companions are offered, not named"
        await _turn(h, 'unknown_tool(city="Rome")')  # not one of its tools: the same sentence, nothing run
        assert len(_said(h)) == 2 and _said(h)[1] == _said(h)[0]
        assert not [it for it in h.chat() if isinstance(it, FunctionCall)]


async def test_an_agent_without_tools_is_told_how_to_connect_a_model() -> None:
    async with Harness(Silent(), llm=StandInLLM()) as h:
        await _turn(h, "hello")
        assert _said(h) == [CONNECT_A_MODEL]
        assert "SWITCHBOARD_MODELS" in CONNECT_A_MODEL


async def test_where_sessions_may_not_script_a_call_is_not_run() -> None:
    async with Harness(Concierge(), llm=StandInLLM(calls_tools=False)) as h:
        await _turn(h, "ping()")
        assert _said(h) == [CONNECT_A_MODEL]
        assert not [it for it in h.chat() if isinstance(it, FunctionCall)]


async def test_words_are_streamed_and_no_state_is_kept() -> None:
    llm = StandInLLM()
    llm.load_state({"position": 3})  # what a session that followed the old scripted default saved
    assert llm.save_state() is None
    user = ChatMessage(id=new_id("item"), role="user", text="hi", created_at=utcnow())
    request = LLMRequest(instructions="", items=[user], tools=[])
    words = [chunk.text async for chunk in llm.stream(request) if isinstance(chunk, TextDelta)]
    assert len(words) > 5 and "".join(words) == CONNECT_A_MODEL


async def test_an_explicit_script_still_answers_ok() -> None:
    async with Harness(Concierge(), llm=build_llm({"provider": "scripted"})) as h:
        await _turn(h, "ping()")
        assert _said(h) == ["OK."]
    async with Harness(Concierge(), llm=build_llm(None)) as h:  # the runtime's default (no service around it)
        await _turn(h, "ping()")
        assert _said(h) == ["OK."]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ping()", ("ping", {})),
        ("  ping ( )  ", ("ping", {})),
        ("echo(value=[1, -2.5, {'a': null}, None, True])", ("echo", {"value": [1, -2.5, {"a": None}, None, True]})),
        ('echo {"value": {"nested": [false]}}', ("echo", {"value": {"nested": [False]}})),
        ('echo("positional")', None),
        ("echo(**kwargs)", None),
        ('echo(value=open("x"))', None),
        ("echo(value=1) or ping()", None),
        ('echo {"value": 1', None),
        ("echo [1, 2]", None),
        ("please ping()", None),
        ("nothing(value=1)", None),
        # what the parsers give up on is no call, never an exception that leaves the input unanswered
        ('echo {"value": ' + "[" * 3000 + "]" * 3000 + "}", None),
        ("echo(value=" + "-" * 7900 + "1)", None),
        ("echo(value=" + "[" * 150 + "]" * 150 + ")", None),  # deeper than stored JSON may be
    ],
)
def test_what_counts_as_a_call(text: str, expected: tuple[str, dict[str, Any]] | None) -> None:
    assert parse_call(text, {"ping", "echo"}) == expected
