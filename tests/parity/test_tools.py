"""LiveKit Agents parity: tools (docs/livekit-parity.md, section "Tools"), on the virtual clock.

Each test is named after the behaviour it pins; the runtime API drives a session on a scripted model.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from switchboard import Agent, RunContext, ToolError, function_tool
from switchboard.runtime.chat import FunctionCall, FunctionCallOutput, validate
from switchboard.runtime.executor import INTERNAL_ERROR_OUTPUT
from switchboard.runtime.speech import NotInterruptible
from switchboard.runtime.tool_call import MAX_ERROR_CHARS
from switchboard.runtime.tools import TRUNCATION_MARKER, ToolStatus
from tests.waiting import WAIT_S

from ..unit.harness import Harness
from .clock import on_virtual_clock
from .test_speech_turns_handoffs import readme_livekit_example


class Other(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="another agent")


class Preferences(BaseModel):
    color: str = "red"
    note: str | None = None
    nickname: str | None = "guest"


class Seat(BaseModel):
    row: int = 1
    window: bool = False


class Shop(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()
        self.runs: list[tuple[str, Any]] = []
        self.updates = 2

    # -- results -----------------------------------------------------------------------------------------------

    @function_tool
    async def odd_object(self) -> object:
        """Returns an arbitrary object."""
        return object()

    @function_tool
    async def two_agents(self) -> object:
        """Returns two agents."""
        return (Other(), Other())

    @function_tool
    async def agents_in_a_list(self) -> object:
        """Returns agents in a list."""
        return [Other(), "and a note"]

    @function_tool
    async def nothing(self) -> None:
        """Does its work and returns nothing."""
        self.runs.append(("nothing", None))

    @function_tool
    async def explode(self) -> str:
        """Fails unexpectedly, with a credential in its message."""
        raise RuntimeError("upstream said 401 for Authorization: Bearer sk-live-123 at /v1/x?token=abc")

    @function_tool
    async def explode_at_length(self) -> str:
        """Fails unexpectedly with a very long message."""
        raise RuntimeError("x" * 5_000)

    @function_tool
    async def refuse(self) -> str:
        """Fails expectedly."""
        raise ToolError("No tables left.")

    # -- arguments ---------------------------------------------------------------------------------------------

    @function_tool
    async def remove_items(self, order_id: list[str]) -> str:
        """Remove order items."""
        self.runs.append(("remove_items", order_id))
        return ",".join(order_id)

    @function_tool
    async def repeat(self, word: str, count: int = 5) -> str:
        """Repeat a word."""
        self.runs.append(("repeat", (word, count)))
        return f"{word} x{count}"

    @function_tool
    async def set_prefs(self, prefs: Preferences, seats: list[Seat] | None = None) -> str:
        """Set preferences."""
        self.runs.append(("set_prefs", (prefs, seats)))
        return prefs.color

    # -- duplicates, cancellation ------------------------------------------------------------------------------

    @function_tool(on_duplicate="reject", duplicate_scope="name_and_args")
    async def search(self, ctx: RunContext, city: str, party: int = 2, budget: float = 50.0) -> str:
        """Search tables (a duplicate with the same arguments is refused)."""
        self.runs.append(("search", (city, party, budget)))
        await self.gate.wait()
        return f"tables in {city} for {party}"

    @function_tool(on_duplicate="replace")
    async def book(self, ctx: RunContext, table: int) -> str:
        """Book a table (cannot be cancelled; a new call replaces a running one)."""
        self.runs.append(("book", table))
        await self.gate.wait()
        return f"booked {table}"

    @function_tool(on_duplicate="replace", allow_cancellation=True)
    async def hold(self, ctx: RunContext, table: int) -> str:
        """Hold a table (can be cancelled; a new call replaces a running one)."""
        self.runs.append(("hold", table))
        await ctx.wait_if_not_cancelled(self.gate.wait())
        return f"held {table}"

    @function_tool(allow_cancellation=True)
    async def lookup(self, ctx: RunContext, topic: str) -> str:
        """A slow lookup that can be cancelled."""
        await ctx.wait_if_not_cancelled(self.gate.wait())
        return f"found {topic}"

    @function_tool(allow_cancellation=True)
    async def watch(self, ctx: RunContext) -> str:
        """Watches in the background until cancelled."""
        await ctx.update("watching")
        await ctx.wait_if_not_cancelled(self.gate.wait())
        return "seen"

    # -- progress ----------------------------------------------------------------------------------------------

    @function_tool
    async def report(self, ctx: RunContext) -> str:
        """A long report with progress."""
        for i in range(self.updates):
            await ctx.update(f"step {i + 1}", progress=(i + 1) / (self.updates + 1))
        await self.gate.wait()
        return "report ready"

    @function_tool
    async def quick_report(self, ctx: RunContext) -> str:
        """Goes to the background and is done before the reply's next step."""
        await ctx.update("started")
        return "quick report ready"

    # -- the tool context API ----------------------------------------------------------------------------------

    @function_tool
    async def announce(self, ctx: RunContext) -> str:
        """Says something through the session, and asks for a reply."""
        said = await ctx.session.say("One moment please.")
        reply = await ctx.session.generate_reply(instructions="Tell the user the table is held.")
        self.runs.append(("announce", (said.id, reply.id, ctx.speech_handle)))
        return "held"

    @function_tool
    async def hang_up(self, ctx: RunContext) -> str:
        """Interrupts the agent's own speech."""
        assert ctx.speech_handle is ctx.speech
        interrupted = await ctx.session.interrupt()
        self.runs.append(("hang_up", interrupted))
        return "hung up"

    @function_tool
    async def wait_own_speech(self, ctx: RunContext) -> str:
        """Waits, in the foreground, for the speech that made the call: a circular wait."""
        assert ctx.speech_handle is not None
        await ctx.speech_handle.wait_for_playout()
        return "never returned"

    @function_tool
    async def wait_queued_say(self, ctx: RunContext) -> str:
        """Waits, in the foreground, for a speech it queued (it plays after the reply, which waits for the call)."""
        said = await ctx.session.say("One moment please.")
        await said.wait_for_playout()
        return "never returned"

    @function_tool
    async def wait_own_speech_in_background(self, ctx: RunContext) -> str:
        """Moves to the background, then waits for the speech that made the call."""
        assert ctx.speech_handle is not None
        await ctx.update("waiting for the reply to be heard")
        await ctx.speech_handle.wait_for_playout()
        self.runs.append(("heard", ctx.speech_handle.done))
        return "the reply was heard"

    @function_tool(allow_cancellation=True)
    async def deaf(self, ctx: RunContext) -> str:
        """Ignores its cancellation (a badly written tool) and returns once the gate opens."""
        await ctx.update("working")
        return await self.deaf_in_the_foreground.fn(self, ctx)

    @function_tool(allow_cancellation=True)
    async def deaf_in_the_foreground(self, ctx: RunContext) -> str:
        """Ignores its cancellation, in the foreground, and returns once the gate opens."""
        while not self.gate.is_set():
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.runs.append(("deaf", "swallowed a cancellation"))
        return "finished anyway"


