"""The wait between two attempts of an alert delivery: doubling from ``backoff_s``, capped at ``backoff_max_s``."""

from __future__ import annotations

from switchboard.control.alerts import RetryPolicy
from switchboard.control.alerts.dispatch import JITTER


def test_the_wait_doubles_and_is_capped() -> None:
    policy = RetryPolicy(max_attempts=20, backoff_s=1.0, backoff_max_s=60.0)
    for failed, base in ((1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (19, 60.0)):
        wait = policy.wait_s(failed)
        assert base <= wait <= base * (1 + JITTER), (failed, wait)
    total = sum(policy.wait_s(n) for n in range(1, policy.max_attempts))
    assert total <= 60.0 * (1 + JITTER) * policy.max_attempts  # bounded: a delivery ends in bounded time
