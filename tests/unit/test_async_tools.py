"""Scenario 11: async tools — progress, the background pair, the final pair and the deferred reply (I4, I1)."""

from __future__ import annotations

import asyncio

from switchboard import Agent, RunContext, function_tool
from switchboard.runtime.chat import FunctionCall, FunctionCallOutput

from .harness import Harness


class Reporter(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.gate = asyncio.Event()

    @function_tool
    async def report(self, ctx: RunContext, topic: str) -> str:
        """Write a report (slow; reports progress)."""
        await ctx.update(f"collecting {topic}", progress=0.1)
        await self.gate.wait()
        await ctx.update("writing", progress=0.5)
        await ctx.update("proofreading", progress=0.9)
        return f"report on {topic} is ready"


TURNS = [
    {"text": "I will start it.", "tool_calls": [{"name": "report", "arguments": {"topic": "sales"}, "id": "c1"}]},
    {"text": "It runs: {{tool_output:report}}"},
    {"text": "Finished: {{tool_output:report}}"},
]


async def test_I4_async_tool_progress_background_pair_final_pair_and_deferred_reply():
    agent = Reporter()
    async with Harness(agent, TURNS) as h:
        first = await h.session.input("write the sales report")
        await h.wait_for("tool.progress")
        # the first update committed a pair with a "background" output, and the reply went on without the tool
        await h.wait_for(
            "chat.item", lambda e: e.data["item"]["type"] == "message" and "It runs" in e.data["item"]["text"]
        )
        info = h.session.tool_call("c1")
        assert info is not None and info.status == "running" and info.background
        s = h.summary()
        assert s[:3] == [("user", "write the sales report"), ("assistant", "I will start it."), ("call", "report")]
        assert s[3][:2] == ("output", "report") and "background" in s[3][2] and "collecting sales" in s[3][2]
        assert s[4] == ("assistant", f"It runs: {s[3][2]}"), "the model saw the background output"
        assert [(r.speech_id, r.step) for r in h.llm.requests] == [(first.speech_id, 0), (first.speech_id, 1)]

        agent.gate.set()
        await h.tools_done()
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] != first.speech_id)
        await h.idle()

        progress = [(e.data["call_id"], e.data["message"], e.data["progress"]) for e in h.of_type("tool.progress")]
        assert progress == [
            ("c1", "collecting sales", 0.1),
            ("c1", "writing", 0.5),
            ("c1", "proofreading", 0.9),
        ]
        info = h.session.tool_call("c1")
        assert info is not None and info.status == "completed" and info.output == "report on sales is ready"
        assert [p.message for p in info.progress] == ["collecting sales", "writing", "proofreading"]

        # each later update and the final result are pairs of their own, with synthetic call ids
        calls = [(it.call_id, it.name) for it in h.chat() if isinstance(it, FunctionCall)]
        assert calls == [("c1", "report"), ("c1/update/2", "report"), ("c1/update/3", "report"), ("c1/final", "report")]
        final = [it for it in h.chat() if isinstance(it, FunctionCallOutput) and it.call_id == "c1/final"]
        assert [(o.output, o.is_error) for o in final] == [("report on sales is ready", False)]
        ended = [e.data for e in h.of_type("tool.ended")]
        assert [(d["call_id"], d["status"], d["output"]) for d in ended] == [
            ("c1", "completed", "report on sales is ready")
        ]

        # the deferred reply was spoken once idle, and shows the final result
        created = [e.data for e in h.of_type("speech.created")]
        assert [d["source"] for d in created] == ["reply", "deferred_reply"]
        deferred_id = created[1]["speech_id"]
        assert h.session.speech(deferred_id).source == "deferred_reply"
        assert h.summary()[-1] == ("assistant", "Finished: report on sales is ready")
        assert h.llm.requests[-1].speech_id == deferred_id
        # the deferred reply started only after the first speech was done
        types_ids = [(e.type, e.data.get("speech_id")) for e in h.events.events[h.sid]]
        assert types_ids.index(("speech.done", first.speech_id)) < types_ids.index(("speech.started", deferred_id))
        h.check_invariants()


async def test_I4_deferred_reply_waits_while_the_session_is_speaking():
    agent = Reporter()
    long_text = " ".join(f"w{i}" for i in range(20))  # 0.2 s
    turns = [*TURNS[:2], {"text": long_text}, {"text": "Finished: {{tool_output:report}}"}]
    async with Harness(agent, turns) as h:
        await h.session.input("write the sales report")
        await h.wait_for("tool.progress")
        await h.idle()
        busy = await h.session.input("tell me a story")
        await h.wait_for("speech.started", lambda e: e.data["speech_id"] == busy.speech_id)
        agent.gate.set()
        await h.tools_done()
        assert h.session.current_speech is not None and h.session.current_speech.id == busy.speech_id
        await h.idle()
        # the progress pairs of the later updates are there too (each update reaches the model); set them aside
        updates = [it.id for it in h.chat() if "/update/" in getattr(it, "call_id", "")]
        assert len(updates) == 4
        s = h.summary(skip=set(updates))
        assert s[-5:] == [
            ("user", "tell me a story"),
            ("assistant", long_text),
            ("call", "report"),  # the final pair, committed while the story was playing
            ("output", "report", "report on sales is ready"),
            ("assistant", "Finished: report on sales is ready"),
        ]
        h.check_invariants()
