"""A short chaos run inside the suite: three nodes behind the balancer, every fault kind at least once from a fixed
seed, the load of every role, then the checker. Any violation fails it, with the checker's table as the message.
``make chaos`` runs the long version."""

from __future__ import annotations

import os
from pathlib import Path

import asyncpg
import pytest

from .cluster import FAKETIME_LIB, admin_dsn
from .run import run

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.timeout(900)]

SEED = 7
FAULT_S = 40.0  # sizes the schedule: each node fault and each backing-service fault at least once
SESSIONS = 8
HAVE_FAKETIME = Path(FAKETIME_LIB).exists()


async def _require() -> None:
    """PostgreSQL and libfaketime are needed; without them the smoke is skipped, except under CI where it fails."""
    problem = None if HAVE_FAKETIME else f"libfaketime is not installed ({FAKETIME_LIB})"
    try:
        conn = await asyncpg.connect(admin_dsn(), timeout=3)
        await conn.close()
    except (OSError, asyncpg.PostgresError, TimeoutError) as err:
        problem = f"PostgreSQL is unreachable: {err!r}"
    if problem is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)


async def test_chaos_smoke_finds_no_violation(tmp_path: Path) -> None:
    await _require()
    outcome = await run(SEED, FAULT_S, tmp_path, SESSIONS)
    print(outcome.text)
    faults = outcome.figures["faults"]
    assert set(faults) >= {"kill", "pause", "drain", "skew", "rolling", "redis_freeze", "redis_hang", "pg_stall"}
    assert outcome.figures["sessions"] == SESSIONS, outcome.text
    assert not outcome.violations, outcome.text
