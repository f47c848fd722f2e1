"""A Pipecat voice bot whose brain and control plane is a Switchboard session.

Pipecat does the audio: the transport (here the machine's microphone and speaker), voice activity detection, the
speech-to-text and the text-to-speech. Switchboard does the rest: the agent, its model and tools, the conversation's
durable record, and the control plane (interrupt, inject input, watch and cancel tools, the operator console), with
what was actually heard committed as the assistant's message.

    pip install "switchboard[pipecat]" "pipecat-ai[local,silero,deepgram]==1.14.0"
    switchboard serve &                       # or any Switchboard service; SWITCHBOARD_KEY with media:connect
    DEEPGRAM_API_KEY=... python examples/pipecat_bot.py --agent assistant

The session it creates (or the one given with ``--session``) can be watched and steered from the console while you
talk: ``POST /v1/sessions/{sid}/say`` makes the bot say something, ``POST /interrupt`` cuts it off.

Other transports plug in the same way; only ``transport`` changes:

- Daily (a WebRTC room)::

      from pipecat.transports.daily.transport import DailyParams, DailyTransport
      transport = DailyTransport(room_url, token, "Switchboard bot",
                                 DailyParams(audio_in_enabled=True, audio_out_enabled=True))

- Twilio Media Streams (a phone call; in the FastAPI handler of Twilio's ``<Connect><Stream>`` WebSocket, with a
  session created per call, e.g. keyed by its ``callSid``)::

      from pipecat.serializers.twilio import TwilioFrameSerializer
      from pipecat.transports.websocket.fastapi import FastAPIWebsocketParams, FastAPIWebsocketTransport
      transport = FastAPIWebsocketTransport(websocket, FastAPIWebsocketParams(
          audio_in_enabled=True, audio_out_enabled=True, add_wav_header=False,
          serializer=TwilioFrameSerializer(stream_sid, call_sid, account_sid, auth_token)))

Any Pipecat TTS can replace espeak-ng (Cartesia, ElevenLabs, ...); one with word timestamps makes the session's
heard text exact to the word, one without to the sentence.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from pipecat.audio.vad.silero import SileroVADAnalyzer
from pipecat.frames.frames import EndWorkerFrame
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.audio.vad_processor import VADProcessor
from pipecat.processors.frame_processor import FrameDirection
from pipecat.services.deepgram.stt import DeepgramSTTService
from pipecat.transports.local.audio import LocalAudioTransport, LocalAudioTransportParams
from pipecat.turns.user_turn_processor import UserTurnProcessor
from pipecat.workers.runner import WorkerRunner

from switchboard.client import AsyncClient
from switchboard.integrations.pipecat import SwitchboardBrain
from switchboard.integrations.pipecat_espeak import EspeakTTSService


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("SWITCHBOARD_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--agent", default="assistant", help="the agent of the session to create")
    parser.add_argument("--session", help="join this session instead of creating one")
    args = parser.parse_args()
    key = os.environ.get("SWITCHBOARD_KEY")

    sid = args.session
    if sid is None:
        async with AsyncClient(args.url, api_key=key) as sb:
            sid = (await sb.create_session(agent=args.agent)).id
    print(f"talking to session {sid}: open {args.url}/console to watch and steer it")

    transport = LocalAudioTransport(LocalAudioTransportParams(audio_in_enabled=True, audio_out_enabled=True))
    brain = SwitchboardBrain(args.url, sid, api_key=key)
    pipeline = Pipeline(
        [
            transport.input(),  # the microphone
            VADProcessor(vad_analyzer=SileroVADAnalyzer()),  # the user speaking, or not
            DeepgramSTTService(api_key=os.environ["DEEPGRAM_API_KEY"]),  # transcriptions
            UserTurnProcessor(),  # the user's turns: UserStartedSpeakingFrame, and an interruption of the bot
            brain,  # the session: transcripts in, its speeches out, interruptions both ways
            EspeakTTSService(),  # the speeches as audio
            transport.output(),  # the speaker
            brain.playback(),  # what the speaker played, reported to the session as heard
        ]
    )
    worker = PipelineWorker(pipeline)

    @brain.event_handler("on_session_closed")
    async def session_closed(processor: SwitchboardBrain, code: int, reason: str) -> None:
        print(f"session {sid} ended ({code} {reason})")
        await processor.push_frame(EndWorkerFrame(), FrameDirection.UPSTREAM)

    runner = WorkerRunner()
    await runner.add_workers(worker)
    await runner.run()


if __name__ == "__main__":
    asyncio.run(main())
