"""The Pipecat brain's side of the media protocol that a single server run does not show: it connects again after a
session moved (4410) or a restart (1012), under one edge id with numbered attempts, sends again first the final
transcript no connection answered, and silences the speech the lost connection was playing; and with a TTS that has
word timestamps, it reports the speech heard word by word."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from pipecat.frames.frames import (
    EndWorkerFrame,
    Frame,
    InterruptionFrame,
    LLMTextFrame,
    TranscriptionFrame,
    TTSAudioRawFrame,
    TTSTextFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.pipeline import Pipeline
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.tests.utils import run_test
from websockets.asyncio.server import ServerConnection, serve

from switchboard.integrations.pipecat import SwitchboardBrain
from tests.waiting import WAIT_S, until


class MovingSession:
    """A session that moves twice: each connection but the last is closed with the next code of ``closes``."""

    def __init__(self, closes: list[int]) -> None:
        self.closes = closes
        self.queries: list[dict[str, list[str]]] = []
        self.transcripts: list[list[dict[str, Any]]] = []

    async def handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.queries.append(parse_qs(urlsplit(ws.request.path).query))
        got: list[dict[str, Any]] = []
        self.transcripts.append(got)
        async with asyncio.timeout(WAIT_S):
            got.append(json.loads(await ws.recv()))
        if len(self.transcripts) == 1:  # a speech begins, then the session moves away under it
            await ws.send(json.dumps({"type": "speech.start", "speech_id": "sp1", "allow_interruptions": True}))
            await ws.send(json.dumps({"type": "speech.text", "speech_id": "sp1", "delta": "Let me see."}))
        if self.closes:
            await ws.close(self.closes.pop(0), "session moving")
            return
        await ws.send(json.dumps({"type": "transcript.taken", "id": got[0]["id"], "item_id": "it-1"}))
        await ws.close(1000, "session closed")


@pytest.mark.parametrize("closes", [[4410], [1012, 4410]])
async def test_it_connects_again_and_sends_the_unanswered_transcript_again_with_its_id(closes: list[int]) -> None:
    session = MovingSession(list(closes))
    async with serve(session.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        brain = SwitchboardBrain(f"http://127.0.0.1:{port}", "s1")
        ended: list[int] = []

        @brain.event_handler("on_session_closed")
        async def closed(processor: SwitchboardBrain, code: int, reason: str) -> None:
            ended.append(code)
            await processor.push_frame(EndWorkerFrame(), FrameDirection.UPSTREAM)

        said = TranscriptionFrame("Is the eight o'clock train on time?", "caller", "now")
        down, _ = await asyncio.wait_for(
            run_test(brain, frames_to_send=[said], send_end_frame=False, start_timeout=WAIT_S), WAIT_S
        )
    assert ended == [1000]
    sent = [got[0] for got in session.transcripts]
    assert len(sent) == len(closes) + 1
    assert all((f["type"], f["text"], f["final"]) == ("user.transcript", said.text, True) for f in sent)
    assert len({f["id"] for f in sent}) == 1  # one transcript: the session takes it once, wherever it arrives
    assert brain.pending_transcripts == 0
    assert len({q["edge_id"][0] for q in session.queries}) == 1
    assert [q["connection"][0] for q in session.queries] == [str(n) for n in range(1, len(closes) + 2)]
    # the speech that was playing when the session moved ended there: it is silenced here too
    texts = [i for i, f in enumerate(down) if isinstance(f, LLMTextFrame)]
    cuts = [i for i, f in enumerate(down) if isinstance(f, InterruptionFrame)]
    assert texts and cuts and cuts[0] > texts[0]


class WordSpeaker(FrameProcessor):
    """A TTS with word timestamps, as the output transport lets its frames through: each word's audio, then the word
    (with a word changed on the way, as a TTS's normalisation does)."""

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if not isinstance(frame, LLMTextFrame):
            await self.push_frame(frame, direction)
            return
        for word in frame.text.split():
            await self.push_frame(TTSAudioRawFrame(b"\0\0" * 160, 16000, 1))
            await self.push_frame(TTSTextFrame("8," if word == "eight," else word, text_type="word"))


class OneSpeech:
    """A session that sends one speech in two deltas, keeps the edge's reports until it has finished, then closes."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []

    async def handler(self, ws: ServerConnection) -> None:
        for frame in (
            {"type": "speech.start", "speech_id": "sp1", "allow_interruptions": True},
            {"type": "speech.text", "speech_id": "sp1", "delta": "Your table is booked"},
            {"type": "speech.text", "speech_id": "sp1", "delta": " for eight, sir."},
            {"type": "speech.end", "speech_id": "sp1"},
        ):
            await ws.send(json.dumps(frame))
        async with asyncio.timeout(WAIT_S):
            while not self.reports or self.reports[-1]["type"] != "playback.finished":
                self.reports.append(json.loads(await ws.recv()))
        await ws.close(1000, "session closed")


async def test_word_timestamps_are_reported_word_by_word_as_the_transport_plays_them() -> None:
    session = OneSpeech()
    async with serve(session.handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        brain = SwitchboardBrain(f"http://127.0.0.1:{port}", "s1")

        @brain.event_handler("on_session_closed")
        async def closed(processor: SwitchboardBrain, code: int, reason: str) -> None:
            await processor.push_frame(EndWorkerFrame(), FrameDirection.UPSTREAM)

        pipeline = Pipeline([brain, WordSpeaker(), brain.playback()])
        await asyncio.wait_for(
            run_test(pipeline, frames_to_send=[], send_end_frame=False, start_timeout=WAIT_S), WAIT_S
        )
    text = "Your table is booked for eight, sir."
    assert [(r["type"], r.get("played_chars", r.get("interrupted"))) for r in session.reports] == [
        ("playback.started", None),
        ("playback.progress", 0),  # it reports positions: cut now, nothing was heard
        *[("playback.progress", text.index(w) + len(w)) for w in ("Your", "table", "is", "booked", "for")],
        # "8," is not in the text: no report for it, and the next word found puts it right again
        ("playback.progress", len(text)),
        ("playback.finished", False),
    ]


class HangUp(BaseObserver):
    """Ends the pipeline (the bot hangs up) as soon as the brain has sent a speech's text down to be spoken."""

    async def on_push_frame(self, data: FramePushed) -> None:
        if isinstance(data.source, SwitchboardBrain) and isinstance(data.frame, LLMTextFrame):
            await data.source.push_frame(EndWorkerFrame(), FrameDirection.UPSTREAM)


async def test_a_pipeline_that_ends_while_a_speech_plays_closes_the_connection_and_ends() -> None:
    left: list[int | None] = []

    async def session(ws: ServerConnection) -> None:
        await ws.send(json.dumps({"type": "speech.start", "speech_id": "sp1", "allow_interruptions": True}))
        await ws.send(json.dumps({"type": "speech.text", "speech_id": "sp1", "delta": "Let me see."}))
        async for _ in ws:
            pass
        left.append(ws.close_code)

    async with serve(session, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        brain = SwitchboardBrain(f"http://127.0.0.1:{port}", "s1")
        running = run_test(brain, frames_to_send=[], send_end_frame=False, start_timeout=WAIT_S, observers=[HangUp()])
        down, _ = await asyncio.wait_for(running, WAIT_S)
        await until(lambda: left)
    assert left == [1000]  # the edge left: the session ends the speech where it was heard, and goes on
    assert not brain.connected
    assert not any(isinstance(f, InterruptionFrame) for f in down)  # ending is not an interruption
