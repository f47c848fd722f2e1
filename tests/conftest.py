"""Shared fixtures: every test fails if it leaks or loses asyncio tasks (``tests.lost_tasks``) or fires the
forced-interrupt safety net."""

from __future__ import annotations

import asyncio

import pytest

from switchboard.runtime.speech import SpeechHandle

pytest_plugins = ("pytester", "tests.lost_tasks")


@pytest.fixture(autouse=True)
async def no_leaked_tasks():
    before = set(asyncio.all_tasks())
    forced_before = SpeechHandle.forced_cancels
    yield
    me = asyncio.current_task()
    leaked: list[asyncio.Task] = []
    for _ in range(50):
        leaked = [t for t in asyncio.all_tasks() - before if t is not me and not t.done()]
        if not leaked:
            break
        await asyncio.sleep(0.01)
    assert not leaked, f"leaked tasks: {[t.get_name() for t in leaked]}"
    assert SpeechHandle.forced_cancels == forced_before, "the forced-interrupt safety net fired"
