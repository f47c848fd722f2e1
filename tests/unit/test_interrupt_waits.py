"""Scenarios 8-9: a tool waiting for its spoken preamble is released at once by an interruption (I3).

The harness sets the forced-interrupt timeout to 2 s; each scenario is bounded by 1 s, and the conftest fixture
fails the test if the safety net fires.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import pytest

from switchboard import Agent, RunContext, SpeechInterrupted, function_tool
from switchboard.runtime.aio import resolve
from switchboard.runtime.chat import FunctionCallOutput
from switchboard.runtime.playout import PlaybackReport
from switchboard.runtime.speech import NotInterruptible
from tests.waiting import WAIT_S

from .harness import WPS, Harness

LONG = " ".join(f"word{i}" for i in range(40))  # 0.4 s at the harness' 100 words per second
_WORD = re.compile(r"\S+")


class Waiter(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test agent")
        self.log: list[str] = []

    @function_tool
    async def confirm(self, ctx: RunContext, what: str) -> str:
        """Confirm something once the preamble was heard."""
        self.log.append("waiting")
        try:
            await ctx.wait_for_playout()
        except SpeechInterrupted:
            self.log.append("interrupted")
            raise
        self.log.append("played")
        return f"confirmed {what}"


TURNS = [
    {"text": LONG, "tool_calls": [{"name": "confirm", "arguments": {"what": "order"}, "id": "c1"}]},
    {"text": "Sure, what else?"},
]


async def _interrupt_waiting_tool(h: Harness, agent: Waiter) -> None:
    async with asyncio.timeout(WAIT_S):
        first = await h.session.input("confirm my order")
        await h.wait_for("tool.started")
        while agent.log != ["waiting"]:
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.05)  # a few words of the preamble are heard
        assert h.session.current_speech is not None and h.session.current_speech.id == first.speech_id
        second = await h.session.input("actually, wait", interrupt=True)
        # input() returns once the interrupted speech is done; the waiting tool has been released by then
        await h.wait_for("tool.ended")
        assert agent.log == ["waiting", "interrupted"]
        await h.idle()

    ended = h.of_type("tool.ended")
    assert [e.data["status"] for e in ended] == ["interrupted"]
    assert ended[0].data["is_error"] is True
    info = h.session.tool_call("c1")
    assert info is not None and info.status == "interrupted" and info.is_error
    outputs = [it for it in h.chat() if isinstance(it, FunctionCallOutput)]
    assert len(outputs) == 1 and outputs[0].is_error and outputs[0].call_id == "c1"

    s = h.summary()
    assert s[0] == ("user", "confirm my order")
    assert s[1][0] == "assistant" and s[1][-1] == "interrupted" and LONG.startswith(s[1][1])
    assert ("user", "actually, wait") in s
    assert s[-1] == ("assistant", "Sure, what else?")
    assert s.index(("user", "actually, wait")) < s.index(("assistant", "Sure, what else?"))
    # the interrupted speech ended, the new input was answered by its own speech, no tool reply was generated
    speech1 = h.session.speech(first.speech_id)
    assert speech1 is not None and speech1.interrupted and not speech1.forced
    assert second.speech_id is not None and second.speech_id != first.speech_id
    assert [(r.speech_id, r.step) for r in h.llm.requests] == [(first.speech_id, 0), (second.speech_id, 0)]
    done = [e.data for e in h.of_type("speech.done")]
    assert done == [
        {"speech_id": first.speech_id, "interrupted": True},
        {"speech_id": second.speech_id, "interrupted": False},
    ]


async def test_I3_wait_for_playout_raises_promptly_on_interrupting_input():
    agent = Waiter()
    async with Harness(agent, TURNS) as h:
        await _interrupt_waiting_tool(h, agent)
        h.check_invariants()


async def test_I3_wait_for_playout_completes_normally_without_interruption():
    agent = Waiter()
    turns = [
        {"text": "One moment.", "tool_calls": [{"name": "confirm", "arguments": {"what": "order"}}]},
        {"text": "Done: {{tool_output:confirm}}"},
    ]
    async with Harness(agent, turns) as h:
        await h.session.input("confirm my order")
        await h.idle()
        assert agent.log == ["waiting", "played"]
        assert h.summary()[-1] == ("assistant", "Done: confirmed order")
        h.check_invariants()


# -- a sink that never acknowledges a stop --------------------------------------------------------------------


class DeafStream:
    """Plays like the simulated clock, but ``stop()`` is ignored and ``wait_done()`` never resolves once stopped."""

    def __init__(self, owner: DeafPlayout, words_per_second: float) -> None:
        self._word_s = 1.0 / words_per_second
        self._text = ""
        self._played_chars = 0
        self._input_ended = False
        self.stop_calls = 0
        self._changed = asyncio.Event()
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._report = PlaybackReport()  # reports its start like any sink; only the stop goes unacknowledged
        self._task = asyncio.create_task(self._run(), name="deaf-playout")
        owner.tasks.add(self._task)
        self._task.add_done_callback(owner.tasks.discard)

    @property
    def played_text(self) -> str:
        return self._text[: self._played_chars]

    def push(self, text: str) -> None:
        self._text += text
        self._changed.set()

    def end_input(self) -> None:
        self._input_ended = True
        self._changed.set()

    async def wait_done(self) -> None:
        await asyncio.shield(self._done)

    def stop(self) -> None:
        self.stop_calls += 1  # acknowledged by nobody: playback goes on, and wait_done() will never resolve

    def on_playback_started(self, callback: Callable[[], None]) -> None:
        self._report.on_started(callback)

    async def _run(self) -> None:
        while True:
            match = _WORD.search(self._text, self._played_chars)
            if match is None:
                if self._input_ended:
                    break
                self._changed.clear()
                await self._changed.wait()
                continue
            self._report.started()
            await asyncio.sleep(self._word_s)
            self._played_chars = match.end()
        if not self.stop_calls:
            resolve(self._done, None)


class DeafPlayout:
    def __init__(self, words_per_second: float = WPS) -> None:
        self.words_per_second = words_per_second
        self.streams: list[DeafStream] = []
        self.tasks: set[asyncio.Task[None]] = set()

    def start(self, speech_id: str) -> DeafStream:
        stream = DeafStream(self, self.words_per_second)
        self.streams.append(stream)
        return stream

    async def aclose(self) -> None:
        tasks = list(self.tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_I3_wait_for_playout_raises_promptly_when_sink_never_acknowledges_stop():
    agent = Waiter()
    playout = DeafPlayout()
    try:
        async with Harness(agent, TURNS, playout=playout) as h:
            await _interrupt_waiting_tool(h, agent)
            interrupted = playout.streams[0]
            assert interrupted.stop_calls >= 1, "the interrupted stream was told to stop"
            assert not interrupted._done.done(), "its sink never acknowledged the stop"
            h.check_invariants()
    finally:
        await playout.aclose()


async def test_I3_input_during_an_uninterruptible_speech_is_queued_not_dropped():
    text = " ".join(f"w{i}" for i in range(15))
    async with Harness(Waiter(), [{"text": "Reply."}]) as h:
        say = await h.session.say(text, allow_interruptions=False)
        await h.wait_for("speech.started")
        with pytest.raises(NotInterruptible):
            await h.session.interrupt()
        res = await h.session.input("hello", interrupt=True)
        assert res.speech_id is not None and not say.interrupted
        await h.idle()
        assert h.summary() == [("assistant", text), ("user", "hello"), ("assistant", "Reply.")]
        assert [e.data["speech_id"] for e in h.of_type("speech.done")] == [say.id, res.speech_id]
        h.check_invariants()
