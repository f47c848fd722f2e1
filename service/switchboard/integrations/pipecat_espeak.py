"""A Pipecat TTS service that speaks with espeak-ng on this machine: no account, no network, no model to download.

It runs ``espeak-ng --stdout`` once per sentence (argv list, text on stdin: never a shell string) and streams the
WAV it writes as the sentence's audio. It has no word timestamps: Pipecat reports each sentence (a ``TTSTextFrame``)
once its audio has been played, so a Switchboard session hears its speeches sentence by sentence.

>>> tts = EspeakTTSService(voice="en-us", wpm=190)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pipecat.frames.frames import ErrorFrame, Frame
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import TTSService

ESPEAK = "espeak-ng"
SYNTH_TIMEOUT_S = 30.0


class EspeakTTSService(TTSService):
    """Text to speech with the espeak-ng command (``apt-get install espeak-ng``)."""

    def __init__(self, *, voice: str | None = None, wpm: int | None = None, **kwargs: Any) -> None:
        super().__init__(
            push_start_frame=True,
            push_stop_frames=True,
            settings=TTSSettings(model=None, voice=voice, language=None),
            **kwargs,
        )
        self._argv = [ESPEAK, "--stdout", *(["-v", voice] if voice else []), *(["-s", str(wpm)] if wpm else [])]

    def can_generate_metrics(self) -> bool:
        return True

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        try:
            wav = await synthesise(self._argv, text)
        except (OSError, RuntimeError, TimeoutError) as err:
            yield ErrorFrame(error=f"espeak-ng failed: {err}")
            return
        await self.stop_ttfb_metrics()
        async for frame in self._stream_audio_frames_from_iterator(
            _once(wav), strip_wav_header=True, context_id=context_id
        ):
            yield frame


async def synthesise(argv: list[str], text: str) -> bytes:
    """The WAV espeak-ng writes for ``text``."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(SYNTH_TIMEOUT_S):
            out, err = await proc.communicate(text.encode())
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if proc.returncode != 0 or not out.startswith(b"RIFF"):
        raise RuntimeError(err.decode(errors="replace").strip() or f"exit status {proc.returncode}")
    return out


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
