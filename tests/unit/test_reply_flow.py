"""Scenarios 1-7: the reply loop, interruptions, and completed tool work surviving them (I1)."""

from __future__ import annotations

import asyncio

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import ChatMessage

from .harness import Harness

LONG = " ".join(f"word{i}" for i in range(40))


class Counter(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.runs: list[str] = []

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something."""
        self.runs.append(what)
        return f"booked {what}"

    @function_tool
    async def slow_book(self, ctx: RunContext, what: str) -> str:
        """Book something slowly (not cancellable)."""
        await asyncio.sleep(0.15)
        self.runs.append(what)
        return f"slowly booked {what}"


async def test_preamble_tool_and_reply_commit_in_order():
    agent = Counter()
    turns = [
        {"text": "Let me book that.", "tool_calls": [{"name": "book", "arguments": {"what": "table"}}]},
        {"text": "Done: {{tool_output:book}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("book a table")
        await h.idle()
        assert h.summary() == [
            ("user", "book a table"),
            ("assistant", "Let me book that."),
            ("call", "book"),
            ("output", "book", "booked table"),
            ("assistant", "Done: booked table"),
        ]
        assert [r.step for r in h.llm.requests] == [0, 1]
        h.check_invariants()


async def test_interruption_while_speaking_keeps_only_heard_words():
    async with Harness(Counter(), [{"text": LONG}]) as h:
        res = await h.session.input("talk")
        await h.wait_for("speech.started")
        await asyncio.sleep(0.06)
        speech = await h.session.interrupt()
        assert speech is not None and speech.id == res.speech_id
        msgs = [it for it in h.chat() if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert len(msgs) == 1
        heard = msgs[0]
        assert heard.interrupted is True
        assert heard.text and heard.text != LONG and LONG.startswith(heard.text)
        assert len(heard.text.split()) < 40
        ev = h.of_type("speech.interrupted")[0]
        assert ev.data == {"speech_id": speech.id, "played_text": heard.text}
        assert h.session.speech(speech.id).played_text == heard.text
        h.check_invariants()


async def test_interruption_by_injected_input_orders_chat():
    async with Harness(Counter(), [{"text": LONG}, {"text": "Sure, stopping."}]) as h:
        await h.session.input("talk")
        await h.wait_for("speech.started")
        await asyncio.sleep(0.05)
        await h.session.input("stop please", interrupt=True)
        await h.idle()
        s = h.summary()
        assert [x[0] for x in s] == ["user", "assistant", "user", "assistant"]
        assert s[1][-1] == "interrupted"
        assert s[2] == ("user", "stop please")
        assert s[3] == ("assistant", "Sure, stopping.")
        h.check_invariants()


async def test_interruption_before_any_word_commits_no_empty_message():
    async with Harness(Counter(), [{"text": "Hello there", "ttft_ms": 300}]) as h:
        await h.session.input("hi")
        await h.wait_for("generation.started")
        speech = await h.session.interrupt()
        assert speech is not None and speech.interrupted
        assert h.summary() == [("user", "hi")]
        assert h.of_type("speech.interrupted")[0].data["played_text"] == ""
        assert "speech.started" not in h.types()


async def test_interruption_after_playout_started_but_before_first_word():
    from switchboard.runtime.playout import SimulatedPlayout

    async with Harness(Counter(), [{"text": "Hello there"}], playout=SimulatedPlayout(2.0)) as h:
        await h.session.input("hi")
        await h.wait_for("speech.started")
        await h.session.interrupt()
        assert h.summary() == [("user", "hi")]


async def test_I1_completed_tool_survives_interrupted_preamble():
    agent = Counter()
    turns = [
        {"text": LONG, "tool_calls": [{"name": "book", "arguments": {"what": "room"}}]},
        {"text": "Never said"},
    ]
    async with Harness(agent, turns, fallback={"text": "I see {{tool_output:book}}"}) as h:
        await h.session.input("book a room")
        await h.wait_for("tool.ended")  # the tool finished while the preamble is still playing
        await h.session.interrupt()
        await h.idle()
        assert agent.runs == ["room"]
        assert len(h.llm.requests) == 1, "no tool reply after an interruption"
        calls = [x for x in h.summary() if x[0] == "call"]
        assert calls == [("call", "book")]
        # the next model request sees the completed result; the model is not made to call the tool again
        h.llm.position = len(h.llm.turns)
        await h.session.input("what happened?")
        await h.idle()
        assert h.summary()[-1] == ("assistant", "I see booked room")
        assert agent.runs == ["room"]
        h.check_invariants()


async def test_I1_tool_in_flight_at_interruption_completes_and_commits_once():
    agent = Counter()
    turns = [{"text": LONG, "tool_calls": [{"name": "slow_book", "arguments": {"what": "car"}}]}]
    async with Harness(agent, turns) as h:
        await h.session.input("book a car")
        await h.wait_for("tool.started")
        await h.session.interrupt()
        assert h.session.executor.running(), "the tool runs on after the interruption"
        await h.tools_done()
        await h.idle()
        assert agent.runs == ["car"]
        outputs = [x for x in h.summary() if x[0] == "output"]
        assert outputs == [("output", "slow_book", "slowly booked car")]
        assert h.store.tool_calls[h.sid][h.of_type("tool.ended")[0].data["call_id"]].status == "completed"
        assert len(h.llm.requests) == 1
        h.check_invariants()


async def test_I1_interrupted_tool_reply_keeps_pair_and_has_no_reply():
    agent = Counter()
    turns = [
        {"text": "One moment.", "tool_calls": [{"name": "book", "arguments": {"what": "seat"}}]},
        {"text": "Your seat is booked", "ttft_ms": 300},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("book a seat")
        await h.wait_for("generation.started", lambda e: e.data["step"] == 1)
        await h.session.interrupt()
        await h.idle()
        assert h.summary() == [
            ("user", "book a seat"),
            ("assistant", "One moment."),
            ("call", "book"),
            ("output", "book", "booked seat"),
        ]
        h.check_invariants()