def call(name: str, call_id: str, arguments: Any = None) -> dict[str, Any]:
    return {"name": name, "arguments": {} if arguments is None else arguments, "id": call_id}


def outputs(h: Harness) -> dict[str, FunctionCallOutput]:
    return {it.call_id: it for it in h.chat() if isinstance(it, FunctionCallOutput)}


def ended(h: Harness) -> dict[str, dict[str, Any]]:
    return {e.data["call_id"]: e.data for e in h.of_type("tool.ended")}


async def run_turn(agent: Shop, calls: list[dict[str, Any]], *, then: str = "Done.", **options: Any) -> Harness:
    """One user turn whose reply makes ``calls``; returns once everything has settled."""
    h = Harness(agent, [{"text": "Working.", "tool_calls": calls}, {"text": then}], **options)
    async with h:
        await h.session.input("go")
        await asyncio.sleep(0.05)
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        h.check_invariants()
    return h


# -- 5. unusable return values ---------------------------------------------------------------------------------


@on_virtual_clock
async def test_unusable_return_values_answer_the_call_with_an_error_output() -> None:
    agent = Shop()
    h = await run_turn(agent, [call("odd_object", "o1"), call("two_agents", "o2"), call("agents_in_a_list", "o3")])
    out = outputs(h)
    for cid in ("o1", "o2", "o3"):
        assert out[cid].is_error and out[cid].output.startswith("The tool returned a result that cannot be used")
        assert "object at 0x" not in out[cid].output and "<Agent" not in out[cid].output
        assert ended(h)[cid]["status"] == "failed"
    assert "a value of type object cannot be given to the model" in out["o1"].output
    assert "several" in out["o2"].output and "several" in out["o3"].output
    assert h.session.agent is agent, "no handoff is made of several agents"
    assert not h.of_type("agent.handoff")


