"""The reference edge's speech engine: how long a clause takes to synthesise, and how its measured word ends compare
with espeak-ng's own word events.

`switchboard edge` runs the espeak-ng command line, which reports no word events, so it measures where each word ends
(the clause's prefix through that word, synthesised on its own). Here the same text also goes through the espeak-ng
library (libespeak-ng, through ctypes: benchmark only), whose WORD events say where each word starts in the audio.
A measured end of word k should lie near the start of word k+1, and rarely before it by more than the gap between
words: a report that came early would claim a word not yet heard.

    .venv/bin/python bench/edge_espeak.py [--runs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import re
import statistics
import time

from switchboard.cli.espeak import Clause, Espeak

TEXTS = [
    "Thank you for calling the station.",
    "Your train to Geneva leaves from platform seven at a quarter past nine,",
    "and it stops in Lausanne, Morges and Nyon before it arrives in Geneva at ten to eleven.",
    "Tickets can be bought on board, at the desk, or with the app, which also shows delays and platform changes.",
]

AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
ESPEAK_CHARS_UTF8 = 1
EVENT_WORD = 1


class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_char * 8),
    ]


_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


_STARTS: list[tuple[int, int]] = []


def _on_audio(wav: object, samples: int, events: ctypes._Pointer[_Event]) -> int:
    i = 0
    while events[i].type != 0:
        if events[i].type == EVENT_WORD:
            _STARTS.append((events[i].text_position - 1, events[i].audio_position))
        i += 1
    return 0


_ON_AUDIO = _CALLBACK(_on_audio)  # kept alive for as long as the library may call it
_LIB: ctypes.CDLL | None = None


def word_starts_ms(text: str) -> list[tuple[int, int]]:
    """(character offset, audio ms) of each word's start, from libespeak-ng's WORD events."""
    global _LIB
    if _LIB is None:
        _LIB = ctypes.CDLL("libespeak-ng.so.1")
        _LIB.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, None, 0)
        _LIB.espeak_SetSynthCallback(_ON_AUDIO)
    _STARTS.clear()
    data = text.encode()
    _LIB.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, ESPEAK_CHARS_UTF8, None, None)
    _LIB.espeak_Synchronize()
    return list(_STARTS)


async def main(runs: int) -> None:
    engine = Espeak(parallel=2)
    print(
        f"{'words':>5} {'audio s':>8} {'audio ready ms (median, max)':>29} {'first word end ms':>19} "
        f"{'all word ends ms':>18}"
    )
    offsets: list[float] = []
    at_pauses: list[float] = []
    for text in TEXTS:
        ready, first, timed = [], [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            audio = await engine.clause(Clause(0, text))
            ready.append((time.perf_counter() - t0) * 1000)
            while not audio.known:
                await asyncio.sleep(0.001)
            first.append((time.perf_counter() - t0) * 1000)
            words_ends = await audio.words
            timed.append((time.perf_counter() - t0) * 1000)
        words = len(words_ends)
        print(
            f"{words:>5} {audio.samples / audio.rate:>8.2f} {statistics.median(ready):>20.0f}, {max(ready):>6.0f} "
            f"{statistics.median(first):>11.0f}, {max(first):>5.0f} "
            f"{statistics.median(timed):>10.0f}, {max(timed):>5.0f}"
        )
        starts = dict(word_starts_ms(text))  # the library may skip or merge a word: compare where both agree
        begins = [m.start() for m in re.finditer(r"\S+", text)]
        for k in range(words - 1):
            if begins[k + 1] in starts:
                measured_ms = words_ends[k].sample * 1000 / audio.rate
                pause = text[words_ends[k].chars - 1] in ",.;:!?"
                (at_pauses if pause else offsets).append(measured_ms - starts[begins[k + 1]])
    for name, values in (("between words", offsets), ("at a punctuation pause", at_pauses)):
        values.sort()
        print(
            f"measured end of a word minus espeak-ng's start of the next, {name} ({len(values)}): "
            f"median {statistics.median(values):+.0f} ms, min {values[0]:+.0f} ms, max {values[-1]:+.0f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    asyncio.run(main(parser.parse_args().runs))
