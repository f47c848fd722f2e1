"""Scenario 10: preemptive (speculative) generation and the model's view of running calls (I2)."""

from __future__ import annotations

import asyncio

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import PLACEHOLDER_OUTPUT, ChatMessage, FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.llm.base import LLMRequest
from tests.waiting import WAIT_S

from .harness import Harness

LONG = " ".join(f"word{i}" for i in range(40))


class Gated(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    @function_tool
    async def lookup(self, ctx: RunContext, what: str) -> str:
        """Look something up (waits for the test to open the gate)."""
        self.entered.set()
        await self.gate.wait()
        return f"found {what}"


def last_user_text(request: LLMRequest) -> str | None:
    users = [it for it in request.items if isinstance(it, ChatMessage) and it.role == "user"]
    return users[-1].text if users else None


def assert_requests_valid(h: Harness) -> None:
    for r in h.llm.requests:
        assert validate(r.items) == [], validate(r.items)


async def wait_requests(h: Harness, n: int, timeout: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout):
        while len(h.llm.requests) < n:
            await asyncio.sleep(0.002)


async def test_I2_no_speculative_generation_while_a_foreground_tool_runs():
    agent = Gated()
    turns = [
        {"text": "One moment.", "tool_calls": [{"name": "lookup", "arguments": {"what": "x"}, "id": "c1"}]},
        {"text": "Here it is: {{tool_output:lookup}}"},
        {"text": "Tomorrow is fine."},
    ]
    async with Harness(agent, turns, preemptive_generation=True) as h:
        await h.session.input("look up x")
        await asyncio.wait_for(agent.entered.wait(), WAIT_S)
        await h.session.input("what about", final=False)
        await h.session.input("what about tomorrow", final=False)
        await asyncio.sleep(0.05)
        assert [r.preemptive for r in h.llm.requests] == [False], "nothing speculative while the tool runs"
        assert h.session.speculation.generation is None

        agent.gate.set()
        await wait_requests(h, 3)
        # the tool reply goes first; the speculative reply waits until nothing is about to change the context
        assert [r.preemptive for r in h.llm.requests] == [False, False, True]
        spec = h.llm.requests[2]
        assert last_user_text(spec) == "what about tomorrow"
        # its snapshot holds the completed pair and the tool reply, never a call without its output
        outputs = [it for it in spec.items if isinstance(it, FunctionCallOutput)]
        assert [(o.call_id, o.output) for o in outputs] == [("c1", "found x")]
        assert any(isinstance(it, ChatMessage) and it.text == "Here it is: found x" for it in spec.items)
        await h.idle()

        res = await h.session.input("what about tomorrow")  # matches, context unchanged: the speculation is used
        await h.idle()
        started = h.of_type("generation.started")[-1]
        assert started.data == {"speech_id": res.speech_id, "step": 0, "preemptive": True}
        assert len(h.llm.requests) == 3
        assert h.summary()[-2:] == [("user", "what about tomorrow"), ("assistant", "Tomorrow is fine.")]
        assert_requests_valid(h)
        h.check_invariants()


async def test_I2_speculative_result_used_when_final_text_matches_and_context_unchanged():
    turns = [{"text": "Hello to you."}, {"text": "Second."}]
    async with Harness(Gated(), turns, preemptive_generation=True) as h:
        await h.session.input("hello", final=False)
        assert [r.preemptive for r in h.llm.requests] == [True]
        await asyncio.sleep(0.02)  # the speculative reply streams ahead
        res = await h.session.input("hello")
        await h.idle()
        assert h.of_type("generation.started")[0].data == {
            "speech_id": res.speech_id,
            "step": 0,
            "preemptive": True,
        }
        assert len(h.llm.requests) == 1, "no extra model request"
        assert last_user_text(h.llm.requests[0]) == "hello"
        assert h.summary() == [("user", "hello"), ("assistant", "Hello to you.")]
        interim = [e.data for e in h.of_type("user.input")]
        assert [(d["text"], d["final"], d["item_id"] is None) for d in interim] == [
            ("hello", False, True),
            ("hello", True, False),
        ]
        h.check_invariants()


async def test_I2_speculative_result_discarded_when_final_text_differs():
    turns = [{"text": "First answer."}, {"text": "Second answer."}]
    async with Harness(Gated(), turns, preemptive_generation=True) as h:
        await h.session.input("hello", final=False)
        await asyncio.sleep(0.02)
        res = await h.session.input("hello there")
        await h.idle()
        assert [r.preemptive for r in h.llm.requests] == [True, False]
        assert last_user_text(h.llm.requests[1]) == "hello there"
        assert h.of_type("generation.started")[0].data == {
            "speech_id": res.speech_id,
            "step": 0,
            "preemptive": False,
        }
        # the discarded speculative reply gave its script turn back: the real reply uses the same turn
        assert h.summary() == [("user", "hello there"), ("assistant", "First answer.")]
        await h.session.input("and then?")
        await h.idle()
        assert h.summary()[-1] == ("assistant", "Second answer.")
        h.check_invariants()


async def test_I2_speculative_result_discarded_when_context_changed_meanwhile():
    turns = [{"text": "First answer."}, {"text": "Second answer."}]
    async with Harness(Gated(), turns, preemptive_generation=True) as h:
        await h.session.input("hello", final=False)
        await asyncio.sleep(0.02)
        await h.session.say("Hi!")  # committed between the interim and the final input
        await h.idle()
        assert h.summary() == [("assistant", "Hi!")]
        res = await h.session.input("hello")
        await h.idle()
        assert [r.preemptive for r in h.llm.requests] == [True, False]
        fresh = h.llm.requests[1]
        assert [(it.role, it.text) for it in fresh.items if isinstance(it, ChatMessage)] == [
            ("assistant", "Hi!"),
            ("user", "hello"),
        ]
        started = [e.data for e in h.of_type("generation.started")]
        assert started == [{"speech_id": res.speech_id, "step": 0, "preemptive": False}]
        assert h.summary() == [("assistant", "Hi!"), ("user", "hello"), ("assistant", "First answer.")]
        h.check_invariants()


async def test_I2_running_call_from_an_earlier_turn_is_shown_as_placeholder():
    agent = Gated()
    turns = [
        {"text": LONG, "tool_calls": [{"name": "lookup", "arguments": {"what": "x"}, "id": "c1"}]},
        {"text": "Still on it."},
        {"text": "Now I know: {{tool_output:lookup}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("look up x")
        await asyncio.wait_for(agent.entered.wait(), WAIT_S)
        await h.session.input("are you there?", interrupt=True)
        await h.idle()
        assert h.session.tool_call("c1").status == "running"
        second = h.llm.requests[1]
        pair = [it for it in second.items if isinstance(it, FunctionCall | FunctionCallOutput)]
        assert [(type(it).__name__, it.call_id) for it in pair] == [
            ("FunctionCall", "c1"),
            ("FunctionCallOutput", "c1"),
        ]
        assert pair[1].output == PLACEHOLDER_OUTPUT
        assert not any(isinstance(it, FunctionCall | FunctionCallOutput) for it in h.chat()), "never persisted"
        agent.gate.set()
        await h.tools_done()
        await h.session.input("and?")
        await h.idle()
        assert h.summary()[-1] == ("assistant", "Now I know: found x")
        assert_requests_valid(h)
        h.check_invariants()
