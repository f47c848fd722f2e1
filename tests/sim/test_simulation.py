"""Deterministic simulation of live sessions (see tests/sim/world.py for the oracles).

CI runs a bounded number of Hypothesis schedules, derandomized so a run is repeatable; ``make sim SEEDS=N`` runs the
seeded random driver for volume. What it found is pinned by scenario tests (tests/unit/test_tool_failure_paths.py,
tests/unit/test_session_failure_paths.py, tests/store, tests/api).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from .machine import SessionMachine
from .schedules import generate, run_schedule

CI_EXAMPLES = int(os.environ.get("SWITCHBOARD_SIM_EXAMPLES", "100"))
CI_SEEDS = int(os.environ.get("SWITCHBOARD_SIM_SEEDS", "500"))


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


def test_seeded_schedules_keep_every_invariant() -> None:
    failures = []
    for seed in range(CI_SEEDS):
        schedule = generate(seed)
        try:
            run_schedule(schedule.turns, schedule.ops, schedule.options)
        except Exception as err:  # collected: the report names every failing seed, not only the first
            failures.append(f"seed {seed}: {err}")
    assert not failures, f"{len(failures)} schedule(s) broke an invariant:\n" + "\n".join(failures[:20])
