"""Where ``switchboard edge`` puts a speech's audio: one WAV file per speech, the sound device, or nowhere.

A sink is told of each frame twice: ``ahead`` before the frame is due (a sound device buffers, so it is fed early)
and ``played`` once the frame's time has passed (a file holds only what has been played, so a speech cut off
leaves a file that ends where the audio stopped).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .espeak import SAMPLE_BYTES

_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class Sink(Protocol):
    def ahead(self, pcm: bytes) -> None: ...

    def played(self, pcm: bytes) -> None: ...

    def close(self, *, cut: bool) -> None: ...


def file_stem(speech_id: str) -> str:
    """A file name for a speech id that cannot leave the output directory."""
    return _UNSAFE_NAME.sub("_", speech_id).lstrip(".") or "speech"


class WavSink:
    """``<dir>/<speech_id>.wav``: the samples played, and nothing after the cut."""

    def __init__(self, path: Path, rate: int) -> None:
        self.path = path
        self._wav = wave.open(str(path), "wb")  # noqa: SIM115 (closed by close())
        self._wav.setnchannels(1)
        self._wav.setsampwidth(SAMPLE_BYTES)
        self._wav.setframerate(rate)

    def ahead(self, pcm: bytes) -> None:
        pass

    def played(self, pcm: bytes) -> None:
        self._wav.writeframesraw(pcm)

    def close(self, *, cut: bool) -> None:
        self._wav.close()


PLAYERS: dict[str, list[str]] = {
    "aplay": ["-q", "-t", "raw", "-f", "S16_LE", "-c", "1", "-r", "{rate}", "-"],
    "pw-play": ["--channels", "1", "--format", "s16", "--rate", "{rate}", "-"],
}


def find_player() -> str | None:
    for name in PLAYERS:
        if shutil.which(name):
            return name
    return None


class DeviceSink:
    """The sound device, through ``aplay`` or ``pw-play`` reading raw samples on stdin. A cut kills the player, so
    the audio stops at once instead of draining what it has buffered."""

    def __init__(self, player: str, rate: int) -> None:
        path = shutil.which(player) or player
        argv = [path, *(a.replace("{rate}", str(rate)) for a in PLAYERS[player])]
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def ahead(self, pcm: bytes) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(pcm)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._proc = None  # no device after all: the speech goes on silently, its reports unchanged

    def played(self, pcm: bytes) -> None:
        pass

    def close(self, *, cut: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if cut:
            proc.kill()
        if proc.stdin is not None:
            try:
                proc.stdin.close()  # uncut, it plays what it holds and exits
            except OSError:
                pass
        if cut:
            proc.wait()
        else:  # reaped once it has played out, however long that takes: no zombie left per speech
            threading.Thread(target=proc.wait, name=f"player-{proc.pid}", daemon=True).start()


@dataclass
class SpeechRecord:
    """What ``--out`` keeps beside each WAV (``<speech_id>.json``): the text, where each word ends in the audio,
    and what was played and reported."""

    speech_id: str
    rate: int = 0
    text: str = ""
    words: list[tuple[int, int]] = field(default_factory=list)  # (end sample in the speech's audio, chars)
    played_samples: int = 0
    reported_chars: int = 0
    interrupted: bool = False

    def heard_chars(self) -> int:
        """The text spoken to the end of a word within the samples played."""
        heard = 0
        for sample, chars in self.words:
            if sample > self.played_samples:
                break
            heard = chars
        return heard

    def as_json(self) -> dict[str, Any]:
        return {
            "speech_id": self.speech_id,
            "sample_rate": self.rate,
            "text": self.text,
            "words": [{"end_sample": s, "chars": c} for s, c in self.words],
            "played_samples": self.played_samples,
            "reported_chars": self.reported_chars,
            "interrupted": self.interrupted,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_json(), ensure_ascii=False, indent=2) + "\n")
