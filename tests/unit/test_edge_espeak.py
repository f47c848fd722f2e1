"""The reference edge's speech engine: clauses cut from streamed text, espeak-ng's WAV stream, word timings."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest

from switchboard.cli.edge_audio import DeviceSink, SpeechRecord, file_stem, find_player
from switchboard.cli.espeak import MAX_CHUNK_CHARS, Chunker, Clause, Espeak, SynthesisError, wav_pcm
from tests.espeak_support import require_espeak


def test_clauses_are_cut_as_soon_as_they_are_complete_and_cover_the_text() -> None:
    chunker = Chunker()
    assert chunker.feed("Hello the") == []
    assert chunker.feed("re, how are") == [Clause(0, "Hello there, ")]
    assert chunker.feed(" you? Fine") == [Clause(13, "how are you? ")]
    assert chunker.flush() == [Clause(26, "Fine")]
    assert chunker.flush() == []
    assert chunker.text == "Hello there, how are you? Fine"


def test_a_clause_without_a_pause_is_cut_at_a_space_before_it_grows_too_long() -> None:
    chunker = Chunker()
    words = " ".join(["word"] * 100)
    clauses = chunker.feed(words) + chunker.flush()
    assert "".join(c.text for c in clauses) == words
    assert all(len(c.text) <= MAX_CHUNK_CHARS for c in clauses)
    assert all(c.text.endswith(" ") for c in clauses[:-1])  # never in the middle of a word


def _wav(pcm: bytes, *, rate: int = 22050, data_size: int = 0x7FFFF000, channels: int = 1) -> bytes:
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 0x7FFFF024)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", data_size)
        + pcm
    )


def test_a_streamed_wav_is_read_to_its_end_whatever_its_header_claims() -> None:
    pcm, rate = wav_pcm(_wav(b"\x01\x00\x02\x00\x03"))
    assert (pcm, rate) == (b"\x01\x00\x02\x00", 22050)  # the odd byte is not half a sample
    with pytest.raises(SynthesisError, match="did not write a WAV"):
        wav_pcm(b"garbage")
    with pytest.raises(SynthesisError, match="expected 1 of 16"):
        wav_pcm(_wav(b"", channels=2))


def test_heard_text_is_every_word_spoken_to_its_end_within_the_samples_played() -> None:
    record = SpeechRecord("sp", words=[(100, 5), (250, 12), (400, 20)])
    assert record.heard_chars() == 0
    record.played_samples = 249
    assert record.heard_chars() == 5
    record.played_samples = 250
    assert record.heard_chars() == 12


def test_a_speech_id_cannot_name_a_file_outside_the_output_directory() -> None:
    assert file_stem("../../etc/passwd") == "_.._etc_passwd"
    assert "/" not in file_stem("a/b") and file_stem("..") == "speech"


async def test_espeak_gives_each_word_an_end_in_order_inside_its_clause() -> None:
    require_espeak()
    engine = Espeak()
    audio = await engine.clause(Clause(7, "Hello there, how are you today? "))
    assert audio.rate > 0 and audio.samples > audio.rate // 2  # over half a second of speech
    words = await audio.words
    assert audio.known == list(words)  # filled in word order as each is measured
    ends = [w.sample for w in words]
    assert [w.chars for w in words] == [12, 19, 23, 27, 31, 38]  # offsets in the speech, not the clause
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    assert ends[0] > 0 and ends[-1] <= audio.samples
    # a word's end is where the prefix through it stops sounding: the first word alone is about as long
    alone, _ = await engine.pcm("Hello", final_pause=False)
    assert abs(len(alone) // 2 - ends[0]) < audio.rate // 10


async def test_text_reaches_espeak_on_stdin_never_as_an_option_or_a_shell_word() -> None:
    require_espeak()
    engine = Espeak()
    pcm, _ = await engine.pcm("--version; $(touch /nonexistent) `x`")
    assert len(pcm) > 0  # spoken, not run or parsed as an option


def test_the_sound_device_gets_the_samples_ahead_and_a_cut_stops_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stand-in for aplay on PATH: it records its arguments and what it is fed, then waits to be killed or drained
    received = tmp_path / "received.raw"
    player = tmp_path / "aplay"
    player.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\ncat > {received}\n')
    player.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert find_player() == "aplay"

    sink = DeviceSink("aplay", 22050)
    drained = sink._proc
    assert drained is not None
    sink.ahead(b"\x01\x00" * 100)
    sink.played(b"\x02\x00" * 100)  # a device is fed ahead only: nothing more reaches it
    sink.close(cut=False)
    sink.close(cut=True)  # once closed, closing again does nothing
    deadline = time.monotonic() + 10
    while not (received.exists() and received.read_bytes() == b"\x01\x00" * 100) and time.monotonic() < deadline:
        time.sleep(0.02)  # the player drains what it was given after its stdin closed
    assert received.read_bytes() == b"\x01\x00" * 100
    deadline = time.monotonic() + 10
    while not (tmp_path / "argv").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (tmp_path / "argv").read_text().split() == ["-q", "-t", "raw", "-f", "S16_LE", "-c", "1", "-r", "22050", "-"]
    deadline = time.monotonic() + 10
    while drained.returncode is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert drained.returncode == 0  # reaped once it played out: an edge leaves no zombie per speech

    cut = DeviceSink("aplay", 22050)
    proc = cut._proc
    assert proc is not None
    cut.ahead(b"\x03\x00" * 100)
    cut.close(cut=True)
    assert proc.returncode == -9  # killed, not drained: the audio stops now
    assert proc.stdin is not None and proc.stdin.closed
