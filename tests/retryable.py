"""The codes of the 503s docs/cluster.md ("Retryable answers") tells a client to retry, after ``Retry-After`` and on
any node: one list for every client of the tests (the cluster tests' load, the chaos load and its checker), checked
against the document (``tests/chaos/test_checker.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from tests.waiting import WAIT_S

RETRYABLE = frozenset(
    {
        "session_recovering",
        "session_moving",
        "session_moved",
        "node_draining",
        "idempotency_key_in_use",
        "database_unavailable",
        "unavailable",
        "deadline_exceeded",
    }
)


def retried_sync(request: Callable[[], httpx.Response]) -> httpx.Response:
    """``request()``'s answer, sent again after ``Retry-After`` while it is a 503 with one of these codes, as a client
    of the service does (a deadline passed on a loaded machine, say); within the shared ceiling. A command sent this way
    carries an ``Idempotency-Key``, so that a retry of one that went on in the background applies once."""
    deadline = time.monotonic() + WAIT_S
    while True:
        r = request()
        if r.status_code != 503 or r.json().get("code") not in RETRYABLE or time.monotonic() > deadline:
            return r
        time.sleep(min(1.0, float(r.headers.get("retry-after", "1"))))
