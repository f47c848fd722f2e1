"""What the Pipecat integration's tests share: an output transport that plays into a WAV file in real time."""

from __future__ import annotations

import asyncio
import wave
from pathlib import Path

from pipecat.frames.frames import OutputAudioRawFrame, StartFrame
from pipecat.transports.base_output import BaseOutputTransport
from pipecat.transports.base_transport import TransportParams


class WavOutputTransport(BaseOutputTransport):
    """Writes the audio it is given to a WAV file, paced like a sound device: a frame takes its duration to play."""

    def __init__(self, path: Path, sample_rate: int = 16000) -> None:
        super().__init__(TransportParams(audio_out_enabled=True, audio_out_sample_rate=sample_rate))
        self.path = path
        self._wav: wave.Wave_write | None = None

    async def start(self, frame: StartFrame) -> None:
        await super().start(frame)
        self._wav = wave.open(str(self.path), "wb")  # noqa: SIM115 (closed in cleanup(), as the pipeline ends)
        self._wav.setnchannels(1)
        self._wav.setsampwidth(2)
        self._wav.setframerate(self.sample_rate)
        await self.set_transport_ready(frame)

    async def write_audio_frame(self, frame: OutputAudioRawFrame) -> bool:
        assert self._wav is not None
        self._wav.writeframes(frame.audio)
        await asyncio.sleep(len(frame.audio) / 2 / self.sample_rate)  # pacing: the audio's own duration
        return True

    async def cleanup(self) -> None:
        await super().cleanup()
        if self._wav is not None:
            self._wav.close()
            self._wav = None
