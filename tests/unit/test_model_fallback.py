"""When the model fails: fallback models tried in order, and the agent's spoken ``on_model_error`` line."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from switchboard import Agent
from switchboard.integrations.model_profiles import ModelProfiles
from switchboard.runtime.chat import ChatMessage
from switchboard.runtime.llm import LLMError, LLMRequest, TextDelta, build_llm
from switchboard.runtime.llm.fallback import FallbackLLM
from tests.waiting import WAIT_S

from .harness import Harness


def script(*turns: dict[str, Any]) -> dict[str, Any]:
    return {"provider": "scripted", "turns": list(turns), "fallback": {"text": "spare."}}


async def texts(llm: Any) -> str:
    out = ""
    async for chunk in llm.stream(LLMRequest(instructions="", items=[], speech_id="sp1")):
        if isinstance(chunk, TextDelta):
            out += chunk.text
    return out


async def test_a_model_that_fails_before_answering_hands_over_to_the_next(caplog: pytest.LogCaptureFixture):
    llm = build_llm({"provider": "fallback", "models": [script({"error": "502 from upstream"}), script({"text": "B"})]})
    assert await texts(llm) == "B"
    assert "failed (502 from upstream); trying" in caplog.text
    assert caplog.records[-1].levelno == logging.WARNING


async def test_a_model_that_never_answers_is_given_up_after_the_first_chunk_timeout():
    slow = script({"text": "too late", "ttft_ms": 60_000})
    llm = build_llm({"provider": "fallback", "models": [slow, script({"text": "quick"})], "ttft_timeout_s": 0.05})
    assert await asyncio.wait_for(texts(llm), WAIT_S) == "quick"


async def test_a_failure_after_the_first_words_is_the_generations_and_the_last_failure_names_its_model():
    class Breaks:
        """Says a word, then fails: what was said cannot be taken back, so no other model is tried."""

        def stream(self, request: LLMRequest) -> Any:
            async def gen() -> Any:
                yield TextDelta("Hel")
                raise LLMError("connection reset")

            return gen()

        def save_state(self) -> None:
            return None

        def load_state(self, state: Any) -> None:
            return None

        async def aclose(self) -> None:
            return None

    second = build_llm(script({"text": "never"}))
    llm = FallbackLLM([Breaks(), second], names=["first", "second"])
    with pytest.raises(LLMError, match="connection reset"):
        await texts(llm)
    assert second.save_state() == {"position": 0}  # untouched
    both_down = FallbackLLM(
        [build_llm(script({"error": "a down"})), build_llm(script({"error": "b down"}))], names=["a", "b"]
    )
    with pytest.raises(LLMError, match=r"^b: b down$"):
        await texts(both_down)


async def test_each_model_keeps_its_script_position_across_a_restart():
    config = {"provider": "fallback", "models": [script({"error": "down"}, {"text": "A2"}), script({"text": "B1"})]}
    llm = build_llm(config)
    assert await texts(llm) == "B1"
    state = llm.save_state()
    again = build_llm(config)
    again.load_state(state)
    assert await texts(again) == "A2"


def test_profiles_declare_fallbacks_by_name_and_bad_ones_stop_the_service() -> None:
    profiles = ModelProfiles(
        {
            "main": {**script({"text": "x"}), "fallbacks": ["spare"], "ttft_timeout_s": 2},
            "spare": script({"text": "y"}),
        }
    )
    resolved = profiles.for_session({"profile": "main"}, None)
    assert resolved is not None and resolved["provider"] == "fallback" and resolved["ttft_timeout_s"] == 2
    assert [m["turns"][0]["text"] for m in resolved["models"]] == ["x", "y"]
    assert profiles.fallbacks("main") == ["spare"] and profiles.fallbacks("spare") == []
    with pytest.raises(ValueError, match="not other profiles: nowhere"):
        ModelProfiles({"main": {**script(), "fallbacks": ["nowhere"]}})
    with pytest.raises(ValueError, match="not other profiles: main"):
        ModelProfiles({"main": {**script(), "fallbacks": ["main"]}})
    with pytest.raises(ValueError, match="fallbacks must be a list"):
        ModelProfiles({"main": {**script(), "fallbacks": "spare"}})


class Apologetic(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test", on_model_error="Sorry, I am having trouble. One moment please.")


async def test_the_agent_says_its_model_error_line_instead_of_silence(caplog: pytest.LogCaptureFixture):
    async with Harness(Apologetic(), [{"text": "Let me", "error": "upstream timed out"}]) as h:
        res = await h.session.input("hello?")
        await h.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        types = [t for t in h.types() if t in ("generation.failed", "speech.started", "speech.done")]
        assert types == ["generation.failed", "speech.started", "speech.done"]
        said = [it for it in h.session.chat.items if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert [(m.text, m.interrupted) for m in said] == [("Sorry, I am having trouble. One moment please.", False)]
        assert [(m.text, m.interrupted) for m in h.chat() if isinstance(m, ChatMessage) and m.role == "assistant"] == [
            ("Sorry, I am having trouble. One moment please.", False)
        ]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "the model failed" in r.getMessage()]
    assert len(errors) == 1 and getattr(errors[0], "session_id", None) == h.sid


async def test_an_interruption_stops_the_model_error_line_like_any_speech():
    async with Harness(Apologetic(), [{"error": "down"}], allow_interruptions=True) as h:
        res = await h.session.input("hello?")
        await h.wait_for("speech.started", lambda e: e.data["speech_id"] == res.speech_id)
        await h.session.interrupt()
        done = await h.wait_for("speech.done", lambda e: e.data["speech_id"] == res.speech_id)
        assert done.data["interrupted"] is True
        said = [it for it in h.session.chat.items if isinstance(it, ChatMessage) and it.role == "assistant"]
        assert all(m.interrupted for m in said)


async def test_script_rules_answer_the_user_and_each_tool_whatever_the_order() -> None:
    from switchboard.runtime.chat import FunctionCallOutput, new_id
    from switchboard.runtime.llm.scripted import BACKGROUND_OUTPUT_PREFIX, PROGRESS_OUTPUT_PREFIX

    llm = build_llm(
        {
            "provider": "scripted",
            "turns": [{"text": "first turn"}],
            "on_user": [{"match": r"fl(y|ight)", "turn": {"text": "flights!"}}],
            "on_started": {"search": {"text": "started"}},
            "on_output": {"search": {"text": "done: {{tool_output:search}}"}},
        }
    )

    async def answer(*items: Any) -> str:
        out = ""
        async for chunk in llm.stream(LLMRequest(instructions="", items=list(items))):
            if isinstance(chunk, TextDelta):
                out += chunk.text
        return out

    def output(text: str) -> FunctionCallOutput:
        return FunctionCallOutput(id=new_id("item"), call_id="c1", name="search", output=text)

    user = ChatMessage(id=new_id("item"), role="user", text="Any FLIGHTS to Rome?")
    cut = ChatMessage(id=new_id("item"), role="assistant", text="Let", interrupted=True)
    assert await answer(user, cut) == "flights!"
    assert await answer(output(f"{BACKGROUND_OUTPUT_PREFIX} (searching).")) == "started"
    assert await answer(output("3 found")) == "done: 3 found"
    # a later progress report is not the result: nothing is said unless a rule says what
    assert await answer(output(f"{PROGRESS_OUTPUT_PREFIX}: 2 of 3, 67% done. Still running.")) == ""
    assert await answer(ChatMessage(id=new_id("item"), role="user", text="hello")) == "first turn"  # no rule
    with pytest.raises(ValueError, match="not a regular expression"):
        build_llm({"provider": "scripted", "on_user": [{"match": "(", "turn": {}}]})


async def test_the_background_output_is_worded_as_script_rules_expect() -> None:
    from switchboard.runtime.llm.scripted import BACKGROUND_OUTPUT_PREFIX, PROGRESS_OUTPUT_PREFIX
    from tests.agents_fixture import Tester

    async with Harness(Tester(), [{"tool_calls": [{"name": "progress", "arguments": {"steps": 2}}]}]) as h:
        await h.session.input("go")
        await h.tools_done()
        outputs = [it.output for it in h.session.chat.items if getattr(it, "type", "") == "function_call_output"]
        assert outputs[0].startswith(BACKGROUND_OUTPUT_PREFIX)
        assert outputs[1].startswith(PROGRESS_OUTPUT_PREFIX), outputs