# -- 6. arguments from real models -----------------------------------------------------------------------------


@on_virtual_clock
async def test_arguments_from_real_models_are_repaired() -> None:
    agent = Shop()
    gemma = '{"order_id": ["<|\\"|\\"O_WAAB70<|\\"|\\"]}'
    calls = [
        call("repeat", "r1", '{"word": "hi", "count": 2'),  # the closing brace is missing
        call("remove_items", "r2", gemma),  # Gemma's chat-template tokens leaked into the value
        call("repeat", "r3", '{"word": "<|safe|>"}'),  # valid JSON: kept exactly as it is
        call("repeat", "r4", "count=2"),  # nothing to repair: an error the model can correct
    ]
    h = await run_turn(agent, calls)
    assert ("repeat", ("hi", 2)) in agent.runs
    assert ("remove_items", ["O_WAAB70"]) in agent.runs
    assert ("repeat", ("<|safe|>", 5)) in agent.runs
    out = outputs(h)
    assert out["r2"].output == "O_WAAB70" and not out["r2"].is_error
    assert out["r4"].is_error and "arguments are not valid JSON" in out["r4"].output
    # the context keeps the repaired arguments, so no later request carries the broken text
    stored = {it.call_id: it.arguments for it in h.chat() if isinstance(it, FunctionCall)}
    assert stored["r1"] == {"word": "hi", "count": 2} and stored["r2"] == {"order_id": ["O_WAAB70"]}


@on_virtual_clock
async def test_null_for_a_parameter_with_a_default_uses_the_default_in_nested_models_too() -> None:
    agent = Shop()
    calls = [
        call("repeat", "n1", {"word": "hi", "count": None}),
        call(
            "set_prefs",
            "n2",
            {"prefs": {"color": None, "note": None, "nickname": None}, "seats": [{"row": None, "window": True}]},
        ),
        call("repeat", "n3", {"word": None}),  # null for a required parameter stays an error
    ]
    h = await run_turn(agent, calls)
    assert ("repeat", ("hi", 5)) in agent.runs
    prefs = next(args for name, args in agent.runs if name == "set_prefs")
    # a null the parameter accepts is kept: it is a value (nickname), not "use the default"
    assert prefs == (Preferences(color="red", note=None, nickname=None), [Seat(row=1, window=True)])
    out = outputs(h)
    assert out["n3"].is_error and "word" in out["n3"].output


# -- 7. duplicates keyed on validated arguments ----------------------------------------------------------------


@on_virtual_clock
async def test_duplicates_are_keyed_on_validated_arguments() -> None:
    agent = Shop()
    calls = [
        call("search", "d1", {"city": "Rome"}),
        call("search", "d2", {"city": "Rome", "party": 2}),  # the default, explicit
        call("search", "d3", {"city": "Rome", "party": None}),  # null: the default
        call("search", "d4", {"city": "Rome", "budget": 50}),  # 50 and 50.0 for a float
        call("search", "d5", {"party": 2, "city": "Rome", "budget": 50.0}),  # another key order
        call("search", "d6", {"city": "Rome", "party": 3}),  # another call
    ]
    h = await run_turn(agent, calls)
    st = {cid: d["status"] for cid, d in ended(h).items()}
    assert st == {
        "d1": "completed",
        "d2": "rejected",
        "d3": "rejected",
        "d4": "rejected",
        "d5": "rejected",
        "d6": "completed",
    }
    assert [args for name, args in agent.runs if name == "search"] == [("Rome", 2, 50.0), ("Rome", 3, 50.0)]


# -- 8. replace against a call that cannot be cancelled --------------------------------------------------------


@on_virtual_clock
async def test_replace_against_a_call_that_cannot_be_cancelled_refuses_the_new_call() -> None:
    agent = Shop()
    h = await run_turn(agent, [call("book", "b1", {"table": 1}), call("book", "b2", {"table": 2})])
    result = ended(h)
    assert result["b1"]["status"] == "completed" and result["b1"]["output"] == "booked 1"
    assert result["b2"]["status"] == "rejected" and "not replaced" in result["b2"]["output"]
    assert "cannot be cancelled" in result["b2"]["output"]
    assert [args for name, args in agent.runs if name == "book"] == [1], "the booking ran once, never cancelled"


