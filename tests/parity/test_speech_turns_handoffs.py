"""LiveKit Agents parity: speech, turns and handoffs (docs/livekit-parity.md), on the virtual clock.

Each test is named after the behaviour it pins; the runtime API drives a session on a scripted model.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import pytest

from switchboard import Agent, RunContext, StopResponse, function_tool
from switchboard.integrations.agents_file import load_agents_file
from switchboard.integrations.webhooks import Webhooks
from switchboard.runtime.agent import NewMessage, TurnContext
from switchboard.runtime.chat import AgentHandoff, ChatMessage
from switchboard.runtime.playout import ReportedStream, SimulatedPlayout
from switchboard.runtime.speech import SPEECH_PRIORITY_HIGH, SPEECH_PRIORITY_LOW, NotInterruptible

from ..unit.harness import Harness
from .clock import Timeline, on_virtual_clock

LONG = " ".join(f"word{i}" for i in range(40))  # 0.4 s at the harness's 100 words per second


class Plain(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You help.", name="plain")


async def speaking(h: Harness) -> None:
    """Wait until the agent has been heard for a moment."""
    await h.wait_for("speech.started")
    await asyncio.sleep(0.05)


def assistant_texts(h: Harness) -> list[str]:
    return [row[1] for row in h.summary() if row[0] == "assistant"]


# -- 1. "speaking" only when audio starts ---------------------------------------------------------------------


@on_virtual_clock
async def test_speaking_starts_when_audio_starts_not_at_the_first_token() -> None:
    loop = asyncio.get_running_loop()
    h = Harness(Plain(), [{"text": "Hello there.", "ttft_ms": 200}], playout=SimulatedPlayout(10, first_audio_s=0.3))
    timeline = Timeline(h)
    async with h:
        asked = loop.time()
        result = await h.session.input("hi")
        await asyncio.sleep(0.35)  # the first token came at 0.2 s; audio starts at 0.5 s
        speech = h.session.speech(result.speech_id or "")
        assert speech is not None and speech.state == "generating"
        assert h.session.agent_state == "thinking" and h.of_type("speech.started") == []
        await h.idle()
    assert timeline.time_of("generation.started") == pytest.approx(asked)
    assert timeline.time_of("speech.started") == pytest.approx(asked + 0.5)
    assert timeline.time_of("agent.state", lambda e: e.data["state"] == "speaking") == pytest.approx(asked + 0.5)
    assert timeline.states() == ["listening", "thinking", "speaking", "listening"]
    h.check_invariants()


@on_virtual_clock
async def test_barge_in_before_audio_goes_thinking_to_listening_without_speaking() -> None:
    turns = [{"text": LONG, "ttft_ms": 200}, {"text": "Yes?"}]
    h = Harness(Plain(), turns, playout=SimulatedPlayout(100, first_audio_s=0.5))
    timeline = Timeline(h)
    async with h:
        first = await h.session.input("tell me everything")
        await asyncio.sleep(0.4)  # tokens are streaming, no audio yet (it would start at 0.7 s)
        await h.session.interrupt()  # the user starts talking (a media edge's barge-in)
        await asyncio.sleep(0.3)
        await h.session.input("wait")  # the end of the user's turn
        await h.idle()
    assert timeline.states() == ["listening", "thinking", "listening", "thinking", "speaking", "listening"]
    assert [e.data["speech_id"] for e in h.of_type("speech.started")] != [first.speech_id]
    interrupted = h.of_type("speech.interrupted")
    assert [(e.data["speech_id"], e.data["played_text"]) for e in interrupted] == [(first.speech_id, "")]
    assert h.summary() == [("user", "tell me everything"), ("user", "wait"), ("assistant", "Yes?")]
    h.check_invariants()


@on_virtual_clock
async def test_an_input_that_interrupts_goes_from_speaking_straight_to_thinking() -> None:
    async with Harness(Plain(), [{"text": LONG}, {"text": "Ok, I'll stop now."}]) as h:
        timeline = Timeline(h)
        await h.session.input("tell me a story")
        await speaking(h)
        await h.session.input("stop from text input")
        await h.idle()
        assert timeline.states() == ["thinking", "speaking", "thinking", "speaking", "listening"]
        assert h.summary()[2:] == [("user", "stop from text input"), ("assistant", "Ok, I'll stop now.")]
        h.check_invariants()


@on_virtual_clock
async def test_an_input_that_interrupts_and_asks_no_reply_goes_back_to_listening() -> None:
    async with Harness(Plain(), [{"text": LONG}]) as h:
        timeline = Timeline(h)
        await h.session.input("tell me a story")
        await speaking(h)
        await h.session.input("a note for later", reply=False)
        await h.idle()
        assert timeline.states() == ["thinking", "speaking", "listening"]
        h.check_invariants()


async def _end_of_speech_to_audio(*, preemptive: bool) -> float:
    """LiveKit's fakes: the turn ends 0.5 s after the user stopped speaking, the model's first token takes 0.3 s
    and the voice's first audio 0.3 s more."""
    loop = asyncio.get_running_loop()
    turns = [{"text": "Tomorrow at nine works.", "ttft_ms": 300}]
    playout = SimulatedPlayout(100, first_audio_s=0.3)
    h = Harness(Plain(), turns, playout=playout, preemptive_generation=preemptive)
    timeline = Timeline(h)
    async with h:
        stopped_speaking = loop.time()
        await h.session.input("book tomorrow at nine", final=False)  # the transcript as the user stops
        await asyncio.sleep(0.5)  # end of turn
        await h.session.input("book tomorrow at nine")
        await h.idle()
    h.check_invariants()
    return timeline.time_of("speech.started") - stopped_speaking


