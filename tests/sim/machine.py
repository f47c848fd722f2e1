"""The simulation as a Hypothesis state machine: rules are commands and faults, the oracles run after every step,
and a failure shrinks to a minimal schedule that Hypothesis prints as the steps to paste into a regression test."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .schedules import DURATIONS_MS, OUT_KEYS
from .vloop import VirtualTimeLoop, check_nothing_lost, close_loop, new_loop
from .workload import DEAF_SWALLOWS, TOOL_NAMES
from .world import TEXTS, Op, World

texts = st.sampled_from(tuple(TEXTS))


@st.composite
def tool_calls(draw: st.DrawFn) -> dict[str, Any]:
    name = draw(st.sampled_from(TOOL_NAMES))
    args: dict[str, Any] = {"ms": draw(st.sampled_from(DURATIONS_MS)), "out": draw(st.sampled_from(OUT_KEYS))}
    if name == "background":
        args["parallel"] = draw(st.integers(1, 3))
    elif name == "stubborn":
        args["swallow"] = draw(st.sampled_from((0, 1, 2, DEAF_SWALLOWS)))
    elif name == "timed":
        args["silent"] = draw(st.booleans())
    elif name == "back":
        args = {}
    return {"name": name, "arguments": args}


turns = st.lists(
    st.fixed_dictionaries(
        {
            "text": st.integers(0, 10).map(lambda n: " ".join(f"t{i}" for i in range(n))),
            "tool_calls": st.lists(tool_calls(), max_size=2),
            "ttft_ms": st.sampled_from((0, 20, 150)),
            "word_ms": st.sampled_from((0, 10, 60)),
        }
    ),
    min_size=1,
    max_size=10,
)
commands = st.one_of(
    st.tuples(st.just("input"), texts, st.booleans(), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("say"), texts, st.booleans(), st.booleans()),
    st.tuples(st.just("interrupt"), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 3)),
    st.tuples(st.just("turn"), texts, st.sampled_from((0, 5, 30, 200))),
)


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop = new_loop()
        self.world: World | None = None

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @initialize(script=turns, preemptive=st.booleans(), max_tool_steps=st.sampled_from((1, 3)))
    def start(self, script: list[dict[str, Any]], preemptive: bool, max_tool_steps: int) -> None:
        options = {"preemptive_generation": preemptive, "max_tool_steps": max_tool_steps}
        self.world = World(self.loop, script, options=options)
        self.run(self.world.start())

    def apply(self, op: Op) -> None:
        assert self.world is not None
        self.run(self.world.apply(op))

    @rule(op=commands)
    def command(self, op: Op) -> None:
        self.apply(op)

    @rule(op=commands, after_ms=st.sampled_from((0, 1, 5, 30)))
    def cancelled_caller(self, op: Op, after_ms: int) -> None:
        self.apply(("abort", op, after_ms))

    @rule(ms=st.sampled_from((1, 5, 20, 50, 120, 400, 1500)))
    def advance(self, ms: int) -> None:
        self.apply(("advance", ms))

    @rule(ms=st.sampled_from((20, 200, 1500)))
    def outage(self, ms: int) -> None:
        self.apply(("outage", ms))

    @rule()
    def poison_next_write(self) -> None:
        self.apply(("poison", 1))

    @rule(ms=st.sampled_from((0, 5, 50)))
    def slow_store(self, ms: int) -> None:
        self.apply(("slow", ms))

    @precondition(lambda self: self.world is not None and not self.world.closed)
    @rule(kind=st.sampled_from(("crash", "suspend", "recover-exit", "close")))
    def lifecycle(self, kind: str) -> None:
        self.apply((kind,))

    @precondition(lambda self: self.world is not None and not self.world.closed)
    @rule(outage_ms=st.sampled_from((0, 200, 8000)))
    def exit_cut_short(self, outage_ms: int) -> None:
        self.apply(("exit", outage_ms))

    @invariant()
    def invariants_hold(self) -> None:
        if self.world is not None:
            self.world.check_step()

    def teardown(self) -> None:
        try:
            if self.world is not None:
                world = self.world

                async def finish() -> None:
                    try:
                        await world.settle()
                        world.check_step()
                        world.check_end()
                        await world.probe_answers()
                    finally:
                        await world.shutdown()
                    world.check_calls_ended()

                self.run(finish())
        finally:
            close_loop(self.loop)
        check_nothing_lost(self.loop)
