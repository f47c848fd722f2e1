"""A live session on the OpenAI-compatible provider, against a real HTTP server on loopback: tool calls streamed by
the server run and their results go back in Chat Completions form, what was heard is what the model is told, token
usage is recorded on the speech, and a provider error fails one generation, not the session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.llm.openai import OpenAILLM
from switchboard.runtime.speech import SpeechUsage

from . import fake_openai as f
from .fake_openai import FakeOpenAI, Reply
from .harness import Harness

LONG = [f"word{i} " for i in range(40)]


class Booker(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You book tables.")
        self.runs: list[str] = []

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something."""
        self.runs.append(what)
        return f"booked {what}"


@pytest.fixture
async def server() -> AsyncIterator[FakeOpenAI]:
    srv = await FakeOpenAI().start()
    yield srv
    await srv.aclose()


def harness(server: FakeOpenAI, agent: Agent, **config: Any) -> Harness:
    llm = OpenAILLM.from_config({"model": "fake-model", "base_url": server.base_url, **config})
    return Harness(agent, llm=llm)


async def test_a_streamed_tool_call_runs_and_its_result_goes_back_as_a_tool_message(server: FakeOpenAI) -> None:
    agent = Booker()
    server.script(
        Reply(
            events=[
                f.role(),
                f.text("Let me "),
                f.text("book that."),
                f.tool(0, id="call_1", name="book", args='{"what": "ta'),
                f.tool(0, args='ble"}'),
                f.finish("tool_calls"),
                f.usage(20, 5),
            ]
        ),
        f.text_reply("Done, ", "booked.", prompt=30, completion=2),
    )
    async with harness(server, agent) as h:
        res = await h.session.input("book a table")
        await h.idle()
        assert agent.runs == ["table"]
        assert h.summary() == [
            ("user", "book a table"),
            ("assistant", "Let me book that."),
            ("call", "book"),
            ("output", "book", "booked table"),
            ("assistant", "Done, booked."),
        ]
        first, second = server.bodies()
        assert first["tool_choice"] == "auto"
        assert [t["function"]["name"] for t in first["tools"]] == ["book"]
        assert second["messages"] == [
            {"role": "system", "content": "You book tables."},
            {"role": "user", "content": "book a table"},
            {
                "role": "assistant",
                "content": "Let me book that.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "book", "arguments": json.dumps({"what": "table"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "booked table"},
        ]
        # usage from both steps is summed on the speech, live and as stored
        assert res.speech_id is not None
        speech = h.session.speech(res.speech_id)
        assert speech is not None and speech.info().usage == SpeechUsage(prompt_tokens=50, completion_tokens=7)
        assert h.store.speeches[h.sid][res.speech_id].usage == SpeechUsage(prompt_tokens=50, completion_tokens=7)
        h.check_invariants()


async def test_an_interrupted_reply_is_sent_back_as_heard(server: FakeOpenAI) -> None:
    server.script(f.text_reply(*LONG), f.text_reply("Sure, ", "stopping."))
    async with harness(server, Booker()) as h:
        await h.session.input("talk")
        await h.wait_for("speech.started")
        await asyncio.sleep(0.06)
        await h.session.input("stop please", interrupt=True)
        await h.idle()
        heard = next(it for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant")
        full = "".join(LONG).strip()
        assert heard.interrupted and heard.text and full.startswith(heard.text) and heard.text != full
        second = server.bodies()[1]
        assert second["messages"][1:] == [
            {"role": "user", "content": "talk"},
            {"role": "assistant", "content": heard.text},  # only what the user heard
            {"role": "user", "content": "stop please"},
        ]
        assert h.summary()[-1] == ("assistant", "Sure, stopping.")
        h.check_invariants()


async def test_an_interruption_closes_the_model_stream(server: FakeOpenAI) -> None:
    server.script(Reply(events=[f.role(), f.text("Hello "), f.text("there.")], stall=True))
    async with harness(server, Booker()) as h:
        await h.session.input("hi")
        await h.wait_for("speech.started")
        await h.session.interrupt()
        await server.wait_disconnect(timeout=1.0)  # bound: the server is told at once: it can stop generating
        done = await h.wait_for("speech.done")
        assert done.data["interrupted"] is True
        assert h.of_type("generation.failed") == []
        h.check_invariants()


async def test_a_provider_error_fails_the_generation_and_the_next_input_is_answered(server: FakeOpenAI) -> None:
    server.script(
        Reply(status=404, body={"error": {"message": "The model `fake-model` does not exist"}}),
        f.text_reply("Hello ", "again."),
    )
    async with harness(server, Booker()) as h:
        first = await h.session.input("hi")
        failed = await h.wait_for("generation.failed")
        assert failed.data["speech_id"] == first.speech_id
        assert failed.data["error"] == "the model server answered 404: The model `fake-model` does not exist"
        await h.idle()
        second = await h.session.input("hello?")
        await h.idle()
        assert second.speech_id != first.speech_id
        assert h.summary() == [("user", "hi"), ("user", "hello?"), ("assistant", "Hello again.")]
        assert len(server.requests) == 2  # a 404 is not retried
        h.check_invariants()


class Tracker(Booker):
    @function_tool
    async def track(self, ctx: RunContext, what: str) -> str:
        """Track something in the background (done at once after its update: the step may see both)."""
        await ctx.update(f"tracking {what}")
        return f"tracked {what}"


async def test_the_step_that_answers_a_progress_update_is_sent_with_tool_choice_none(server: FakeOpenAI) -> None:
    agent = Tracker()
    server.script(
        Reply(
            events=[
                f.role(),
                f.text("Tracking it."),
                f.tool(0, id="call_1", name="track", args='{"what": "parcel"}'),
                f.finish("tool_calls"),
            ]
        ),
        f.text_reply("It is running."),
        f.text_reply("It is tracked."),
    )
    async with harness(server, agent) as h:
        await h.session.input("track my parcel")
        await h.tools_done()
        await h.idle()
        bodies = server.bodies()
        assert [b["tool_choice"] for b in bodies[:2]] == ["auto", "none"]
        assert [t["function"]["name"] for t in bodies[1]["tools"]] == ["book", "track"], "still described"