@on_virtual_clock
async def test_preemptive_generation_shows_its_gain_measured_at_audio_start() -> None:
    assert await _end_of_speech_to_audio(preemptive=False) == pytest.approx(1.1)
    assert await _end_of_speech_to_audio(preemptive=True) == pytest.approx(0.8)


class EdgePlayout:
    """Streams played by a media edge: the test sends the frames the edge would send."""

    def __init__(self) -> None:
        self.streams: list[ReportedStream] = []
        self.stops = 0

    def start(self, speech_id: str) -> ReportedStream:
        self.streams.append(ReportedStream(on_stop=self._stopped))
        return self.streams[-1]

    def _stopped(self) -> None:
        self.stops += 1


@on_virtual_clock
async def test_playback_started_is_reported_by_the_playout_so_a_media_edge_can_drive_it() -> None:
    edge = EdgePlayout()
    async with Harness(Plain(), [{"text": "Hi there."}, {"text": "Sure."}], playout=edge) as h:
        await h.session.input("hi")
        await asyncio.sleep(1.0)  # the model is done; the edge has not started playing
        assert h.of_type("speech.started") == [] and h.session.agent_state == "thinking"
        edge.streams[0].playback_started()
        assert len(h.of_type("speech.started")) == 1 and h.session.agent_state == "speaking"
        edge.streams[0].playback_finished()
        await h.idle()
        assert h.summary() == [("user", "hi"), ("assistant", "Hi there.")] and edge.stops == 0

        # a barge-in mid-sentence keeps what the edge reported heard, without waiting for the edge to stop
        await h.session.say("One two three four.")
        await asyncio.sleep(0.1)
        edge.streams[1].playback_started()
        edge.streams[1].playback_progress(len("One two"))
        await h.session.input("stop")
        assert edge.stops == 1
        while len(edge.streams) < 3:  # the reply to "stop" is generating
            await asyncio.sleep(0.01)
        edge.streams[2].playback_started()
        edge.streams[2].playback_finished()
        await h.idle()
        assert h.summary()[2:] == [("assistant", "One two", "interrupted"), ("user", "stop"), ("assistant", "Sure.")]
        h.check_invariants()


