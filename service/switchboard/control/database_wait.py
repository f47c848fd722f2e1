"""A start that overlaps a database outage: the node waits for its database instead of giving up.

Every step of a start that needs the database (the migration, the registration, the first recovery) is retried while
it fails because the database is unavailable (refused, reset, timed out, locked), for up to ``DATABASE_WAIT_S``
(default 30 s) from its first failure. A database still unavailable then is ``DatabaseUnavailable``, and the process
exits with its own status (4), told apart from another instance holding the database (3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from ..store import DATABASE_ERRORS, is_transient

logger = logging.getLogger("switchboard.control.start")

T = TypeVar("T")

RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0


class DatabaseUnavailable(Exception):
    """The database did not answer within ``DATABASE_WAIT_S`` of the start: the node does not start."""


class DatabaseWait:
    """How the steps of a start wait for their database: each for up to ``wait_s`` of it being unavailable."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.retries = 0
        self.gave_up: DatabaseUnavailable | None = None  # why the start was given up, for its exit status

    async def retry(self, what: str, step: Callable[[], Awaitable[T]]) -> T:
        """``step()``, again (with backoff, each failure logged) while it fails because the database is unavailable;
        ``DatabaseUnavailable`` once it has for ``wait_s``. Any other error is raised as it is."""
        delay_s = RETRY_MIN_S
        deadline: float | None = None
        while True:
            try:
                return await step()
            except DATABASE_ERRORS as err:
                if not is_transient(err):
                    raise
                # counted from this step's first failure: a long wait for another instance to stop spends none of it
                deadline = deadline if deadline is not None else time.monotonic() + self.wait_s
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    self.gave_up = DatabaseUnavailable(
                        f"the database is unavailable: {what} failed for {self.wait_s:g}s ({err!r}); "
                        "SWITCHBOARD_DATABASE_WAIT_S sets how long a start waits for it"
                    )
                    logger.error("not starting: %s", self.gave_up)
                    raise self.gave_up from err
                self.retries += 1
                logger.warning("%s: the database is unavailable (%r); retrying for %.0fs more", what, err, left_s)
                await asyncio.sleep(min(delay_s, left_s))
                delay_s = min(delay_s * 2, RETRY_MAX_S)