@on_virtual_clock
async def test_replace_is_refused_while_the_old_calls_speech_disallows_interruptions() -> None:
    agent = Shop()
    calls = [call("hold", "t1", {"table": 1}), call("hold", "t2", {"table": 2})]
    h = await run_turn(agent, calls, allow_interruptions=False)
    result = ended(h)
    assert result["t1"]["status"] == "completed" and result["t1"]["output"] == "held 1"
    assert result["t2"]["status"] == "rejected" and "not replaced" in result["t2"]["output"]
    assert "does not allow interruptions" in result["t2"]["output"]
    assert [args for name, args in agent.runs if name == "hold"] == [1]


# -- 9. cancelling a call whose speech does not allow interruptions --------------------------------------------


@on_virtual_clock
async def test_cancel_is_refused_while_the_speech_disallows_interruptions() -> None:
    agent = Shop()
    turns = [
        {"text": "Looking.", "tool_calls": [call("lookup", "k1", {"topic": "menu"})]},
        {"text": "Saw: {{tool_output:lookup}}"},
    ]
    async with Harness(agent, turns, allow_interruptions=False) as h:
        await h.session.input("go")
        await h.wait_for("tool.started")
        with pytest.raises(NotInterruptible):
            await h.session.cancel_tool("k1")
        assert h.session.tool_call("k1").status == "running"
        info = await h.session.cancel_tool("k1", force=True)
        assert info.status == "cancelled"
        await h.idle()
        h.check_invariants()


@on_virtual_clock
async def test_the_cancel_companion_tool_gets_an_error_output_while_the_speech_disallows_interruptions() -> None:
    agent = Shop()
    turns = [
        {
            "text": "Looking.",
            "tool_calls": [call("lookup", "k1", {"topic": "menu"}), call("cancel_tool_call", "x1", {"call_id": "k1"})],
        },
        {"text": "Saw: {{tool_output:cancel_tool_call}}"},
    ]
    async with Harness(agent, turns, allow_interruptions=False) as h:
        await h.session.input("go")
        await h.wait_for("tool.ended", lambda e: e.data["call_id"] == "x1")
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        out = outputs(h)
        assert out["x1"].is_error and "does not allow interruptions" in out["x1"].output
        assert out["k1"].output == "found menu" and ended(h)["k1"]["status"] == "completed"
        h.check_invariants()


@on_virtual_clock
async def test_cancel_is_allowed_once_the_protected_speech_is_done() -> None:
    # a cancellable call in the background outlives its speech: once that speech is done, nothing protects it
    agent = Shop()
    turns = [{"text": "Watching.", "tool_calls": [call("watch", "w1")]}, {"text": "It runs."}]
    async with Harness(agent, turns, allow_interruptions=False) as h:
        await h.session.input("go")
        await h.wait_for("tool.progress")
        await h.idle()
        info = await h.session.cancel_tool("w1")
        assert info.status == "cancelled"
        await h.idle()
        h.check_invariants()


# -- 10. observers see why a tool failed -----------------------------------------------------------------------


@on_virtual_clock
async def test_observers_see_why_a_tool_failed_redacted_while_the_model_gets_the_generic_text() -> None:
    agent = Shop()
    calls = [call("explode", "e1"), call("refuse", "e2"), call("repeat", "e3", {"word": "a"})]
    h = await run_turn(agent, [*calls, call("explode_at_length", "e4")])
    out, done = outputs(h), ended(h)
    assert out["e1"].output == INTERNAL_ERROR_OUTPUT, "the model gets the generic text"
    for seen in (done["e1"]["error"], h.session.tool_call("e1").error, h.store.tool_calls[h.sid]["e1"].error):
        assert seen is not None and seen.startswith("RuntimeError: upstream said 401 for Authorization")
        assert "sk-live-123" not in seen and "abc" not in seen and "[redacted]" in seen
    assert done["e2"]["error"] == "ToolError: No tables left." and out["e2"].output == "No tables left."
    assert done["e3"]["error"] is None
    long = done["e4"]["error"]  # the first 2,000 characters, and how much was cut
    assert long == "RuntimeError: " + "x" * (MAX_ERROR_CHARS - len("RuntimeError: ")) + TRUNCATION_MARKER.format(
        dropped=len("RuntimeError: ") + 5_000 - MAX_ERROR_CHARS
    )


