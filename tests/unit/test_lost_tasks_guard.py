"""The suite's guard against lost asyncio tasks (``tests.lost_tasks``) fails the test that loses one."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LOSING_TESTS = """
import asyncio
import gc


async def test_fails_a_task_nobody_awaits():
    async def fail():
        raise RuntimeError("nobody looks at this")

    asyncio.ensure_future(fail())
    await asyncio.sleep(0.01)


async def test_drops_a_task_that_waits_on_what_nobody_holds():
    async def wait_forever():
        await asyncio.get_running_loop().create_future()

    asyncio.ensure_future(wait_forever())
    await asyncio.sleep(0.01)
    gc.collect()


async def test_awaits_what_it_starts():
    async def work():
        return 1

    assert await asyncio.create_task(work()) == 1
"""


def test_a_test_that_loses_a_task_fails_and_says_which(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_losing=LOSING_TESTS)
    result = pytester.runpytest_subprocess("-p", "tests.lost_tasks", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=2)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_fails_a_task_nobody_awaits*",
            "*1 asyncio task(s) lost*",
            "Task exception was never retrieved",
            "*RuntimeError('nobody looks at this')*",
            "*ERROR at teardown of test_drops_a_task_that_waits_on_what_nobody_holds*",
            "Task was destroyed but it is pending!",
        ]
    )
