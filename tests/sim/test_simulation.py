"""Deterministic simulation of live sessions (see tests/sim/world.py for the oracles).

CI runs a bounded number of Hypothesis schedules, derandomized so a run is repeatable; ``make sim SEEDS=N`` runs the
seeded random driver for volume. What it found is pinned by scenario tests (tests/unit/test_tool_failure_paths.py,
tests/unit/test_session_failure_paths.py, tests/store, tests/api).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from .machine import SessionMachine
from .schedules import generate, run_schedule
from .workload import DEAF_SWALLOWS

CI_EXAMPLES = int(os.environ.get("SWITCHBOARD_SIM_EXAMPLES", "100"))
CI_SEEDS = int(os.environ.get("SWITCHBOARD_SIM_SEEDS", "250"))  # volume: `make sim`


def test_simulated_sessions_keep_every_invariant() -> None:
    machine = SessionMachine.TestCase
    machine.settings = settings(
        max_examples=CI_EXAMPLES,
        stateful_step_count=25,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    machine().runTest()


# ~20 s on a quiet machine, over 300 s in a full run at load 12 on two cores: the limit only detects a hang (a timeout
# raised in the middle of a schedule looks like a violation of it, or an exception swallowed by a weakref callback)
@pytest.mark.timeout(900)
def test_seeded_schedules_keep_every_invariant() -> None:
    failures = []
    for seed in range(CI_SEEDS):
        schedule = generate(seed)
        try:
            run_schedule(schedule.turns, schedule.ops, schedule.options)
        except Exception as err:  # collected: the report names every failing seed, not only the first
            failures.append(f"seed {seed}: {err}")
    assert not failures, f"{len(failures)} schedule(s) broke an invariant:\n" + "\n".join(failures[:20])


def test_a_session_still_working_past_the_settle_time_is_waited_for_not_reported() -> None:
    """Two tools that ignore cancellation, one per step of one reply, keep it busy for two virtual minutes: longer
    than the first settle. The oracles judge the session once that work is over, not while it is still under way."""
    deaf = {"ms": 0, "out": "plain", "swallow": DEAF_SWALLOWS}
    turns = [
        {"text": "t0 t1", "tool_calls": [{"name": "stubborn", "arguments": deaf}]},
        {"text": "t2 t3", "tool_calls": [{"name": "stubborn", "arguments": deaf}]},
        {"text": "t4 t5"},
    ]
    run_schedule(turns, [("input", "hello", True, True, False, True)])


def test_a_reply_interrupted_after_it_started_then_lost_to_a_crash_counts_as_answered() -> None:
    """The reply started (generation.started was published), an operator interrupted it, and the process died before
    that event was durable: the input was answered, and recovery ends the started reply as interrupted, by design."""
    turns = [{"text": "t0 t1 t2"}]
    ops = [("slow", 50), ("input", "hello", True, True, False, True), ("interrupt", False), ("crash",)]
    run_schedule(turns, ops)
