"""The media edge protocol on a session with in-memory ports (no transport): what is sent to the edge, how its reports
drive the session, and every failure path (late, impossible or unknown reports, an edge that leaves or is replaced)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from switchboard import Agent, RunContext, SpeechInterrupted, function_tool
from switchboard.runtime.media import REPLAY_FRAMES, EdgeConnection, EdgePlayout, MediaEdge
from switchboard.runtime.media_frames import FrameRefused, _Frame, parse_edge_frame
from switchboard.runtime.playout import SimulatedPlayout
from tests.waiting import WAIT_S, until

from .harness import WPS, Harness

WORDS = "one two three four five six seven eight nine ten"


class Waiter(Agent):
    def __init__(self) -> None:
        super().__init__(instructions="test")
        self.released: list[str] = []

    @function_tool
    async def heard(self, ctx: RunContext) -> str:
        """Wait for the preamble."""
        try:
            await ctx.wait_for_playout()
        except SpeechInterrupted:
            self.released.append("interrupted")
            raise
        return "heard"


class Setup:
    def __init__(self, h: Harness, playout: EdgePlayout) -> None:
        self.h = h
        self.playout = playout
        self.sent: list[dict[str, Any]] = []
        self.edge = self.connect()

    def connect(self) -> MediaEdge:
        edge = MediaEdge(self.h.session, lambda frame: self.sent.append(frame.model_dump()))
        previous = self.playout.attach(edge)
        if previous is not None:
            previous.close()
        return edge

    async def frame(self, edge: MediaEdge | None = None, **data: Any) -> None:
        await (edge or self.edge).handle(parse_edge_frame(data))

    def types(self) -> list[str]:
        return [f["type"] for f in self.sent]

    def text(self, speech_id: str) -> str:
        return "".join(f["delta"] for f in self.sent if f["type"] == "speech.text" and f["speech_id"] == speech_id)

    async def until_sent(self, kind: str, timeout: float = WAIT_S) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                found = [f for f in self.sent if f["type"] == kind]
                if found:
                    return found[-1]
                await asyncio.sleep(0.001)


def harness(agent: Agent, turns: list[dict[str, Any]], **kw: Any) -> tuple[Harness, EdgePlayout]:
    playout = EdgePlayout(SimulatedPlayout(WPS))
    return Harness(agent, turns, playout=playout, **kw), playout


async def test_a_speech_goes_to_the_edge_and_plays_when_the_edge_says_so() -> None:
    h, playout = harness(Waiter(), [{"text": "Hello there."}])
    async with h:
        s = Setup(h, playout)
        result = await h.session.input("hi")
        start = await s.until_sent("speech.end")
        assert s.types()[0] == "speech.start" and s.sent[0]["allow_interruptions"] is True
        assert start["speech_id"] == result.speech_id and s.text(result.speech_id or "") == "Hello there."
        assert h.of_type("speech.started") == []  # no audio yet: not speaking
        await s.frame(type="playback.started", speech_id=result.speech_id)
        assert len(h.of_type("speech.started")) == 1 and h.session.agent_state == "speaking"
        await s.frame(type="playback.finished", speech_id=result.speech_id, interrupted=False)
        await h.idle()
        assert h.summary() == [("user", "hi"), ("assistant", "Hello there.")]
        assert "speech.stop" not in s.types()


async def test_an_interrupt_commits_the_last_progress_and_releases_waits_without_the_edge() -> None:
    agent = Waiter()
    h, playout = harness(agent, [{"text": WORDS, "tool_calls": [{"name": "heard", "id": "c1"}]}])
    async with h:
        s = Setup(h, playout)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(type="playback.started", speech_id=speech_id)
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=len("one two three"))
        await h.session.interrupt()  # the edge never acknowledges anything
        assert agent.released == ["interrupted"]
        assert (await s.until_sent("speech.stop"))["speech_id"] == speech_id
        # what the edge reports after the interruption changes nothing committed
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=len(WORDS))
        await s.frame(type="playback.finished", speech_id=speech_id, interrupted=False)
        await h.idle()
        assert ("assistant", "one two three", "interrupted") in h.summary()
        speech = h.session.speech(speech_id)
        assert speech is not None and speech.played_text == "one two three"


async def test_progress_that_arrives_in_the_same_tick_as_an_interrupt_is_not_heard() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS}])
    async with h:
        s = Setup(h, playout)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=3)
        speech = h.session.speech(speech_id)
        assert speech is not None
        speech.interrupt()
        await asyncio.sleep(0)  # the stop runs at the interruption, before the reply loop reads the heard text
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=7)
        await h.idle()
        assert speech.played_text == "one"


async def test_an_edge_without_word_timings_cut_after_its_audio_started_keeps_what_it_was_sent() -> None:
    h, playout = harness(Waiter(), [])
    async with h:
        s = Setup(h, playout)
        first = await h.session.say(WORDS)
        await s.until_sent("speech.end")
        await s.frame(type="playback.started", speech_id=first.id)
        await s.frame(type="user.speech_started")
        await h.idle()
        assert first.played_text == WORDS and h.summary()[-1] == ("assistant", WORDS, "interrupted")

        # once the edge has reported a position, its reports are what was heard, from its next speech on too
        second = await h.session.say("You may cut me off.")
        await asyncio.sleep(0.01)
        await s.frame(type="playback.progress", speech_id=second.id, played_chars=3)
        await s.frame(type="playback.finished", speech_id=second.id, interrupted=True)
        third = await h.session.say("Cut before a word.")
        await asyncio.sleep(0.01)
        await s.frame(type="playback.started", speech_id=third.id)
        await s.frame(type="user.speech_started")
        await h.idle()
        assert (second.played_text, third.played_text) == ("You", "")
        assert h.summary()[-1] == ("assistant", "You", "interrupted")


async def test_a_close_takes_the_final_transcript_of_a_barge_in_that_arrives_just_after_it() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS}])
    async with h:
        s = Setup(h, playout)
        await h.session.input("tell me")
        await s.until_sent("speech.end")
        await s.frame(type="user.speech_started")  # the caller talks over the agent, then hangs up
        closing = asyncio.create_task(h.session.aclose())
        await asyncio.sleep(0.05)
        await s.frame(type="user.transcript", text="never mind, bye", final=True)
        await closing
    assert h.summary()[-1] == ("user", "never mind, bye")

    h, playout = harness(Waiter(), [])
    async with h:
        s = Setup(h, playout)
        await s.frame(type="user.speech_started")
        playout.detach(s.edge)
        s.edge.close()  # the edge left: no transcript can come, the close does not wait for one
        async with asyncio.timeout(0.5):  # bound: well under the 2 s it would wait for a transcript
            await h.session.aclose()


async def test_barge_in_interrupts_only_speeches_that_allow_it() -> None:
    h, playout = harness(Waiter(), [])
    async with h:
        s = Setup(h, playout)
        firm = await h.session.say("Please listen to this.", allow_interruptions=False)
        await s.until_sent("speech.end")
        assert s.sent[0]["allow_interruptions"] is False
        assert not s.edge.stops_current()
        await s.frame(type="playback.progress", speech_id=firm.id, played_chars=6)
        await s.frame(type="user.speech_started")
        assert not firm.interrupted and "speech.stop" not in s.types()
        await s.frame(type="playback.finished", speech_id=firm.id, interrupted=False)
        await h.idle()
        soft = await h.session.say("You may cut me off.")
        await asyncio.sleep(0.01)
        await s.frame(type="playback.progress", speech_id=soft.id, played_chars=3)
        assert s.edge.stops_current()
        await s.frame(type="user.speech_started")
        assert not s.edge.stops_current()
        assert soft.interrupted
        await h.idle()
        assert soft.played_text == "You"


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ({"type": "playback.progress", "played_chars": 99}, "played_chars_beyond_text"),
        ({"type": "playback.progress", "played_chars": 2}, "played_chars_backwards"),
        ({"type": "playback.progress", "played_chars": 2, "speech_id": "speech_other"}, "unknown_speech"),
        ({"type": "playback.started", "speech_id": "speech_other"}, "unknown_speech"),
        ({"type": "playback.finished", "interrupted": False}, "speech_not_ended"),
        ({"type": "playback.progress", "played_chars": -1}, "bad_frame"),
        ({"type": "playback.progress", "played_chars": 1.5}, "bad_frame"),
        ({"type": "user.transcript", "text": 7}, "bad_frame"),
        ({"type": "user.transcript", "text": "x" * 9000}, "text_too_long"),
        ({"type": "nonsense"}, "unknown_type"),
    ],
)
async def test_impossible_reports_are_refused_and_the_session_plays_on(frame: dict[str, Any], code: str) -> None:
    h, playout = harness(Waiter(), [{"text": "A short line of text.", "ttft_ms": 0, "word_ms": 50}])
    async with h:
        s = Setup(h, playout)
        speech_id = (await h.session.input("hi")).speech_id or ""
        async with asyncio.timeout(WAIT_S):
            while len(s.text(speech_id)) < 7:  # "A short", the rest still streaming
                await asyncio.sleep(0.001)
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=5)
        with pytest.raises(FrameRefused) as refused:
            await s.frame(**{"speech_id": speech_id, **frame})
        assert refused.value.code == code
        # unharmed: the speech still plays to its end through the edge
        await s.until_sent("speech.end")
        await s.frame(type="playback.finished", speech_id=speech_id, interrupted=False)
        await h.idle()
        assert h.summary()[-1] == ("assistant", "A short line of text.")


async def test_an_edge_that_leaves_mid_speech_ends_it_interrupted_and_the_session_goes_on_text_only() -> None:
    agent = Waiter()
    turns = [{"text": WORDS, "tool_calls": [{"name": "heard", "id": "c1"}]}, {"text": "Back on the clock."}]
    h, playout = harness(agent, turns, allow_interruptions=False)
    async with h:
        s = Setup(h, playout)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=len("one two"))
        playout.detach(s.edge)
        s.edge.close()  # even a speech that does not allow interruptions: its audio is gone
        async with asyncio.timeout(1):  # bound: released within ticks, the edge waited on for nothing
            while not agent.released:
                await asyncio.sleep(0)
        assert agent.released == ["interrupted"]
        await h.idle()
        assert ("assistant", "one two", "interrupted") in h.summary()
        sent = len(s.sent)
        await h.session.input("still there?")
        await h.idle()  # on the simulated clock, to its end
        assert h.summary()[-1] == ("assistant", "Back on the clock.") and len(s.sent) == sent


async def test_a_second_edge_replaces_the_first_and_the_first_is_sent_nothing_more() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS}, {"text": "Second edge."}])
    async with h:
        s = Setup(h, playout)
        first = s.edge
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(first, type="playback.progress", speech_id=speech_id, played_chars=len("one"))
        s.sent.clear()
        second = s.connect()
        assert first.gone and not second.gone
        await h.idle()
        assert ("assistant", "one", "interrupted") in h.summary()
        assert s.sent == []  # no speech.stop to the edge that left; nothing to the new one yet
        next_id = (await h.session.input("again")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(second, type="playback.finished", speech_id=next_id, interrupted=False)
        await h.idle()
        assert h.summary()[-1] == ("assistant", "Second edge.")
        with pytest.raises(FrameRefused):  # the old connection knows no speech any more
            await s.frame(first, type="playback.progress", speech_id=next_id, played_chars=1)


async def test_the_edge_cutting_the_audio_itself_ends_the_speech_interrupted_where_it_was() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS}], allow_interruptions=False)
    async with h:
        s = Setup(h, playout)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=len("one two three four"))
        await s.frame(type="playback.finished", speech_id=speech_id, interrupted=True)
        await h.idle()
        assert ("assistant", "one two three four", "interrupted") in h.summary()
        assert "speech.stop" not in s.types()


async def test_each_tool_step_is_a_segment_of_its_own() -> None:
    turns = [
        {"text": "Let me check.", "tool_calls": [{"name": "heard", "id": "c1"}]},
        {"text": "All done."},
    ]
    h, playout = harness(Waiter(), turns)
    async with h:
        s = Setup(h, playout)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(type="playback.finished", speech_id=speech_id, interrupted=False)
        async with asyncio.timeout(WAIT_S):
            while s.types().count("speech.end") < 2:
                await asyncio.sleep(0.001)
        starts = [f for f in s.sent if f["type"] == "speech.start"]
        assert [f["speech_id"] for f in starts] == [speech_id, speech_id]
        assert s.text(speech_id) == "Let me check.All done."  # two segments, each counted from its own start
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=len("All done."))
        await s.frame(type="playback.finished", speech_id=speech_id, interrupted=False)
        await h.idle()
        speech = h.session.speech(speech_id)
        assert speech is not None and speech.played_text == "Let me check. All done."


async def test_transcripts_are_input_interim_and_final() -> None:
    h, playout = harness(Waiter(), [{"text": "Noted."}])
    async with h:
        s = Setup(h, playout)
        await s.frame(type="user.transcript", text="book a", final=False)
        await s.frame(type="user.transcript", text="book a table")
        inputs = [(e.data["text"], e.data["final"]) for e in h.of_type("user.input")]
        assert inputs == [("book a", False), ("book a table", True)]
        await s.until_sent("speech.end")
        await s.frame(type="ping")
        assert s.types()[-1] == "pong"


def test_every_frame_model_names_its_type() -> None:
    from switchboard.runtime.media_frames import EDGE_FRAMES, SERVER_FRAMES

    types = [model.model_fields["type"].default for model in (*SERVER_FRAMES, *EDGE_FRAMES)]
    assert len(set(types)) == len(types)
    assert all(issubclass(model, _Frame) for model in (*SERVER_FRAMES, *EDGE_FRAMES))


async def test_played_ms_alone_is_heard_text_at_a_speaking_rate_back_to_a_whole_word() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS}])
    async with h:
        s = Setup(h, playout)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        # 1 s at 15 characters a second is "one two three f": the word cut in its middle is not heard
        await s.frame(type="playback.progress", speech_id=speech_id, played_ms=1000)
        speech = h.session.speech(speech_id)
        assert speech is not None and speech.heard_text == "one two three"
        with pytest.raises(FrameRefused) as refused:
            await s.frame(type="playback.progress", speech_id=speech_id, played_ms=900)
        assert refused.value.code == "played_ms_backwards"
        await s.frame(
            type="playback.progress", speech_id=speech_id, played_ms=1300, played_chars=len("one two three four")
        )
        await h.session.interrupt()
        await h.idle()
        assert speech.played_text == "one two three four"  # the edge's own character position wins
        assert speech.info().audio_played_ms == 1300
        assert h.of_type("speech.interrupted")[-1].data["audio_played_ms"] == 1300
        with pytest.raises(FrameRefused) as bad:
            await s.frame(type="playback.progress", speech_id=speech_id)
        assert bad.value.code == "bad_frame"


def connect_numbered(s: Setup, number: int) -> MediaEdge:
    edge = MediaEdge(s.h.session, lambda frame: s.sent.append(frame.model_dump()), replay_frames=REPLAY_FRAMES)
    previous = s.playout.attach(edge, EdgeConnection("e1", number))
    if previous is not None:
        previous.close()
    return edge


async def test_a_held_edge_resumes_with_the_frames_it_missed_and_no_repeats() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS, "word_ms": 20}, {"text": "And more."}])
    async with h:
        s = Setup(h, playout)
        s.edge = connect_numbered(s, 1)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.frame(type="playback.started", speech_id=speech_id)
        await s.until_sent("speech.text")
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=len("one"))
        consumed = s.sent[-1]["n"]
        assert [f["n"] for f in s.sent] == list(range(1, consumed + 1))
        before = s.text(speech_id)
        assert playout.hold(s.edge, WAIT_S)
        s.sent.clear()
        await h.session.input("and?", interrupt=False)  # queued behind the speech the held edge plays
        speech = h.session.speech(speech_id)
        assert speech is not None
        await until(lambda: speech.text == WORDS)  # the model has produced the whole text, kept for the edge
        assert s.sent == []  # held: nothing goes out
        resumed = playout.resume(EdgeConnection("e1", 2), consumed, lambda f: s.sent.append(f.model_dump()))
        assert resumed is s.edge
        assert s.sent[0] == {"type": "resumed", "after": consumed}
        assert before + s.text(speech_id) == WORDS  # the rest, nothing twice
        assert s.types()[-1] == "speech.end"
        await s.frame(type="playback.finished", speech_id=speech_id)
        await speech.wait_for_playout()
        assert not speech.interrupted and speech.played_text == WORDS


async def test_a_resume_from_frames_no_longer_kept_is_refused_and_a_held_edge_not_resumed_leaves() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS}])
    async with h:
        s = Setup(h, playout)
        s.edge = connect_numbered(s, 1)
        speech_id = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(type="playback.progress", speech_id=speech_id, played_chars=len("one two"))
        last = s.sent[-1]["n"]
        assert playout.hold(s.edge, 0.5)  # bound: a hold that runs out while the test looks
        assert playout.resume(EdgeConnection("e2", 1), last, s.sent.append) is None  # not this edge's stream
        assert playout.resume(EdgeConnection("e1", 2), last + 5, s.sent.append) is None  # never sent
        speech = h.session.speech(speech_id)
        assert speech is not None and not speech.done and playout.edge is s.edge
        await until(lambda: speech.done)  # the hold ran out: an edge that left
        assert speech.interrupted and speech.played_text == "one two"
        assert playout.edge is None


async def test_a_resume_gets_the_stop_of_an_interruption_while_away_and_not_a_speech_it_never_saw() -> None:
    h, playout = harness(Waiter(), [{"text": WORDS}, {"text": "Never heard."}])
    async with h:
        s = Setup(h, playout)
        s.edge = connect_numbered(s, 1)
        first = (await h.session.input("hi")).speech_id or ""
        await s.until_sent("speech.end")
        await s.frame(type="playback.progress", speech_id=first, played_chars=len("one"))
        consumed = s.sent[-1]["n"]
        assert playout.hold(s.edge, WAIT_S)
        await h.session.interrupt()  # released at once, with nobody connected (I3)
        second = (await h.session.input("again", interrupt=False)).speech_id or ""
        await until(lambda: (sp := h.session.speech(second)) is not None and sp.text == "Never heard.")  # sent
        await h.session.interrupt()
        await h.idle()
        s.sent.clear()
        assert playout.resume(EdgeConnection("e1", 2), consumed, lambda f: s.sent.append(f.model_dump())) is s.edge
        # the stop of the speech it was playing; nothing of the one that began and was stopped while it was away
        assert [(f["type"], f.get("speech_id")) for f in s.sent] == [("resumed", None), ("speech.stop", first)]
        speech = h.session.speech(first)
        assert speech is not None and speech.played_text == "one"