@on_virtual_clock
async def test_a_cut_reply_commits_what_was_generated_when_the_sink_reports_no_heard_text() -> None:
    edge = EdgePlayout()
    async with Harness(Plain(), [{"text": "One two three four."}, {"text": "Sure."}], playout=edge) as h:
        await h.session.input("count")
        await asyncio.sleep(0.1)
        edge.streams[0].playback_started()  # a sink with no word timings: it never reports a position
        await h.session.input("stop")
        while len(edge.streams) < 2:  # the reply to "stop" is generating
            await asyncio.sleep(0.01)
        edge.streams[1].playback_finished()
        await h.idle()
        assert h.summary()[1:] == [
            ("assistant", "One two three four.", "interrupted"),
            ("user", "stop"),
            ("assistant", "Sure."),
        ]

        # closed while it plays: the same
        await h.session.say("Five six seven.")
        await asyncio.sleep(0.1)
        edge.streams[2].playback_started()
    assert h.summary()[-1] == ("assistant", "Five six seven.", "interrupted")
    h.check_invariants()


@on_virtual_clock
async def test_a_sink_that_reports_positions_is_trusted_even_when_nothing_was_heard() -> None:
    edge = EdgePlayout()
    async with Harness(Plain(), [{"text": "One two three four."}, {"text": "Sure."}], playout=edge) as h:
        await h.session.input("count")
        await asyncio.sleep(0.1)
        edge.streams[0].playback_started()
        edge.streams[0].playback_progress(0)  # its word timings: not one word was heard yet
        await h.session.input("stop")
        while len(edge.streams) < 2:  # the reply to "stop" is generating
            await asyncio.sleep(0.01)
        edge.streams[1].playback_finished()
        await h.idle()
        assert h.summary() == [("user", "count"), ("user", "stop"), ("assistant", "Sure.")]
        h.check_invariants()


@on_virtual_clock
async def test_a_close_waits_briefly_for_the_trailing_transcript_of_a_user_turn_under_way() -> None:
    loop = asyncio.get_running_loop()
    async with Harness(Plain(), [], fallback={"text": "never said"}) as h:
        await h.session.input("I would like to", final=False)  # the user is talking
        asked = loop.time()
        closing = asyncio.create_task(h.session.aclose())
        await asyncio.sleep(0.5)
        result = await h.session.input("I would like to cancel my order")  # the final transcript, just after
        await closing
        assert loop.time() - asked == pytest.approx(0.5)
    assert result.item_id is not None and result.speech_id is None, "recorded, not answered: the session closes"
    assert h.summary() == [("user", "I would like to cancel my order")]
    assert not h.llm.requests
    h.check_invariants()


@on_virtual_clock
async def test_a_close_waits_for_a_trailing_transcript_two_seconds_at_most_and_not_at_all_without_a_turn() -> None:
    loop = asyncio.get_running_loop()
    async with Harness(Plain(), []) as h:
        asked = loop.time()
        await h.session.aclose()  # nobody is talking: at once
        assert loop.time() == pytest.approx(asked)
    async with Harness(Plain(), []) as h:
        await h.session.input("and one more", final=False)
        asked = loop.time()
        await h.session.aclose()
        assert loop.time() - asked == pytest.approx(2.0)  # LiveKit's session_close_transcript_timeout
    assert h.summary() == []


# -- 2. an interrupt interrupts the chain -----------------------------------------------------------------------


@on_virtual_clock
async def test_interrupt_interrupts_the_current_speech_and_every_queued_one() -> None:
    async with Harness(Plain(), [{"text": LONG}, {"text": "A queued reply."}]) as h:
        current = await h.session.input("talk")
        await speaking(h)
        queued_say = await h.session.say("A queued announcement.")
        queued_reply = await h.session.generate_reply()
        interrupted = await h.session.interrupt()
        await h.idle()
        assert interrupted is not None and interrupted.id == current.speech_id
        done = {e.data["speech_id"]: e.data["interrupted"] for e in h.of_type("speech.done")}
        assert done == {current.speech_id: True, queued_say.id: True, queued_reply.id: True}
        assert len(h.llm.requests) == 1, "the queued reply never generated"
        assert [row[0] for row in h.summary()] == ["user", "assistant"]
        h.check_invariants()


@on_virtual_clock
async def test_interrupt_stops_at_the_first_speech_that_disallows_interruptions() -> None:
    async with Harness(Plain(), [{"text": LONG}]) as h:
        await h.session.input("talk")
        await speaking(h)
        before = await h.session.say("Before the notice.")
        notice = await h.session.say("This call is recorded.", allow_interruptions=False)
        after = await h.session.say("After the notice.")
        await h.session.interrupt()
        await h.idle()
        assert before.interrupted and not notice.interrupted and not after.interrupted
        assert assistant_texts(h)[1:] == ["This call is recorded.", "After the notice."]
        h.check_invariants()


