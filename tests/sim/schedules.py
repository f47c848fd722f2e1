"""Random schedules from a seed, and running one: the same seed always replays the same schedule.

    python -m tests.sim.schedules --seeds 1000          # run seeds 0..999, print violations by class
    python -m tests.sim.schedules --seed 42 --verbose   # replay one schedule and print it as Python

Hypothesis drives the same world in ``test_simulation.py`` (and shrinks what it finds); this driver is for volume.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .vloop import Livelock, LostTask, Stalled, check_nothing_lost, close_loop, new_loop
from .workload import DEAF_SWALLOWS, OUTPUTS, TOOL_NAMES
from .world import TEXTS, Op, Violation, World

OUT_KEYS = (*OUTPUTS, "tool_error")
DURATIONS_MS = (0, 0, 30, 200, 800, 3000)


def random_call(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(TOOL_NAMES)
    args: dict[str, Any] = {"ms": rng.choice(DURATIONS_MS), "out": rng.choice(OUT_KEYS)}
    if name == "background":
        args["parallel"] = rng.choice((1, 1, 2, 3))
    elif name == "stubborn":
        args["swallow"] = rng.choice((0, 1, 2, DEAF_SWALLOWS))
    elif name == "timed":
        args["silent"] = rng.random() < 0.5
    elif name == "back":
        args = {}
    return {"name": name, "arguments": args}


def random_turns(rng: random.Random) -> list[dict[str, Any]]:
    turns = []
    for _ in range(rng.randint(4, 12)):
        words = rng.randint(0, 10)
        turns.append(
            {
                "text": " ".join(f"t{i}" for i in range(words)),
                "tool_calls": [random_call(rng) for _ in range(rng.choice((0, 0, 1, 1, 2)))],
                "ttft_ms": rng.choice((0, 0, 20, 150)),
                "word_ms": rng.choice((0, 0, 10, 60)),
            }
        )
    return turns


def random_command(rng: random.Random) -> Op:
    kind = rng.choices(
        ("input", "interim", "say", "interrupt", "cancel", "close", "turn"),
        weights=(10, 3, 3, 4, 3, 0.4, 3),
    )[0]
    if kind == "input":
        return ("input", rng.choice(tuple(TEXTS)), True, rng.random() < 0.8, rng.random() < 0.2, rng.random() < 0.9)
    if kind == "interim":
        return ("input", rng.choice(tuple(TEXTS)), False, True, False, True)
    if kind == "say":
        return ("say", rng.choice(tuple(TEXTS)), rng.random() < 0.7, rng.random() < 0.8)
    if kind == "interrupt":
        return ("interrupt", rng.random() < 0.3)
    if kind == "cancel":
        return ("cancel", rng.randint(0, 3))
    if kind == "turn":  # an interim transcript, then the same words final: a speculative reply is confirmed
        return ("turn", rng.choice(tuple(TEXTS)), rng.choice((0, 5, 30, 200)))
    return ("close",)


def random_op(rng: random.Random) -> Op:
    roll = rng.random()
    if roll < 0.45:
        return random_command(rng)
    if roll < 0.75:
        return ("advance", rng.choice((1, 5, 20, 50, 120, 400, 1500)))
    if roll < 0.83:
        return ("abort", random_command(rng), rng.choice((0, 1, 5, 30)))
    fault = rng.choice(("outage", "poison", "slow", "crash", "suspend", "exit", "recover-exit"))
    if fault == "outage":
        return ("outage", rng.choice((20, 200, 1500)))
    if fault == "exit":
        return ("exit", rng.choice((0, 0, 200, 8000)))
    if fault == "poison":
        return ("poison", 1)
    if fault == "slow":
        return ("slow", rng.choice((0, 5, 50)))
    return (fault,)


@dataclass
class Schedule:
    seed: int
    turns: list[dict[str, Any]]
    ops: list[Op]
    options: dict[str, Any]

    def as_python(self) -> str:
        ops = ",\n    ".join(repr(op) for op in self.ops)
        return f"TURNS = {self.turns!r}\nOPTIONS = {self.options!r}\nOPS = [\n    {ops},\n]"


def generate(seed: int) -> Schedule:
    rng = random.Random(seed)
    turns = random_turns(rng)
    ops = [random_op(rng) for _ in range(rng.randint(5, 30))]
    options = {"preemptive_generation": rng.random() < 0.3, "max_tool_steps": rng.choice((1, 3))}
    return Schedule(seed, turns, ops, options)


async def play(turns: list[dict[str, Any]], ops: list[Op], options: dict[str, Any], loop: Any) -> World:
    world = World(loop, turns, options=options)
    await world.start()
    try:
        for op in ops:
            await world.apply(op)
            world.check_step()
        await world.settle()
        world.check_step()
        world.check_end()
        await world.probe_answers()
    finally:
        await world.shutdown()
    world.check_calls_ended()
    return world


def run_schedule(turns: list[dict[str, Any]], ops: list[Op], options: dict[str, Any] | None = None) -> None:
    """Run one schedule on a fresh virtual-time loop; raises ``Violation`` (or ``Stalled``) when an oracle fails."""
    loop = new_loop()
    try:
        loop.run_until_complete(play(turns, ops, options or {}, loop))
    finally:
        close_loop(loop)
    check_nothing_lost(loop)


def classify(err: BaseException) -> str:
    if isinstance(err, Violation):
        return err.kind
    if isinstance(err, Stalled):
        return "liveness-stalled"
    if isinstance(err, Livelock):
        return "liveness-livelock"
    if isinstance(err, LostTask):
        return "lifecycle-lost-task"
    return f"crash-{type(err).__name__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="replay one seed")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    gc.freeze()  # the imports live for the whole run: each schedule's check for lost tasks collects only its own
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    kinds: Counter[str] = Counter()
    first: dict[str, int] = {}
    started = time.perf_counter()
    for seed in seeds:
        schedule = generate(seed)
        try:
            run_schedule(schedule.turns, schedule.ops, schedule.options)
        except Exception as err:
            kind = classify(err)
            kinds[kind] += 1
            first.setdefault(kind, seed)
            if args.verbose or args.seed is not None:
                print(f"seed {seed}: {err}", file=sys.stderr)
                print(schedule.as_python(), file=sys.stderr)
    elapsed = time.perf_counter() - started
    n = len(seeds)
    print(f"{n} schedules in {elapsed:.1f}s ({n / elapsed:.0f}/s); violations: {sum(kinds.values())}")
    for kind, count in kinds.most_common():
        print(f"  {kind}: {count} (first: seed {first[kind]})")
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
