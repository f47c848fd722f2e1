"""Shared fixtures: every test fails if it leaks or loses asyncio tasks (``tests.lost_tasks``) or fires the
forced-interrupt safety net."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from switchboard.runtime.speech import SpeechHandle
from tests.waiting import until

pytest_plugins = ("pytester", "tests.lost_tasks", "tests.cpu_report")


@pytest.fixture(autouse=True)
async def no_leaked_tasks():
    before = set(asyncio.all_tasks())
    forced_before = SpeechHandle.forced_cancels
    yield
    me = asyncio.current_task()

    def leaked() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() - before if t is not me and not t.done()]

    # a task a test ended may take a few loop turns to finish, many on a loaded machine: wait for it to, and call it
    # leaked only when it is still running at the shared ceiling
    with contextlib.suppress(TimeoutError):
        await until(lambda: not leaked())
    assert not leaked(), f"leaked tasks: {[t.get_name() for t in leaked()]}"
    assert SpeechHandle.forced_cancels == forced_before, "the forced-interrupt safety net fired"