# -- 11. every ctx.update() reaches the model ------------------------------------------------------------------


@on_virtual_clock
async def test_every_update_reaches_the_model_as_its_own_pair_in_a_bounded_context() -> None:
    agent = Shop()
    agent.updates = 6
    turns = [{"text": "Starting.", "tool_calls": [call("report", "u1")]}, {"text": "It runs."}, {"text": "Here."}]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        async with asyncio.timeout(WAIT_S):
            while len(h.of_type("tool.progress")) < 6:
                await asyncio.sleep(0.01)
        await h.idle()
        agent.gate.set()
        await h.tools_done()
        await h.idle()
        h.check_invariants()
        stored = [it.call_id for it in h.chat() if isinstance(it, FunctionCall)]
        assert stored == ["u1", *(f"u1/update/{n}" for n in range(2, 7)), "u1/final"]
        progress = [it.output for it in h.chat() if isinstance(it, FunctionCallOutput) and "/update/" in it.call_id]
        assert progress[0] == "Progress of the call running in the background: step 2, 29% done. Still running."
        # the deferred reply covers them, and sees only the latest three: the context stays bounded
        deferred = h.llm.requests[-1]
        seen = [it.call_id for it in deferred.items if isinstance(it, FunctionCall)]
        assert seen == ["u1", "u1/update/4", "u1/update/5", "u1/update/6", "u1/final"]
        assert validate(deferred.items) == []
        sources = [e.data["source"] for e in h.of_type("speech.created")]
        assert sources == ["reply", "deferred_reply"], "updates ask for no reply of their own"


# -- 12. no needless model calls -------------------------------------------------------------------------------


@on_virtual_clock
async def test_a_tool_that_returns_none_asks_for_no_tool_reply() -> None:
    agent = Shop()
    h = await run_turn(agent, [call("nothing", "z1")])
    assert [r.step for r in h.llm.requests] == [0], "no step-1 request"
    assert outputs(h)["z1"].output == "" and ended(h)["z1"]["status"] == "completed"
    assert ("nothing", None) in agent.runs


@on_virtual_clock
async def test_a_background_result_before_the_tool_reply_step_is_answered_by_that_step() -> None:
    agent = Shop()
    long_text = " ".join(f"w{i}" for i in range(30))  # plays for a while: the result lands meanwhile
    turns = [
        {"text": long_text, "tool_calls": [call("quick_report", "q1")]},
        {"text": "Result: {{tool_output:quick_report}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("go")
        await h.tools_done()
        await h.idle()
        await asyncio.sleep(0.5)
        await h.idle()
        h.check_invariants()
        assert ended(h)["q1"]["output"] == "quick report ready"
        assert [(r.step, r.speech_id) for r in h.llm.requests][1][0] == 1
        assert len(h.llm.requests) == 2, "no redundant deferred reply"
        assert [e.data["source"] for e in h.of_type("speech.created")] == ["reply"]
        assert h.summary()[-1] == ("assistant", "Result: quick report ready")


@on_virtual_clock
async def test_a_background_result_that_lands_after_the_last_step_started_gets_a_deferred_reply() -> None:
    agent = Shop()
    agent.updates = 1
    long_text = " ".join(f"w{i}" for i in range(30))
    turns = [
        {"text": "Starting.", "tool_calls": [call("report", "q2")]},
        {"text": long_text},  # the tool-reply step: the result lands while it plays, after its request was made
        {"text": "Result: {{tool_output:report}}"},
    ]
    async with Harness(agent, turns) as h:
        first = await h.session.input("go")
        await h.wait_for("generation.started", lambda e: e.data["step"] == 1)
        agent.gate.set()
        await h.tools_done()
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] != first.speech_id)
        await h.idle()
        h.check_invariants()
        assert [e.data["source"] for e in h.of_type("speech.created")] == ["reply", "deferred_reply"]
        assert h.summary()[-1] == ("assistant", "Result: report ready")


# -- the tool context API --------------------------------------------------------------------------------------


