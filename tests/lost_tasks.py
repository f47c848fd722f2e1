"""A test fails when asyncio reports a task it lost: one destroyed while still pending, or one that failed with nobody
retrieving its exception. Either means a close, cancel or crash path left work behind (and hid how it ended).

asyncio reports both when the task is garbage-collected, through the loop's exception handler, which logs them on the
``asyncio`` logger: from whichever loop the task belonged to (the test's, a server thread's, a simulation's), at
whatever moment the collector gets to it. So every test ends with a collection, and what it brings up is the test's.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest

LOST_TASK_MESSAGES = ("Task was destroyed but it is pending", "exception was never retrieved")


class LostTasks(logging.Handler):
    """Keeps what asyncio logs about lost tasks (the task, where it was created under ``PYTHONASYNCIODEBUG=1``)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.reports: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(lost in message for lost in LOST_TASK_MESSAGES):
            error = record.exc_info[1] if record.exc_info else None
            self.reports.append(f"{message}\nexception: {error!r}" if error is not None else message)

    def take(self) -> list[str]:
        """Collect the garbage now, and return (and forget) what was reported since the last call."""
        gc.collect()
        reports, self.reports = self.reports, []
        return reports


LOST = LostTasks()
logging.getLogger("asyncio").addHandler(LOST)  # from the import on: a test that checks itself needs no plugin


def lost_tasks() -> list[str]:
    """What asyncio reported about lost tasks since the last check (each test is checked when it ends)."""
    return LOST.take()


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    # what the imports built lives for the whole run: out of the collector's way, a collection per test stays cheap
    gc.collect()
    gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)  # after the test's fixtures (its event loop among them) are torn down
    finally:
        lost = LOST.take()
        if lost:
            pytest.fail(
                f"{len(lost)} asyncio task(s) lost (set PYTHONASYNCIODEBUG=1 to see where each was created):\n"
                + "\n\n".join(lost),
                pytrace=False,
            )
