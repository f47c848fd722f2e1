"""A Pipecat pipeline as a session's media edge (switchboard.integrations.pipecat) against a real server: with
Pipecat's own test utilities (frames in, frames out), and as a local pipeline that speaks with espeak-ng into a WAV
file in real time."""

from __future__ import annotations

import asyncio
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pipecat.frames.frames import (
    EndFrame,
    EndWorkerFrame,
    InterimTranscriptionFrame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMTextFrame,
    TranscriptionFrame,
    UserStartedSpeakingFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection
from pipecat.tests.utils import run_test
from pipecat.workers.runner import WorkerRunner

from switchboard.integrations.pipecat import SegmentMark, SwitchboardBrain
from switchboard.integrations.pipecat_espeak import EspeakTTSService
from tests.espeak_support import require_espeak
from tests.pipecat_support import WavOutputTransport
from tests.waiting import WAIT_S, until

from .media_support import KEY
from .server import EventStream, Server

pytestmark = pytest.mark.e2e

REPLY = "Of course. A table for two at eight is booked."
LONG = (
    "Thank you for calling the station. Your train to Geneva leaves from platform seven at a quarter past nine. "
    "It stops in Lausanne, Morges and Nyon before it arrives. Tickets can be bought on board or at the desk."
)


@pytest.fixture
async def api(media_srv: Server) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=media_srv.url, headers=headers, timeout=10) as client:
        yield client