@on_virtual_clock
async def test_tool_context_session_say_and_generate_reply_and_speech_handle() -> None:
    agent = Shop()
    turns = [
        {"text": "Holding it.", "tool_calls": [call("announce", "a1")]},
        {"text": "Held."},
        {"text": "Your table is held."},
    ]
    async with Harness(agent, turns) as h:
        first = await h.session.input("hold a table")
        await h.tools_done()
        async with asyncio.timeout(WAIT_S):
            while len(h.of_type("speech.done")) < 3:
                await asyncio.sleep(0.01)
        await h.idle()
        h.check_invariants()
        said_id, reply_id, handle = next(args for name, args in agent.runs if name == "announce")
        assert handle is not None and handle.id == first.speech_id
        assert h.of_type("tool.started")[0].data["speech_id"] == first.speech_id
        created = [(e.data["speech_id"], e.data["source"]) for e in h.of_type("speech.created")]
        assert created == [(first.speech_id, "reply"), (said_id, "say"), (reply_id, "reply")]
        texts = [x[1] for x in h.summary() if x[0] == "assistant"]
        assert texts == ["Holding it.", "Held.", "One moment please.", "Your table is held."]
        assert "Tell the user the table is held." in h.llm.requests[-1].instructions


@on_virtual_clock
async def test_tool_context_session_interrupt() -> None:
    agent = Shop()
    long_text = " ".join(f"w{i}" for i in range(50))
    turns = [{"text": long_text, "tool_calls": [call("hang_up", "h1")]}, {"text": "never said"}]
    async with Harness(agent, turns, fallback={"text": "unused"}) as h:
        first = await h.session.input("bye")
        await h.tools_done()
        await h.idle()
        h.check_invariants()
        interrupted = next(args for name, args in agent.runs if name == "hang_up")
        assert interrupted is not None and interrupted.id == first.speech_id
        assert [e.data["speech_id"] for e in h.of_type("speech.interrupted")] == [first.speech_id]
        assert outputs(h)["h1"].output == "hung up", "the call's pair is kept (I1)"
        assert len(h.llm.requests) == 1, "no tool reply after the interruption"


@on_virtual_clock
async def test_the_readme_tool_that_speaks_through_ctx_session_carries_over() -> None:
    agents = readme_livekit_example()["AGENTS"]
    turns = [{"text": "You are welcome.", "tool_calls": [call("end_call", "e1")]}]
    async with Harness(agents["front"](), turns, fallback={"text": "never asked"}) as h:
        await h.session.input("thanks, that is all")
        await h.tools_done()
        async with asyncio.timeout(WAIT_S):
            while len(h.of_type("speech.done")) < 2:
                await asyncio.sleep(0.01)
        await h.idle()
        h.check_invariants()
        assert h.summary() == [
            ("user", "thanks, that is all"),
            ("assistant", "You are welcome."),
            ("call", "end_call"),
            ("output", "end_call", ""),
            ("assistant", "Thank you for calling. Goodbye!"),
        ]
        assert len(h.llm.requests) == 1, "no tool reply"


@on_virtual_clock
async def test_a_call_made_when_the_agent_offers_no_tools_is_answered_with_an_error_output() -> None:
    turns = [
        {"text": "Let me look.", "tool_calls": [{"name": "lookup", "arguments": {}, "id": "c1"}]},
        {"text": "I cannot look that up. {{tool_output:lookup}}"},
    ]
    async with Harness(Other(), turns) as h:
        await h.session.input("look it up")
        await h.idle()
        assert [(r.step, r.tools, r.tool_choice) for r in h.llm.requests] == [(0, [], "none"), (1, [], "none")]
        output = "Unknown tool 'lookup'. Available tools: (none)."
        assert h.summary()[1:] == [
            ("assistant", "Let me look."),
            ("call", "lookup"),
            ("output", "lookup", output),
            ("assistant", f"I cannot look that up. {output}"),
        ]
        assert h.store.tool_calls[h.sid]["c1"].status == "failed"
        h.check_invariants()


@on_virtual_clock
async def test_a_foreground_tool_waiting_for_its_own_speech_raises_at_once() -> None:
    loop = asyncio.get_running_loop()
    turns = [
        {"text": "Let me check.", "tool_calls": [call("wait_own_speech", "w1"), call("wait_queued_say", "w2")]},
        {"text": "That did not work."},
    ]
    async with Harness(Shop(), turns) as h:
        asked = loop.time()
        await h.session.input("check")
        await h.tools_done()
        assert loop.time() - asked < 0.1, "the circular wait raised at once, nothing interrupted it"
        await h.idle()
        for call_id in ("w1", "w2"):
            end = ended(h)[call_id]
            assert (end["status"], end["output"]) == ("failed", INTERNAL_ERROR_OUTPUT)
            assert end["error"].startswith("CircularWait: ") and "circular wait" in end["error"]
        assert h.of_type("speech.interrupted") == []
        texts = [x[1] for x in h.summary() if x[0] == "assistant"]
        assert texts == ["Let me check.", "That did not work.", "One moment please."]
        h.check_invariants()


