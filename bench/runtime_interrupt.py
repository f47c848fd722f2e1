"""Runtime benchmark: interrupt latency with many concurrently speaking sessions (in process, in-memory ports).

Every session speaks a long preamble while a tool of the same reply waits for it with ``ctx.wait_for_playout()``.
Once every tool is waiting, each session is interrupted by operator input (``session.input(..., interrupt=True)``)
and two latencies are measured from the moment the interrupt call is made:

* ``unblock``: until ``wait_for_playout()`` raises ``SpeechInterrupted`` inside the tool;
* ``next speech``: until the ``speech.created`` event of the new input's reply is published.

Two ways of interrupting are measured, each over several rounds with fresh sessions:

* ``staggered`` (the budgeted figure): the interrupts are issued one after another, each awaited, while all the
  other sessions keep speaking; this is the latency one operator command sees on a loaded process;
* ``burst``: all interrupts are issued at the same instant (``asyncio.gather``); the last one waits behind all the
  others on the one event loop, so this shows throughput rather than per-command latency.

Run: ``.venv/bin/python bench/runtime_interrupt.py [--sessions 500] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

from switchboard import Agent, RunContext, SessionOptions, SpeechInterrupted, function_tool
from switchboard.runtime.events import Event, done_future
from switchboard.runtime.llm.scripted import ScriptedLLM, Turn
from switchboard.runtime.memory import MemoryStore
from switchboard.runtime.playout import SimulatedPlayout
from switchboard.runtime.session import AgentSession
from switchboard.runtime.speech import SpeechHandle

BUDGET_P99_MS = 5.0
PREAMBLE = " ".join(f"word{i}" for i in range(300))  # 100 s at 3 words per second: never finishes in a round


@dataclass
class Recorder:
    waiting: int = 0
    unblocked: dict[str, float] = field(default_factory=dict)  # session id -> perf_counter when the wait raised
    created: dict[str, float] = field(default_factory=dict)  # speech id -> perf_counter of speech.created


class TimingSink:
    """An EventSink that only timestamps ``speech.created`` (keeps nothing else)."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    def publish(self, event: Event) -> Awaitable[None]:
        if event.type == "speech.created":
            self.rec.created[event.data["speech_id"]] = time.perf_counter()
        return done_future()


class Preamble(Agent):
    def __init__(self, rec: Recorder) -> None:
        super().__init__(instructions="benchmark agent", name="bench")
        self.rec = rec

    @function_tool
    async def confirm(self, ctx: RunContext) -> str:
        """Confirm once the preamble was heard."""
        self.rec.waiting += 1
        try:
            await ctx.wait_for_playout()
        except SpeechInterrupted:
            self.rec.unblocked[ctx.session_id] = time.perf_counter()
            raise
        return "confirmed"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)  # nearest rank
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class RoundResult:
    unblock_ms: list[float]
    created_ms: list[float]

    def row(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, values in (("unblock", self.unblock_ms), ("created", self.created_ms)):
            out[f"{name}_p50"] = pct(values, 50)
            out[f"{name}_p99"] = pct(values, 99)
            out[f"{name}_max"] = max(values)
        return out


async def run_round(n: int, mode: str, round_no: int) -> RoundResult:
    rec = Recorder()
    store = MemoryStore()
    sink = TimingSink(rec)
    playout = SimulatedPlayout(3.0)
    sessions = [
        AgentSession(
            session_id=f"r{round_no}-{mode}-{i}",
            agent=Preamble(rec),
            llm=ScriptedLLM([Turn(text=PREAMBLE, tool_calls=[{"name": "confirm"}])], Turn(text="OK.")),
            playout=playout,
            store=store,
            events=sink,
            options=SessionOptions(),
        )
        for i in range(n)
    ]
    try:
        for s in sessions:
            await s.start()
        await asyncio.gather(*(s.input("please confirm") for s in sessions))
        async with asyncio.timeout(60):
            while rec.waiting < n:
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # every session is speaking and every tool is waiting
        gc.collect()

        started: dict[str, float] = {}
        new_speech: dict[str, str] = {}

        async def interrupt(s: AgentSession) -> None:
            started[s.id] = time.perf_counter()
            res = await s.input("stop, something else", interrupt=True)
            assert res.speech_id is not None
            new_speech[s.id] = res.speech_id

        if mode == "staggered":
            for s in sessions:
                await interrupt(s)
        else:
            await asyncio.gather(*(interrupt(s) for s in sessions))

        unblock = [(rec.unblocked[s.id] - started[s.id]) * 1000 for s in sessions]
        created = [(rec.created[new_speech[s.id]] - started[s.id]) * 1000 for s in sessions]
        return RoundResult(unblock, created)
    finally:
        await asyncio.gather(*(s.aclose() for s in sessions))


def fmt(v: float) -> str:
    return f"{v:7.3f}"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="staggered,burst")
    args = parser.parse_args()

    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}, {os.cpu_count()} cpus")
    print(f"{args.sessions} concurrent sessions, {args.rounds} rounds per mode; latencies in ms\n")
    forced_before = SpeechHandle.forced_cancels
    keys = ["unblock_p50", "unblock_p99", "unblock_max", "created_p50", "created_p99", "created_max"]
    medians: dict[str, dict[str, float]] = {}
    for mode in args.modes.split(","):
        print(f"[{mode}]  round | " + " | ".join(f"{k:>11}" for k in keys))
        rows = []
        for r in range(args.rounds):
            row = (await run_round(args.sessions, mode, r)).row()
            rows.append(row)
            print(f"{'':10}{r + 1:5} | " + " | ".join(f"{fmt(row[k]):>11}" for k in keys))
        medians[mode] = {k: statistics.median(row[k] for row in rows) for k in keys}
        print(f"{'':5}median | " + " | ".join(f"{fmt(medians[mode][k]):>11}" for k in keys) + "\n")

    forced = SpeechHandle.forced_cancels - forced_before
    print(f"forced-interrupt safety net fired: {forced} time(s)")
    ok = forced == 0
    if "staggered" in medians:
        m = medians["staggered"]
        within = m["unblock_p99"] <= BUDGET_P99_MS and m["created_p99"] <= BUDGET_P99_MS
        ok = ok and within
        print(
            f"budget (staggered, median of rounds): p99 <= {BUDGET_P99_MS} ms: "
            f"unblock {m['unblock_p99']:.3f} ms, next speech {m['created_p99']:.3f} ms -> "
            f"{'PASS' if within else 'FAIL'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