@on_virtual_clock
async def test_interrupt_force_interrupts_the_whole_chain() -> None:
    async with Harness(Plain(), []) as h:
        current = await h.session.say(LONG, allow_interruptions=False)
        await speaking(h)
        notice = await h.session.say("This call is recorded.", allow_interruptions=False)
        with pytest.raises(NotInterruptible):
            await h.session.interrupt()
        assert not current.interrupted and not notice.interrupted, "a refused interrupt interrupts nothing"
        await h.session.interrupt(force=True)
        await h.idle()
        assert current.interrupted and notice.interrupted
        assert "This call is recorded." not in assistant_texts(h)
        h.check_invariants()


@on_virtual_clock
async def test_interrupt_chain_loses_nothing_and_the_newest_input_gets_its_reply() -> None:
    turns = [{"text": LONG}, {"text": "Answering all three."}]
    async with Harness(Plain(), turns) as h:
        await h.session.input("first")
        await speaking(h)
        second = await h.session.input("second", interrupt=False)  # queued behind the first reply
        third = await h.session.input("third")  # barge-in: both replies are interrupted
        await h.idle()
        assert h.session.speech(second.speech_id or "").interrupted  # type: ignore[union-attr]
        users = [row[1] for row in h.summary() if row[0] == "user"]
        assert users == ["first", "second", "third"], "the user messages of interrupted replies stay"
        last = h.llm.requests[-1]
        assert last.speech_id == third.speech_id
        assert [it.text for it in last.items if isinstance(it, ChatMessage) and it.role == "user"] == users
        assert h.summary()[-1] == ("assistant", "Answering all three.")
        h.check_invariants()


@on_virtual_clock
async def test_say_without_interruptions_is_a_barrier_in_the_queue() -> None:
    turns = [{"text": LONG}, {"text": "Sure, stopping."}]
    async with Harness(Plain(), turns) as h:
        await h.session.input("go on")
        await speaking(h)
        await h.session.say("Please hold while I check.", allow_interruptions=False)
        await h.session.input("stop")  # interrupts the reply; the barrier and what follows it play in full
        await h.idle()
        rows = h.summary()
        assert rows[1][0] == "assistant" and rows[1][-1] == "interrupted"
        assert rows[2:] == [
            ("user", "stop"),
            ("assistant", "Please hold while I check."),
            ("assistant", "Sure, stopping."),
        ]
        h.check_invariants()


@on_virtual_clock
async def test_a_cancelled_protected_speech_is_no_barrier() -> None:
    async with Harness(Plain(), [{"text": LONG}]) as h:
        await h.session.input("talk")
        await speaking(h)
        notice = await h.session.say("This call is recorded.", allow_interruptions=False)
        behind = await h.session.say("After the notice.")
        notice.interrupt(force=True)  # its caller cancelled it: it will never play, so it leaves no gap
        await h.session.interrupt()
        await h.idle()
        assert notice.interrupted and behind.interrupted
        assert assistant_texts(h)[1:] == []
        h.check_invariants()


@on_virtual_clock
async def test_a_protected_speech_cancelled_while_it_plays_does_not_refuse_an_interrupt() -> None:
    async with Harness(Plain(), []) as h:
        current = await h.session.say(LONG, allow_interruptions=False)
        await speaking(h)
        behind = await h.session.say("After it.")
        current.interrupt(force=True)
        assert await h.session.interrupt() is current  # no NotInterruptible: it is cancelled already
        await h.idle()
        assert behind.interrupted
        assert "After it." not in assistant_texts(h)
        h.check_invariants()


@on_virtual_clock
async def test_speech_priorities_order_the_queue() -> None:
    async with Harness(Plain(), []) as h:
        await h.session.say(LONG)
        await speaking(h)
        await h.session.say("low", priority=SPEECH_PRIORITY_LOW)
        await h.session.say("normal one")
        await h.session.say("high", priority=SPEECH_PRIORITY_HIGH)
        await h.session.say("normal two")
        await h.idle()
        assert assistant_texts(h) == [LONG, "high", "normal one", "normal two", "low"]
        h.check_invariants()


