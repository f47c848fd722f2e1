"""Rate limits on commands, per credential: a token bucket for each API key.

Every write (``POST``, ``PUT``, ``PATCH``, ``DELETE``) by a credential takes one token from its bucket; a bucket holds
at most ``burst`` tokens and refills at ``rate_per_s``. An empty bucket answers 429 ``rate_limited`` with
``Retry-After`` (whole seconds until a token is back). Reads and streams are not counted here (streams have their own
caps). With auth off there is one caller, the operator, and nothing is limited.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

COMMAND_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class WriteRateLimiter:
    """Token buckets by credential subject. The subjects are API keys (session tokens cannot write), so the table is
    as small as the key list."""

    def __init__(self, *, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def take(self, subject: str) -> float | None:
        """Spend one token of ``subject``: None when allowed, else the seconds until a token is back."""
        if not self.enabled:
            return None
        now = self._clock()
        bucket = self._buckets.get(subject)
        if bucket is None:
            bucket = self._buckets[subject] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + max(0.0, now - bucket.at) * self.rate_per_s)
        bucket.at = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / self.rate_per_s

    @staticmethod
    def retry_after(wait_s: float) -> str:
        return str(max(1, math.ceil(wait_s)))