@on_virtual_clock
async def test_a_tool_in_the_background_may_wait_for_its_own_speech() -> None:
    agent = Shop()
    turns = [{"text": "Let me check.", "tool_calls": [call("wait_own_speech_in_background", "b1")]}]
    async with Harness(agent, turns, fallback={"text": "It was heard."}) as h:
        await h.session.input("check")
        await h.tools_done()
        await h.idle()
        assert ("heard", True) in agent.runs
        assert ended(h)["b1"]["status"] == "completed"
        h.check_invariants()


@on_virtual_clock
async def test_a_cancelled_tool_that_ignores_cancellation_stays_listed_cancelling_until_its_body_settles() -> None:
    loop = asyncio.get_running_loop()
    agent = Shop()
    async with Harness(agent, [{"text": "On it.", "tool_calls": [call("deaf", "d1")]}]) as h:
        await h.session.input("go")
        await h.wait_for("tool.progress")
        asked = loop.time()
        info = await h.session.cancel_tool("d1")
        assert loop.time() - asked == pytest.approx(0.2 + 1.0), "the cancel returns after the grace (bounded)"
        assert info.status == "cancelling" and not info.ended
        assert [c.call_id for c in h.session.tool_calls(ToolStatus.RUNNING)] == ["d1"], "still listed as running"
        assert h.store.tool_calls[h.sid]["d1"].status == "cancelling"
        assert [e.data for e in h.of_type("tool.cancelling")] == [
            {"call_id": "d1", "reason": "cancelled by an operator"}
        ]
        assert h.of_type("tool.ended") == []
        again = await h.session.cancel_tool("d1")  # at once: it is cancelling already
        assert again.status == "cancelling"

        await asyncio.sleep(5)
        assert h.session.tool_call("d1").status == "cancelling"
        agent.gate.set()  # the body settles at last: the call ends, exactly once
        await h.tools_done()
        await h.idle()
        assert [(e.data["call_id"], e.data["status"]) for e in h.of_type("tool.ended")] == [("d1", "cancelled")]
        assert h.store.tool_calls[h.sid]["d1"].status == "cancelled"
        assert h.session.tool_calls(ToolStatus.RUNNING) == []
        h.check_invariants()


@on_virtual_clock
async def test_a_close_does_not_wait_for_a_tool_that_ignores_its_cancellation() -> None:
    loop = asyncio.get_running_loop()
    agent = Shop()
    async with Harness(agent, [{"text": "On it.", "tool_calls": [call("deaf", "d1")]}]) as h:
        await h.session.input("go")
        await h.wait_for("tool.progress")
        info = await h.session.cancel_tool("d1")
        assert info.status == "cancelling"
        asked = loop.time()
    assert loop.time() - asked < 0.1, "a close lets a cancelling call's body go at once"
    assert [(e.data["call_id"], e.data["status"]) for e in h.of_type("tool.ended")] == [("d1", "cancelled")]
    h.check_invariants()
    agent.gate.set()  # the body, let go by the close, ends on its own
    await asyncio.sleep(0)


@on_virtual_clock
async def test_the_reply_goes_on_without_a_foreground_call_that_is_cancelling() -> None:
    agent = Shop()
    turns = [{"text": "On it.", "tool_calls": [call("deaf_in_the_foreground", "d1")]}]
    async with Harness(agent, turns, fallback={"text": "never asked"}) as h:
        await h.session.input("go")
        await h.wait_for("tool.started")
        info = await h.session.cancel_tool("d1")
        assert info.status == "cancelling"
        await h.idle()  # the reply ended: it does not wait for a call its operator cancelled
        assert len(h.llm.requests) == 1, "no tool reply for a cancelled call"
        assert h.session.tool_call("d1").status == "cancelling"
        agent.gate.set()
        await h.tools_done()
        assert outputs(h)["d1"].output == "finished anyway"  # what it returned, late: the call ends cancelled
        assert ended(h)["d1"]["status"] == "cancelled"
        h.check_invariants()