# -- 3 and 4. handoffs ------------------------------------------------------------------------------------------


class Billing(Agent):
    def __init__(self, log: list[str] | None = None, greet: bool = False) -> None:
        super().__init__(instructions="You are billing.", name="billing")
        self.log = log if log is not None else []
        self.greet = greet

    async def on_enter(self) -> None:
        self.log.append("billing enters")
        if self.greet:
            await self.session.generate_reply(instructions="Greet the caller.")


class Front(Agent):
    def __init__(self, *, greet: bool = False) -> None:
        super().__init__(instructions="You are the front desk.", name="front")
        self.log: list[str] = []
        self.greet = greet
        self.returned_at: float | None = None

    async def on_exit(self) -> None:
        self.log.append("front exits")

    @function_tool
    async def refund(self, ctx: RunContext) -> tuple[Agent, str]:
        """Refund the caller, then hand them to billing."""
        self.returned_at = asyncio.get_running_loop().time()
        return Billing(self.log), "Refunded $20."

    @function_tool
    async def transfer(self, ctx: RunContext) -> Agent:
        """Hand the caller to billing."""
        return Billing(self.log, greet=self.greet)


@on_virtual_clock
async def test_handoff_is_applied_when_the_speech_holding_the_call_completes() -> None:
    agent = Front()
    turns = [{"text": LONG, "tool_calls": [{"name": "refund", "id": "r1"}]}, {"text": "Billing here."}]
    h = Harness(agent, turns)
    timeline = Timeline(h)
    async with h:
        await h.session.input("refund me")
        await h.wait_for("tool.started")
        await asyncio.sleep(0.1)
        assert agent.returned_at is not None, "the tool has returned"
        assert h.session.agent.name == "front" and h.session.tool_call("r1").status == "running"  # type: ignore[union-attr]
        await h.idle()
        assert h.session.agent.name == "billing"
        heard = timeline.time_of("chat.item", lambda e: e.data["item"].get("text") == LONG)
        assert timeline.time_of("agent.handoff") >= heard > agent.returned_at + 0.3
        assert h.summary() == [
            ("user", "refund me"),
            ("assistant", LONG),
            ("call", "refund"),
            ("output", "refund", "Refunded $20."),
            ("handoff", "front", "billing"),
            ("assistant", "Billing here."),
        ]
        assert h.llm.requests[-1].instructions == "You are billing."
        assert agent.log == ["front exits", "billing enters"]
        h.check_invariants()


