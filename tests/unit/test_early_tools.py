"""Tools that are safe to run early: a speculative (preemptive) reply starts the calls of tools declared free of side
effects at once; the others wait until the reply is confirmed. A call dropped with its speculation ends `cancelled`
with a `reason`, and nothing of it reaches the chat."""

from __future__ import annotations

import asyncio

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import ChatContext, FunctionCall, FunctionCallOutput
from switchboard.runtime.recovery import restart_end
from switchboard.runtime.tool_call import dropped_reason
from switchboard.runtime.tools import ToolCallInfo, ToolStatus
from tests.waiting import until

from .harness import Harness

LONG = " ".join(f"word{i}" for i in range(60))


class Shop(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.runs: list[str] = []
        self.done: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    @function_tool(side_effects=False)
    async def quote(self, ctx: RunContext, what: str) -> str:
        """Quote a price (no side effects)."""
        self.runs.append(f"quote {what}")
        await self.gate.wait()
        self.done.append(f"quote {what}")
        return f"{what} costs 3"

    @function_tool(side_effects=False)
    async def scan(self, ctx: RunContext, what: str) -> str:
        """Scan the shelves, reporting progress (no side effects)."""
        await ctx.update(f"scanning for {what}", progress=0.5)
        await self.gate.wait()
        return f"{what} on shelf 2"

    @function_tool
    async def book(self, ctx: RunContext, what: str) -> str:
        """Book something (a side effect)."""
        self.runs.append(f"book {what}")
        return f"booked {what}"


QUOTE = {"name": "quote", "arguments": {"what": "tea"}}
BOOK = {"name": "book", "arguments": {"what": "tea"}}


def harness(agent: Shop, turns: list[dict]) -> Harness:
    return Harness(agent, turns, preemptive_generation=True, trust_model_call_ids=False)


def started(h: Harness) -> list[dict]:
    return [e.data for e in h.of_type("tool.started")]


def ended(h: Harness) -> dict[str, dict]:
    return {e.data["call_id"]: e.data for e in h.of_type("tool.ended")}


def chat_call_ids(h: Harness) -> set[str]:
    return {it.call_id for it in h.chat() if isinstance(it, FunctionCall | FunctionCallOutput)}


async def speculation_made(h: Harness) -> None:
    """The speculative generation has streamed its whole turn (its calls are made)."""
    await until(lambda: h.session.speculation.generation is not None and h.session.speculation.generation._finished)
    for _ in range(5):  # its calls start in the tasks that follow its chunks
        await asyncio.sleep(0)


async def test_a_safe_call_runs_during_the_speculation_and_its_output_is_committed_once_confirmed():
    agent = Shop()
    turns = [{"text": "Let me see.", "tool_calls": [QUOTE]}, {"text": "It is {{tool_output:quote}}."}]
    async with harness(agent, turns) as h:
        await h.session.input("how much is tea", final=False)
        await speculation_made(h)
        await until(lambda: agent.done)  # its body ran before the turn was confirmed
        assert agent.runs == ["quote tea"]
        [start] = started(h)
        assert start["speculative"] is True and start["speech_id"] is None
        assert h.chat() == [] and h.of_type("tool.ended") == [], "its end waits for the verdict"

        res = await h.session.input("how much is tea")
        await h.idle()
        await h.tools_done()
        assert agent.runs == ["quote tea"], "confirmed, not run again"
        assert h.summary() == [
            ("user", "how much is tea"),
            ("assistant", "Let me see."),
            ("call", "quote"),
            ("output", "quote", "tea costs 3"),
            ("assistant", "It is tea costs 3."),
        ]
        end = ended(h)[start["call_id"]]
        assert end["status"] == "completed" and "reason" not in end
        assert h.session.tool_call(start["call_id"]).speech_id == res.speech_id
        h.check_invariants()


async def test_a_safe_call_still_running_when_confirmed_ends_as_a_call_of_the_reply():
    agent = Shop()
    agent.gate.clear()
    turns = [{"text": "Let me see.", "tool_calls": [QUOTE]}, {"text": "It is {{tool_output:quote}}."}]
    async with harness(agent, turns) as h:
        await h.session.input("how much is tea", final=False)
        await until(lambda: agent.runs)
        await h.session.input("how much is tea")
        await until(lambda: h.session.speculation.generation is None and h.of_type("speech.started"))
        agent.gate.set()
        await h.idle()
        await h.tools_done()
        assert h.summary()[-3:] == [
            ("call", "quote"),
            ("output", "quote", "tea costs 3"),
            ("assistant", "It is tea costs 3."),
        ]
        assert [e["status"] for e in ended(h).values()] == ["completed"]
        h.check_invariants()


async def test_a_safe_call_reports_progress_during_the_speculation_without_a_pair_in_the_chat():
    agent = Shop()
    agent.gate.clear()
    turns = [{"text": "Looking.", "tool_calls": [{"name": "scan", "arguments": {"what": "tea"}}]}, {"text": "Got it."}]
    async with harness(agent, turns) as h:
        await h.session.input("where is the tea", final=False)
        progress = await h.wait_for("tool.progress")
        call = h.session.tool_call(progress.data["call_id"])
        assert call.speculative and not call.background and [p.message for p in call.progress] == ["scanning for tea"]
        assert h.chat() == [], "no background pair before the turn is confirmed"

        await h.session.input("where is the tea")
        agent.gate.set()
        await h.idle()
        await h.tools_done()
        assert h.summary() == [
            ("user", "where is the tea"),
            ("assistant", "Looking."),
            ("call", "scan"),
            ("output", "scan", "tea on shelf 2"),
            ("assistant", "Got it."),
        ]
        h.check_invariants()


async def test_a_safe_call_is_dropped_when_the_turn_resumes_and_an_unsafe_one_never_starts():
    agent = Shop()
    agent.gate.clear()
    turns = [{"text": "Let me see.", "tool_calls": [QUOTE, BOOK]}, {"text": "Done."}]
    async with harness(agent, turns) as h:
        await h.session.input("how much is tea", final=False)
        await speculation_made(h)
        assert agent.runs == ["quote tea"], "the unsafe call waits for the turn to be confirmed"
        [first] = started(h)
        await h.session.input("how much is tea and cake", final=False)  # the user goes on speaking
        await until(lambda: first["call_id"] in ended(h))
        end = ended(h)[first["call_id"]]
        assert (end["status"], end["reason"]) == ("cancelled", "turn_resumed")
        discarded = [e.data for e in h.of_type("generation.speculative") if e.data["state"] == "discarded"]
        assert discarded[0]["reason"] == "turn_resumed"

        agent.gate.set()
        await h.session.input("how much is tea and cake")
        await h.idle()
        await h.tools_done()
        assert first["call_id"] not in chat_call_ids(h), "nothing of the dropped call in the chat"
        # the confirmed speculation's calls: the safe one started early, the unsafe one when confirmed
        calls = [(s["name"], s.get("speculative", False)) for s in started(h)]
        assert calls == [("quote", True), ("quote", True), ("book", False)]
        assert agent.runs == ["quote tea", "quote tea", "book tea"]
        assert h.summary()[:6] == [
            ("user", "how much is tea and cake"),
            ("assistant", "Let me see."),
            ("call", "quote"),
            ("output", "quote", "tea costs 3"),
            ("call", "book"),
            ("output", "book", "booked tea"),
        ]
        assert all(e["call_id"] in ended(h) for e in started(h)), "every started call ended"
        h.check_invariants()


async def test_a_dropped_speculation_whose_final_text_differs_never_starts_its_unsafe_call():
    agent = Shop()
    turns = [{"text": "Booking.", "tool_calls": [BOOK, QUOTE]}]
    async with harness(
        agent,
        turns,
    ) as h:
        await h.session.input("book tea", final=False)
        await speculation_made(h)
        await h.session.input("no wait", reply=False)
        await h.idle()
        await h.tools_done()
        assert agent.runs == ["quote tea"], "the unsafe call never started"
        [start] = started(h)
        assert start["name"] == "quote"
        end = ended(h)[start["call_id"]]
        assert (end["status"], end["reason"], end["is_error"]) == ("cancelled", "turn_resumed", True)
        assert chat_call_ids(h) == set()
        assert h.summary() == [("user", "no wait")]
        record = h.store.tool_calls[h.sid][start["call_id"]]
        assert record.speculative and record.status == ToolStatus.CANCELLED
        assert dropped_reason(record) == "turn_resumed"
        h.check_invariants()


async def test_a_safe_call_is_dropped_by_a_barge_in_that_changes_the_context():
    agent = Shop()
    agent.gate.clear()
    turns = [{"text": "Let me see.", "tool_calls": [QUOTE]}, {"text": "Fresh answer."}]
    async with harness(agent, turns) as h:
        await h.session.say(LONG)
        await h.wait_for("speech.started")
        await h.session.input("how much is tea", final=False)  # the user talks over the agent
        await until(lambda: agent.runs)
        [start] = started(h)
        await h.session.input("how much is tea")  # interrupts the say: its heard part is committed
        await until(lambda: start["call_id"] in ended(h))
        end = ended(h)[start["call_id"]]
        assert (end["status"], end["reason"]) == ("cancelled", "barge_in")
        agent.gate.set()
        await h.idle()
        await h.tools_done()
        assert start["call_id"] not in chat_call_ids(h)
        assert h.summary()[-1] == ("assistant", "Fresh answer.")
        h.check_invariants()


async def test_a_safe_call_of_a_speculation_pending_at_close_ends_without_a_pair():
    agent = Shop()
    agent.gate.clear()
    turns = [{"text": "Let me see.", "tool_calls": [QUOTE]}]
    async with harness(agent, turns) as h:
        await h.session.input("how much is tea", final=False)
        await until(lambda: agent.runs)
        [start] = started(h)
    end = ended(h)[start["call_id"]]
    assert (end["status"], end["reason"]) == ("cancelled", "session_stopped")
    assert h.chat() == []
    h.check_invariants()


def test_a_speculative_call_left_running_by_a_crash_ends_cancelled_without_a_pair():
    from datetime import UTC, datetime

    info = ToolCallInfo(call_id="c1", name="quote", speculative=True, started_at=datetime.now(UTC))
    items, record = restart_end(info, ChatContext([]))
    assert items == []
    assert record.status == ToolStatus.CANCELLED and record.ended and record.is_error
    assert dropped_reason(record) == "session_stopped", "an end re-reported by recovery says why, too"
