"""Text to timed audio with espeak-ng, run as a subprocess (argv list, text on stdin: never a shell string).

A speech's text arrives in deltas; :class:`Chunker` cuts it into clauses as soon as each is complete, and
:class:`Espeak` turns a clause into 16-bit mono PCM plus the sample at which each of its words has been spoken.

The espeak-ng command line reports no word events, so a word's end is measured: the clause's prefix up to and
including that word is synthesised on its own (``-z``, no final pause) and its length in samples is where the word
ends in the clause's audio. A prefix ends on a falling, slightly lengthened word where the clause goes on, so the
measured end tends to fall after the real one: a report of "heard up to here" lags the audio a little rather than
running ahead of it (bench/edge_espeak.py compares the measured ends with espeak-ng's own word events).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import struct
from dataclasses import dataclass

ESPEAK = "espeak-ng"
SAMPLE_BYTES = 2  # espeak-ng writes 16-bit signed little-endian mono
SYNTH_TIMEOUT_S = 30.0
MAX_CHUNK_CHARS = 240
_WORD = re.compile(r"\S+")
# the end of a clause: punctuation that makes espeak-ng pause, then whitespace
_CLAUSE_END = re.compile(r"[.!?;:,]+[\"')\]]*\s+|\n\s*")


class SynthesisError(Exception):
    """espeak-ng is missing, failed, or wrote something that is not a WAV stream."""


@dataclass(frozen=True)
class WordEnd:
    sample: int  #: where the word has been spoken to its end, in samples from the start of its clause
    chars: int  #: the speech's text up to and including the word, in characters


@dataclass(frozen=True)
class Clause:
    start: int  #: offset of the clause in the speech's text
    text: str

    @property
    def end(self) -> int:
        return self.start + len(self.text)


@dataclass(frozen=True)
class ClauseAudio:
    clause: Clause
    pcm: bytes
    rate: int
    #: where each word ends, measured while the clause plays: ``known`` fills in word order, ``words`` is done once
    #: every word is measured (cancel it if the clause is dropped)
    words: asyncio.Task[tuple[WordEnd, ...]]
    known: list[WordEnd]

    @property
    def samples(self) -> int:
        return len(self.pcm) // SAMPLE_BYTES


class Chunker:
    """Cuts text that arrives in deltas into clauses, each as soon as it is complete."""

    def __init__(self) -> None:
        self.text = ""
        self._cut = 0

    def feed(self, delta: str) -> list[Clause]:
        self.text += delta
        clauses: list[Clause] = []
        while True:
            found = _CLAUSE_END.search(self.text, self._cut)
            if found is not None:
                end = found.end()
            elif len(self.text) - self._cut > MAX_CHUNK_CHARS:
                # no pause in sight: cut at the last space that keeps the clause short
                end = self.text.rfind(" ", self._cut, self._cut + MAX_CHUNK_CHARS) + 1 or len(self.text)
            else:
                return clauses
            clauses.append(Clause(self._cut, self.text[self._cut : end]))
            self._cut = end

    def flush(self) -> list[Clause]:
        """The rest, once no more text comes."""
        rest = Clause(self._cut, self.text[self._cut :])
        self._cut = len(self.text)
        return [rest] if rest.text else []


def wav_pcm(data: bytes) -> tuple[bytes, int]:
    """The PCM samples and sample rate of a WAV stream. espeak-ng's ``--stdout`` cannot seek back to write sizes,
    so the data chunk runs to the end of the stream whatever its header says."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise SynthesisError("espeak-ng did not write a WAV stream")
    pos, rate = 12, 0
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if kind == b"fmt ":
            channels, rate, bits = (
                struct.unpack_from("<H", data, body + 2)[0],
                struct.unpack_from("<I", data, body + 4)[0],
                struct.unpack_from("<H", data, body + 14)[0],
            )
            if channels != 1 or bits != 8 * SAMPLE_BYTES:
                raise SynthesisError(f"espeak-ng wrote {channels} channel(s) of {bits} bits; expected 1 of 16")
        elif kind == b"data":
            pcm = data[body:]
            return pcm[: len(pcm) - len(pcm) % SAMPLE_BYTES], rate
        pos = body + size + (size & 1)
    raise SynthesisError("espeak-ng's WAV stream has no data")


class Espeak:
    """The espeak-ng engine: ``voice`` (``-v``, e.g. ``en-us``) and ``wpm`` (``-s``) as its command line takes them."""

    def __init__(
        self, *, binary: str = ESPEAK, voice: str | None = None, wpm: int | None = None, parallel: int = 2
    ) -> None:
        path = shutil.which(binary)
        if path is None:
            raise SynthesisError(f"{binary} is not installed (apt-get install espeak-ng)")
        self.argv = [path, "--stdout", "--stdin", "-b", "1"]
        if voice:
            self.argv += ["-v", voice]
        if wpm:
            self.argv += ["-s", str(wpm)]
        self._slots = asyncio.Semaphore(parallel)

    async def pcm(self, text: str, *, final_pause: bool = True) -> tuple[bytes, int]:
        """``text`` as PCM samples and their rate."""
        argv = self.argv if final_pause else [*self.argv, "-z"]
        async with self._slots:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                async with asyncio.timeout(SYNTH_TIMEOUT_S):
                    out, err = await proc.communicate(text.encode())
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        if proc.returncode != 0:
            why = " ".join(err.decode(errors="replace").split())[:200]
            raise SynthesisError(f"espeak-ng exited with {proc.returncode}: {why}")
        return wav_pcm(out)

    async def clause(self, clause: Clause) -> ClauseAudio:
        """The clause's audio, as soon as it is synthesised, and where each of its words ends in it (measured while
        the clause plays: it can start before its words are known)."""
        full = asyncio.create_task(self.pcm(clause.text))
        known: list[WordEnd] = []
        words = asyncio.create_task(self._word_ends(clause, full, known))  # its runs queue behind the clause's own
        try:
            pcm, rate = await asyncio.shield(full)
        except BaseException:
            words.cancel()
            full.cancel()
            await asyncio.gather(full, words, return_exceptions=True)
            raise
        return ClauseAudio(clause, pcm, rate, words, known)

    async def _word_ends(
        self, clause: Clause, full: asyncio.Task[tuple[bytes, int]], known: list[WordEnd]
    ) -> tuple[WordEnd, ...]:
        matches = list(_WORD.finditer(clause.text))
        prefixes = [asyncio.ensure_future(self.pcm(clause.text[: m.end()], final_pause=False)) for m in matches]
        try:
            pcm, _ = await full
            total, last = len(pcm) // SAMPLE_BYTES, 0
            for m, prefix in zip(matches, prefixes, strict=True):
                end = len((await prefix)[0]) // SAMPLE_BYTES  # the first words are known first
                last = min(max(last, end), total)  # in order, and inside the clause's audio
                known.append(WordEnd(last, clause.start + m.end()))
        except BaseException:
            for task in prefixes:
                task.cancel()
            await asyncio.gather(*prefixes, return_exceptions=True)
            raise
        return tuple(known)