@on_virtual_clock
async def test_handoff_is_refused_when_its_speech_is_interrupted_keeping_the_result_with_a_note() -> None:
    agent = Front()
    turns = [
        {"text": LONG, "tool_calls": [{"name": "refund", "id": "r1"}]},
        {"text": "Front desk: {{tool_output:refund}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("refund me")
        await h.wait_for("tool.started")
        await asyncio.sleep(0.1)
        await h.session.interrupt()
        await h.tools_done()
        call = h.session.tool_call("r1")
        assert call is not None and call.status == "completed" and not call.is_error
        note = "Refunded $20.\n\n(The handoff to billing was not done: the agent was interrupted before the handoff.)"
        assert call.output == note, "the refund happened: its result is kept, with a note"
        assert h.session.agent.name == "front" and agent.log == []
        assert not any(isinstance(it, AgentHandoff) for it in h.chat()) and h.of_type("agent.handoff") == []
        await h.session.input("so?")
        await h.idle()
        assert h.summary()[-1] == ("assistant", f"Front desk: {note}")
        h.check_invariants()


class Booking(Front):
    def __init__(self) -> None:
        super().__init__()
        self.booked = asyncio.Event()

    @function_tool
    async def book(self, ctx: RunContext) -> str:
        """A booking that cannot be cancelled: a handoff waits for it."""
        await asyncio.sleep(1.0)
        self.booked.set()
        return "Booked."


@on_virtual_clock
async def test_handoff_is_refused_when_its_speech_is_interrupted_while_the_other_calls_drain() -> None:
    agent = Booking()
    calls = [{"name": "book", "id": "b1"}, {"name": "refund", "id": "r1"}]
    async with Harness(agent, [{"text": "One moment.", "tool_calls": calls}]) as h:
        await h.session.input("book, refund, then billing")
        await h.wait_for("chat.item", lambda e: e.data["item"].get("text") == "One moment.")
        await asyncio.sleep(0.2)  # the preamble was heard; the handoff waits for the booking to end
        assert h.session.agent.name == "front" and not agent.booked.is_set()
        await h.session.interrupt()
        await h.tools_done()
        await h.idle()
        assert agent.booked.is_set() and h.session.tool_call("b1").status == "completed"  # type: ignore[union-attr]
        refund = h.session.tool_call("r1")
        assert refund is not None and refund.output is not None and refund.output.startswith("Refunded $20.")
        assert "was not done: the agent was interrupted before the handoff" in refund.output
        assert h.session.agent.name == "front" and agent.log == []
        h.check_invariants()


class Watching(Front):
    def __init__(self) -> None:
        super().__init__()
        self.seen = asyncio.Event()

    @function_tool(allow_cancellation=True)
    async def watch(self, ctx: RunContext) -> str:
        """Watches the account; an agent-scoped call a handoff would cancel."""
        await ctx.wait_if_not_cancelled(self.seen.wait())
        return "Nothing new."


@on_virtual_clock
async def test_a_handoff_refused_by_an_interruption_leaves_the_agents_other_calls_running() -> None:
    agent = Watching()
    calls = [{"name": "watch", "id": "w1"}, {"name": "refund", "id": "r1"}]
    async with Harness(agent, [{"text": LONG, "tool_calls": calls}]) as h:
        await h.session.input("refund me, then billing")
        await h.wait_for("tool.started", lambda e: e.data["call_id"] == "r1")
        await asyncio.sleep(0.1)  # the refund has returned; its handoff waits for the preamble
        await h.session.interrupt()
        await h.wait_for("tool.ended", lambda e: e.data["call_id"] == "r1")
        assert h.session.agent.name == "front" and agent.log == []
        assert h.session.tool_call("w1").status == "running", "nothing is drained for a handoff that is not done"  # type: ignore[union-attr]
        agent.seen.set()
        await h.tools_done()
        await h.idle()
        assert h.session.tool_call("w1").status == "completed"  # type: ignore[union-attr]
        h.check_invariants()


@on_virtual_clock
async def test_bare_handoff_answers_with_an_empty_output_and_the_new_agent_speaks_from_on_enter() -> None:
    agent = Front(greet=True)
    turns = [
        {"text": "One moment.", "tool_calls": [{"name": "transfer", "id": "t1"}]},
        {"text": "Billing here, how can I help?"},
    ]
    async with Harness(agent, turns) as h:
        first = await h.session.input("billing please")
        await h.wait_for("chat.item", lambda e: e.data["item"].get("text") == "Billing here, how can I help?")
        await h.idle()
        assert h.summary() == [
            ("user", "billing please"),
            ("assistant", "One moment."),
            ("call", "transfer"),
            ("output", "transfer", ""),
            ("handoff", "front", "billing"),
            ("assistant", "Billing here, how can I help?"),
        ]
        steps = [(r.speech_id == first.speech_id, r.step) for r in h.llm.requests]
        assert steps == [(True, 0), (False, 0)], "no tool reply: the greeting is a reply of its own"
        assert h.llm.requests[-1].instructions == "You are billing.\n\nGreet the caller."
        h.check_invariants()


# -- the agent's hooks ------------------------------------------------------------------------------------------


class Greeter(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You greet.", name="greeter")

    async def on_enter(self) -> None:
        await self.session.say("Welcome to the front desk.")


@on_virtual_clock
async def test_on_enter_greets_when_a_session_starts() -> None:
    async with Harness(Greeter(), []) as h:
        await h.wait_for("speech.done")
        await h.idle()
        assert h.summary() == [("assistant", "Welcome to the front desk.")]
        h.check_invariants()


@on_virtual_clock
async def test_on_enter_is_not_run_again_when_a_session_is_recovered() -> None:
    h = Harness(Greeter(), [])
    await h.session.start(recovered=True, interrupted_calls=[], retried_calls=[], interrupted_speeches=[])
    async with h:
        await asyncio.sleep(1.0)
        assert h.summary() == [] and h.of_type("speech.created") == []


@on_virtual_clock
async def test_on_exit_runs_on_the_old_agent_before_the_new_one_enters() -> None:
    agent = Front()
    turns = [{"text": "Refunding.", "tool_calls": [{"name": "refund", "id": "r1"}]}, {"text": "Billing here."}]
    async with Harness(agent, turns) as h:
        await h.session.input("refund me")
        await h.idle()
        await asyncio.sleep(0.01)
        assert agent.log == ["front exits", "billing enters"]
        h.check_invariants()


class Careful(Agent):
    def __init__(self, behaviour: str) -> None:
        super().__init__(instructions="You are careful.", name="careful")
        self.behaviour = behaviour
        self.seen: list[tuple[int, str]] = []

    async def on_user_turn_completed(self, turn_ctx: TurnContext, new_message: NewMessage) -> None:
        self.seen.append((len(turn_ctx.items), new_message.text))
        if self.behaviour == "edit":
            new_message.text = new_message.text.replace("4111 1111", "[card number]")
            turn_ctx.add_message(role="system", text="The caller is a gold member.")
        elif self.behaviour == "context":
            turn_ctx.add_message(role="system", text="The caller is a gold member.")
        elif self.behaviour == "stop" and new_message.text == "thanks, bye":
            raise StopResponse()
        elif self.behaviour == "fail":
            raise RuntimeError("the lookup service is down")


@on_virtual_clock
async def test_on_user_turn_completed_may_edit_the_turn() -> None:
    agent = Careful("edit")
    async with Harness(agent, [{"text": "Thank you."}]) as h:
        await h.session.input("my card is 4111 1111")
        await h.idle()
        assert agent.seen == [(0, "my card is 4111 1111")]
        assert h.summary() == [("user", "my card is [card number]"), ("assistant", "Thank you.")]
        shown = [(it.role, it.text) for it in h.llm.requests[0].items if isinstance(it, ChatMessage)]
        assert shown == [("system", "The caller is a gold member."), ("user", "my card is [card number]")]
        h.check_invariants()


@on_virtual_clock
async def test_a_speculative_reply_made_before_the_hook_added_context_is_dropped() -> None:
    async with Harness(Careful("context"), [{"text": "Welcome back."}], preemptive_generation=True) as h:
        await h.session.input("hello", final=False)
        await asyncio.sleep(0.1)  # the speculative reply is made without the hook's message
        await h.session.input("hello")
        await h.idle()
        assert [e.data["state"] for e in h.of_type("generation.speculative")] == ["started", "discarded"]
        shown = [(it.role, it.text) for it in h.llm.requests[-1].items if isinstance(it, ChatMessage)]
        assert shown == [("system", "The caller is a gold member."), ("user", "hello")]
        assert h.summary() == [("user", "hello"), ("assistant", "Welcome back.")]
        h.check_invariants()


@on_virtual_clock
async def test_on_user_turn_completed_raising_stop_response_skips_the_reply() -> None:
    async with Harness(Careful("stop"), [{"text": "Hello!"}]) as h:
        result = await h.session.input("thanks, bye")
        await asyncio.sleep(0.5)
        assert result.speech_id is None and not h.llm.requests and h.of_type("speech.created") == []
        assert h.summary() == [("user", "thanks, bye")], "the message is committed, without a reply"
        await h.session.input("one more thing")
        await h.idle()
        assert h.summary()[-1] == ("assistant", "Hello!")
        h.check_invariants()


@on_virtual_clock
async def test_on_user_turn_completed_that_fails_leaves_the_turn_unchanged() -> None:
    async with Harness(Careful("fail"), [{"text": "Answered."}]) as h:
        await h.session.input("hello")
        await h.idle()
        assert h.summary() == [("user", "hello"), ("assistant", "Answered.")]
        h.check_invariants()


@on_virtual_clock
async def test_a_declared_agent_greets_on_enter() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agents.yaml"
        path.write_text("- name: concierge\n  instructions: You book tables.\n  greeting: Welcome to the concierge.\n")
        declared = load_agents_file(path, Webhooks(), environ={})
    async with Harness(declared.factories["concierge"](), [{"text": "A table for two, done."}]) as h:
        await h.wait_for("speech.done")
        await h.session.input("a table for two")
        await h.idle()
        assert h.summary() == [
            ("assistant", "Welcome to the concierge."),
            ("user", "a table for two"),
            ("assistant", "A table for two, done."),
        ]
        h.check_invariants()


def readme_livekit_example() -> dict[str, Any]:
    """The agent code of docs/agents.md's "Coming from LiveKit Agents", run as it is shown."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    section = page.split("## Coming from LiveKit Agents", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/agents.md", "exec"), namespace)
    return namespace


@on_virtual_clock
async def test_the_readme_livekit_agent_carries_over() -> None:
    agents = readme_livekit_example()["AGENTS"]
    turns = [
        {"text": "Let me transfer you.", "tool_calls": [{"name": "transfer_to_billing", "id": "t1"}]},
        {"text": "Billing desk, your invoice number please?"},
    ]
    async with Harness(agents["front"](), turns) as h:
        await h.session.input("bye")
        await h.session.input("billing please")
        await h.wait_for("chat.item", lambda e: e.data["item"].get("text", "").startswith("Billing desk"))
        await h.idle()
        assert h.summary() == [
            ("user", "bye"),
            ("user", "billing please"),
            ("assistant", "Let me transfer you."),
            ("call", "transfer_to_billing"),
            ("output", "transfer_to_billing", ""),
            ("handoff", "front", "billing"),
            ("assistant", "Billing desk, your invoice number please?"),
        ]
        system = [it.text for it in h.llm.requests[0].items if isinstance(it, ChatMessage) and it.role == "system"]
        assert system == ["The caller is a gold member."]
        h.check_invariants()


class Stuck(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You wait.", name="stuck")

    async def on_user_turn_completed(self, turn_ctx: TurnContext, new_message: NewMessage) -> None:
        new_message.text = "never committed"
        await asyncio.Event().wait()  # a lookup that never answers


@on_virtual_clock
async def test_on_user_turn_completed_that_hangs_is_abandoned_and_the_input_answered() -> None:
    loop = asyncio.get_running_loop()
    async with Harness(Stuck(), [{"text": "Answered."}], user_turn_hook_timeout_s=2.0) as h:
        asked = loop.time()
        await h.session.input("hello")
        assert loop.time() - asked == pytest.approx(2.0)
        await h.idle()
        assert h.summary() == [("user", "hello"), ("assistant", "Answered.")]
    # the session closed (the close does not wait on a hook)
    h.check_invariants()


class Background(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="You look things up.", name="background")
        self.gates = {"a": asyncio.Event(), "b": asyncio.Event()}

    @function_tool
    async def lookup(self, ctx: RunContext, what: str) -> str:
        """A slow lookup that reports progress (it runs in the background)."""
        await ctx.update(f"looking up {what}")
        await self.gates[what].wait()
        return f"found {what}"


@on_virtual_clock
async def test_a_result_landing_while_an_interrupt_ends_the_queued_deferred_reply_still_gets_one() -> None:
    agent = Background()
    calls = [{"name": "lookup", "arguments": {"what": w}, "id": f"c{w}"} for w in ("a", "b")]
    turns = [{"text": "Looking.", "tool_calls": calls}, {"text": "On it."}, {"text": "Here: {{tool_output:lookup}}"}]
    async with Harness(agent, turns) as h:
        await h.session.input("look both up")
        await h.idle()
        await h.session.say(LONG)
        await speaking(h)
        agent.gates["a"].set()  # its deferred reply is queued behind the say
        await h.wait_for("speech.created", lambda e: e.data["source"] == "deferred_reply")
        interrupting = asyncio.ensure_future(h.session.interrupt())  # ends the say and the queued deferred reply
        while not h.session.current_speech or not h.session.current_speech.interrupted:
            await asyncio.sleep(0)
        agent.gates["b"].set()  # lands before the interrupted deferred reply has left the queue
        await interrupting
        await h.tools_done()
        await h.idle()
        assert h.summary()[-1] == ("assistant", "Here: found b"), "the second result was answered"
        h.check_invariants()
