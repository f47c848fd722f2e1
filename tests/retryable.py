"""The codes of the 503s docs/cluster.md ("Retryable answers") tells a client to retry, after ``Retry-After`` and on
any node: one list for every client of the tests (the cluster tests' load, the chaos load and its checker), checked
against the document (``tests/chaos/test_checker.py``)."""

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
