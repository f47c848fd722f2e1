"""Random cluster schedules from a seed, and running one: the same seed always replays the same schedule.

python -m tests.sim.cluster --seeds 200                    # seeds 0..199, violations by class
python -m tests.sim.cluster --seeds 200 --before db_clock  # the same with one fix switched off
python -m tests.sim.cluster --seed 42 --verbose            # replay one schedule and print it
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from switchboard.api.media import routes as media_routes
from switchboard.control.cluster import ownership
from switchboard.control.cluster.ownership import NodeLease
from switchboard.runtime import recovery
from switchboard.runtime.chat import validate
from switchboard.runtime.llm.scripted import ScriptedLLM
from switchboard.runtime.ports import Completion
from switchboard.runtime.session import AgentSession
from switchboard.runtime.speech import SpeechHandle

from ..schedules import classify, random_turns
from ..vloop import check_nothing_lost, close_loop
from .edges import cuts_noted
from .links import relayed_in_simulation
from .loop import ClusterLoop
from .world import ClusterWorld, Fixes, Op

FIXES = (
    "db_clock",
    "write_time_epochs",
    "receipts_with_effect",
    "hand_over",
    "resume_calls",
    "fenced_reports",
    "live_when_moving",
    "leased_claims",
    "transcript_ids",
    "edge_connections",
)


def media_op(rng: random.Random, edges: list[int], calm: set[int]) -> Op:
    """What a session's media edge does: a barge-in, a final transcript, an interim one, or a final transcript and its
    connection dropped a moment later (the transcript, or its answer, may be lost on the way). A calm session's edge
    (no client interrupts it, and an edge that leaves mid-speech does) only plays, and sends interim transcripts."""
    s = rng.choice(edges)
    if s in calm:
        return ("transcript", s, False)
    kind = rng.choices(("barge-in", "final", "interim", "drop"), weights=(3, 5, 2, 2))[0]
    if kind == "drop":
        return ("edge-drop", s, rng.choice((0, 1, 2, 5, 10, 20, 40)))
    return ("barge-in", s) if kind == "barge-in" else ("transcript", s, kind == "final")


def random_op(rng: random.Random, sessions: int, calm: set[int], edges: list[int] | None = None) -> Op:
    if edges and rng.random() < 0.25:
        return media_op(rng, edges, calm)
    roll = rng.random()
    s, n = rng.randrange(sessions), rng.randrange(4)
    if roll < 0.40:
        kind = rng.choices(("input", "say", "interrupt"), weights=(10, 3, 3))[0]
        if kind == "interrupt":
            return ("input", s, n, False) if s in calm else ("interrupt", s, n)
        if kind == "say":
            return ("say", s, n)
        return ("input", s, n, s not in calm and rng.random() < 0.5)
    if roll < 0.70:
        return ("advance", rng.choice((1, 5, 20, 50, 200, 500, 1500, 3000)))
    fault = rng.choice(
        (
            "pause",
            "pause",
            "kill",
            "crash-owner",
            "crash-owner",
            "restart",
            "drain",
            "rolling",
            "db-latency",
            "db-stall",
            "db-partition",
            "db-reset",
            "db-reset",
            "redis-down",
            "redis-cut",
            "skew",
        )
    )
    if fault == "pause":
        return ("pause", n, rng.choice((300, 1000, 2500, 6000)))
    if fault == "crash-owner":
        return ("crash-owner", s, rng.choice((1, 10, 25, 45, 60)))
    if fault in ("kill", "restart"):
        return (fault, n)
    if fault == "drain":
        return ("drain", n, rng.random() < 0.7)
    if fault == "db-latency":
        return ("db-latency", rng.choice((0, 1, 5, 20)))
    if fault == "db-stall":
        return ("db-stall", rng.choice((100, 1000, 4000)))
    if fault == "db-partition":
        return ("db-partition", n, rng.choice((500, 2000, 8000)))
    if fault == "db-reset":
        return ("db-reset", rng.choice((None, n)), rng.random() < 0.5)
    if fault == "redis-down":
        return ("redis-down", rng.choice((1000, 10000)))
    if fault == "redis-cut":
        return ("redis-cut", n, rng.choice((1000, 10000)))
    if fault == "skew":
        return ("skew", n, rng.choice((-5000, -2500, -400, 0, 400, 2500, 5000)))
    return (fault,)


@dataclass
class Schedule:
    seed: int
    nodes: int
    sessions: list[dict[str, Any]]
    ops: list[Op]
    fixes: Fixes = field(default_factory=Fixes)

    def as_python(self) -> str:
        ops = ",\n    ".join(repr(op) for op in self.ops)
        return f"NODES = {self.nodes}\nSESSIONS = {self.sessions!r}\nOPS = [\n    {ops},\n]"


def generate(seed: int, fixes: Fixes | None = None) -> Schedule:
    rng = random.Random(seed)
    nodes = rng.choice((2, 2, 3, 4))
    sessions = []
    for _ in range(rng.randint(1, 3)):
        turns = random_turns(rng)
        for turn in turns:
            if rng.random() < 0.25:  # a webhook tool, whose backend reports to any node
                turn["tool_calls"].append({"name": "ticket", "arguments": {"ms": rng.choice((0, 200, 1500, 5000))}})
        sessions.append(
            {
                "llm": {"provider": "scripted", "turns": turns},
                "max_tool_steps": rng.choice((1, 3)),
                "preemptive_generation": rng.random() < 0.3,
            }
        )
    calm = {i for i in range(len(sessions)) if i % 2 == 0}
    ops: list[Op] = [("db-latency", rng.choice((0, 1, 5, 20)))]
    edges = [i for i in range(len(sessions)) if rng.random() < 0.6]  # sessions with a media edge
    ops += [("edge", i, rng.randrange(4)) for i in edges]
    ops += [random_op(rng, len(sessions), calm, edges) for _ in range(rng.randint(5, 25))]
    return Schedule(seed, nodes, sessions, ops, fixes or Fixes())


@contextlib.contextmanager
def simulated(world_of: list[ClusterWorld], loop: ClusterLoop, fixes: Fixes) -> Iterator[None]:
    """What the simulation replaces around the product for one run: the lease's monotonic clock is the virtual one,
    and every context the model receives is checked (I2), and each forced cancel is shown to the world before it
    counts (``ClusterWorld.frozen_net``). Without the hand-over fix, a move interrupts the speeches and recovery owes
    none (the behaviour before it). Without the fenced-reports fix, a report applied to a stale copy
    is answered as if it landed: the call's refused end is not seen by the report (``tool_call_end_error``), nor the
    refused answer by the idempotency key (``Completion.mark_refused``), so it is answered from the store. Without the
    live-when-moving fix, what a session writes of itself during its hand-over (a handoff done at once) stores the
    state it has here, ``suspended``. Without the leased-claims fix, a claim lands whatever its node's lease (the
    database's side, in ``database.py``) and the node acts on its answer however late it came. For the media edges:
    the media route's clock (its frame budget too) is the virtual one, the routing seam relays an edge over the
    simulated network (``links.relay``), every speech a leaving edge cut is noted for the oracles; without the
    transcript-ids fix the edges send no ``id`` (``edges.py``)."""
    real_time = ownership.time
    real_stream = ScriptedLLM.stream

    class _Clock:
        @staticmethod
        def monotonic() -> float:
            return loop.time()

        perf_counter = monotonic

    def checked(self: ScriptedLLM, request: Any) -> Any:
        problems = validate(request.items)
        if problems and world_of:
            world_of[0].broken_contexts.append(str(problems))
        return real_stream(self, request)

    real_force = SpeechHandle._force_cancel

    def force_cancel(self: SpeechHandle) -> None:
        watchdog = self._watchdog
        if world_of and watchdog is not None and not (self.done or self._task is None or self._task.done()):
            world_of[0].frozen_net(self, watchdog.when())
        real_force(self)

    SpeechHandle._force_cancel = force_cancel  # type: ignore[method-assign]

    class _Bucket(media_routes._Bucket):  # a media edge's frame budget, refilled on the virtual clock
        def __post_init__(self) -> None:
            super().__post_init__()
            self.at = loop.time()

    real_media_time, real_bucket = media_routes.time, media_routes._Bucket
    media_routes.time = _Clock  # type: ignore[assignment]
    media_routes._Bucket = _Bucket  # type: ignore[misc]
    ownership.time = _Clock  # type: ignore[assignment]
    ScriptedLLM.stream = checked  # type: ignore[method-assign]
    real_hand_over, real_owed = SpeechHandle.hand_over, recovery.owed_speeches
    if not fixes.hand_over:  # before the fix: a move is an interruption, and the next owner owes nothing
        SpeechHandle.hand_over = lambda self: not self.done and self.interrupt(force=True)  # type: ignore[method-assign]
        recovery.owed_speeches = lambda unfinished: []
    real_snapshot = AgentSession.snapshot
    if not fixes.live_when_moving:  # before the fix: the snapshot holds the session's own state, `suspended` included
        AgentSession.snapshot = lambda self: real_snapshot(self).model_copy(update={"state": self.state})  # type: ignore[method-assign]
    real_too_late = NodeLease._claimed_too_late
    if not fixes.leased_claims:  # before the fix: a claim's answer is acted on however late it came
        NodeLease._claimed_too_late = lambda self: False  # type: ignore[method-assign]
    real_end_error, real_refused = AgentSession.tool_call_end_error, Completion.mark_refused
    if not fixes.fenced_reports:  # before the fix: a report never hears that the fence refused what it decided
        AgentSession.tool_call_end_error = lambda self, call_id: None  # type: ignore[method-assign]
        Completion.mark_refused = lambda self, err: None  # type: ignore[method-assign]
    try:
        with relayed_in_simulation(), cuts_noted(world_of):
            yield
    finally:
        media_routes.time, media_routes._Bucket = real_media_time, real_bucket  # type: ignore[misc]
        ownership.time = real_time
        SpeechHandle._force_cancel = real_force  # type: ignore[method-assign]
        ScriptedLLM.stream = real_stream  # type: ignore[method-assign]
        SpeechHandle.hand_over, recovery.owed_speeches = real_hand_over, real_owed  # type: ignore[method-assign]
        AgentSession.snapshot = real_snapshot  # type: ignore[method-assign]
        AgentSession.tool_call_end_error = real_end_error  # type: ignore[method-assign]
        Completion.mark_refused = real_refused  # type: ignore[method-assign]
        NodeLease._claimed_too_late = real_too_late  # type: ignore[method-assign]


async def play(schedule: Schedule, loop: ClusterLoop, out: list[ClusterWorld]) -> ClusterWorld:
    world = ClusterWorld(
        loop, nodes=schedule.nodes, sessions=schedule.sessions, seed=schedule.seed, fixes=schedule.fixes
    )
    out.append(world)
    try:
        await world.start()
        for op in schedule.ops:
            await world.apply(op)
            world.check_step()
        await world.settle()
        world.check_step()
        world.check_end()
        await world.probe()
        world.check_step()
    finally:
        await world.shutdown()
    return world


def run_schedule(schedule: Schedule, worlds: list[ClusterWorld] | None = None) -> None:
    """Run one schedule on a fresh loop; raises ``Violation`` (or ``Stalled``...) when an oracle fails. ``worlds``
    gets the world, to look at it after a failure (then what it still holds is not checked for lost tasks)."""
    loop = ClusterLoop()
    asyncio.set_event_loop(loop)
    kept: list[ClusterWorld] = [] if worlds is None else worlds
    try:
        with simulated(kept, loop, schedule.fixes):
            loop.run_until_complete(play(schedule, loop, kept))
    finally:
        close_loop(loop)
        if worlds is None:
            kept.clear()  # the nodes' objects go: a task or future lost by them is reported now, not later
    check_nothing_lost(loop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="replay one seed")
    parser.add_argument("--before", choices=FIXES, default=None, help="switch this fix off")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    gc.freeze()
    fixes = Fixes.without(args.before) if args.before else Fixes()
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    kinds: Counter[str] = Counter()
    first: dict[str, int] = {}
    started = time.perf_counter()
    for seed in seeds:
        schedule = generate(seed, fixes)
        try:
            run_schedule(schedule)
        except Exception as err:
            kind = getattr(err, "kind", None) or classify(err)
            kinds[kind] += 1
            first.setdefault(kind, seed)
            if args.verbose or args.seed is not None:
                print(f"seed {seed}: {err}", file=sys.stderr)
                print(schedule.as_python(), file=sys.stderr)
    elapsed = time.perf_counter() - started
    n = len(seeds)
    mode = f"before ({args.before} off)" if args.before else "after"
    print(f"{n} schedules {mode} in {elapsed:.1f}s ({n / elapsed:.1f}/s); violations: {sum(kinds.values())}")
    for kind, count in kinds.most_common():
        print(f"  {kind}: {count} (first: seed {first[kind]})")
    return 1 if kinds else 0