async def create_session(api: httpx.AsyncClient, turns: list[dict[str, Any]]) -> str:
    r = await api.post("/v1/sessions", json={"agent": "tester", "llm": {"provider": "scripted", "turns": turns}})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def chat(api: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await api.get(f"/v1/sessions/{sid}/chat")
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


async def speech(api: httpx.AsyncClient, sid: str, speech_id: str) -> dict[str, Any]:
    r = await api.get(f"/v1/sessions/{sid}/speeches/{speech_id}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def end_with_session(brain: SwitchboardBrain) -> list[int]:
    """End the pipeline when the session ends (the close codes seen)."""
    codes: list[int] = []

    @brain.event_handler("on_session_closed")
    async def closed(processor: SwitchboardBrain, code: int, reason: str) -> None:
        codes.append(code)
        await processor.push_frame(EndWorkerFrame(), FrameDirection.UPSTREAM)

    return codes


class ReplyEnded(BaseObserver):
    """Set once the brain has pushed a whole reply downstream."""

    def __init__(self) -> None:
        super().__init__()
        self.ended = asyncio.Event()

    async def on_push_frame(self, data: FramePushed) -> None:
        if isinstance(data.source, SwitchboardBrain) and isinstance(data.frame, LLMFullResponseEndFrame):
            self.ended.set()


async def test_transcripts_go_in_and_the_reply_comes_out_as_llm_frames(
    api: httpx.AsyncClient, media_srv: Server
) -> None:
    sid = await create_session(api, [{"text": REPLY}])
    brain = SwitchboardBrain(media_srv.url, sid, api_key=KEY)
    codes = end_with_session(brain)
    reply = ReplyEnded()

    async def close_after_reply() -> None:
        await reply.ended.wait()
        assert (await api.delete(f"/v1/sessions/{sid}")).status_code in (200, 202, 204)

    said = TranscriptionFrame("Book a table for two at eight.", "caller", "2026-01-01T00:00:00Z")
    (down, _), _ = await asyncio.wait_for(
        asyncio.gather(
            run_test(brain, frames_to_send=[said], send_end_frame=False, observers=[reply], start_timeout=10),
            close_after_reply(),
        ),
        timeout=WAIT_S,
    )
    kinds = [type(f).__name__ for f in down if not isinstance(f, (SegmentMark, EndFrame, LLMTextFrame))]
    assert kinds == [
        "TranscriptionFrame",  # passed on, for whoever records the conversation
        "LLMFullResponseStartFrame",  # the reply, for the TTS
        "LLMFullResponseEndFrame",
        "InterruptionFrame",  # the session closed with the reply unplayed (no TTS here): it is silenced
    ]
    assert "".join(f.text for f in down if isinstance(f, LLMTextFrame)) == REPLY
    assert codes == [1000]  # the session closed: the brain said so and the pipeline ended
    assert brain.pending_transcripts == 0  # the session answered transcript.taken
    users = [i for i in await chat(api, sid) if i.get("role") == "user"]
    assert [u["text"] for u in users] == ["Book a table for two at eight."]


async def test_an_interim_transcript_is_reported_and_a_barge_in_interrupts_the_pipeline(
    api: httpx.AsyncClient, media_srv: Server
) -> None:
    sid = await create_session(api, [])
    events = await EventStream.open(media_srv, sid, additional_headers={"Authorization": f"Bearer {KEY}"})
    brain = SwitchboardBrain(media_srv.url, sid, api_key=KEY)
    codes = end_with_session(brain)
    reply = ReplyEnded()

    async def talk_over_the_bot() -> str:
        await until(lambda: brain.connected)
        speech_id = str((await api.post(f"/v1/sessions/{sid}/say", json={"text": LONG})).json()["speech_id"])
        await reply.ended.wait()
        await brain.queue_frame(InterimTranscriptionFrame("Wait, I", "caller", "now"))
        await brain.queue_frame(UserStartedSpeakingFrame())
        await events.wait_for("speech.interrupted", lambda d: d["speech_id"] == speech_id)
        await api.delete(f"/v1/sessions/{sid}")
        return speech_id

    try:
        (down, _), speech_id = await asyncio.wait_for(
            asyncio.gather(
                run_test(brain, frames_to_send=[], send_end_frame=False, observers=[reply], start_timeout=10),
                talk_over_the_bot(),
            ),
            timeout=WAIT_S,
        )
    finally:
        await events.close()
    kinds = [type(f).__name__ for f in down if not isinstance(f, (SegmentMark, EndFrame, LLMTextFrame))]
    assert kinds[:2] == ["LLMFullResponseStartFrame", "LLMFullResponseEndFrame"]
    # passed on (a system frame overtakes a data frame in Pipecat's queues)
    assert sorted(kinds[2:4]) == ["InterimTranscriptionFrame", "UserStartedSpeakingFrame"]
    assert kinds[4:] == ["InterruptionFrame"]  # the session's speech.stop: the TTS and the transport drop the speech
    assert codes == [1000]
    interim = await events.wait_for("user.input", lambda d: d["final"] is False)
    assert interim["data"]["text"] == "Wait, I"
    cut = await speech(api, sid, speech_id)
    assert (cut["state"], cut["interrupted"], cut["heard_text"]) == ("done", True, "")  # no audio was played


@pytest.fixture
def espeak_installed() -> None:
    require_espeak()


@pytest.mark.usefixtures("espeak_installed")
async def test_a_local_pipeline_speaks_with_espeak_and_the_session_hears_it(
    api: httpx.AsyncClient, media_srv: Server, tmp_path: Path
) -> None:
    sid = await create_session(api, [{"text": REPLY}])
    brain = SwitchboardBrain(media_srv.url, sid, api_key=KEY)
    codes = end_with_session(brain)
    worker = PipelineWorker(
        Pipeline([brain, EspeakTTSService(), WavOutputTransport(tmp_path / "bot.wav"), brain.playback()]),
        cancel_on_idle_timeout=False,
    )
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    try:
        await until(lambda: brain.connected)
        # the user's turn: the reply is spoken to its end, and the session heard all of it
        await worker.queue_frame(TranscriptionFrame("Book a table for two at eight.", "caller", "now"))

        async def replied() -> list[dict[str, Any]]:
            return [i for i in await chat(api, sid) if i.get("role") == "assistant"]

        [answer] = await until(replied)
        assert (answer["text"], answer["interrupted"]) == (REPLY, False)

        # a long speech, cut by the user a sentence or more in: the session heard what was played, to the sentence
        speech_id = (await api.post(f"/v1/sessions/{sid}/say", json={"text": LONG})).json()["speech_id"]
        await until(lambda: _heard(api, sid, speech_id))
        await worker.queue_frames([UserStartedSpeakingFrame(), InterruptionFrame()])  # what a user turn does
        cut = await until(lambda: _done(api, sid, speech_id))
    finally:
        await api.delete(f"/v1/sessions/{sid}")
        await asyncio.wait_for(running, timeout=WAIT_S)
    assert cut["interrupted"] is True
    heard = cut["heard_text"]
    assert LONG.startswith(heard) and heard.endswith(".") and len(heard) < len(LONG), heard
    assert codes == [1000]
    with wave.open(str(tmp_path / "bot.wav")) as wav:
        played_s = wav.getnframes() / wav.getframerate()
    assert played_s > 2.0  # the reply, and the long speech up to the barge-in, were played as audio


async def _heard(api: httpx.AsyncClient, sid: str, speech_id: str) -> str:
    return str((await speech(api, sid, speech_id))["heard_text"])


async def _done(api: httpx.AsyncClient, sid: str, speech_id: str) -> dict[str, Any] | None:
    found = await speech(api, sid, speech_id)
    return found if found["state"] == "done" else None
