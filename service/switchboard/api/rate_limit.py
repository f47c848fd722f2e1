"""Rate limits per credential: a token bucket for each caller and door (commands, reads).

Every write (``POST``, ``PUT``, ``PATCH``, ``DELETE``) by a credential takes one token from its command bucket, every
read (``GET``, ``HEAD`` on ``/v1``) one from its read bucket: two limiters, each built from this class with its own
rate. A bucket holds at most ``burst`` tokens and refills at ``rate_per_s``. An empty bucket answers 429
``rate_limited`` with ``Retry-After`` (whole seconds until a token is back). Streams have their own caps, exports
theirs too (``sessions.export_budget``). With auth off there is one caller, the operator, and nothing is limited.

A request another node forwarded here (``X-Switchboard-Forwarded``, checked by ``ForwardedGuard``) was charged where
it arrived and is not charged again. In cluster mode the buckets are the cluster's, in Redis (``SharedRateLimits``):
a caller spreading its requests over the nodes gets its limit once. When Redis does not answer in time a request is
charged to the node's own buckets (never let through uncounted), and Redis is tried again a moment later.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..control.cluster.shared_buckets import SharedBuckets, SharedBucketsUnavailable

logger = logging.getLogger("switchboard.api.rate_limit")

COMMAND_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
READ_METHODS = frozenset({"GET", "HEAD"})
SHARED_RETRY_S = 1.0  # after Redis failed to answer, the node's own buckets are used this long before trying again


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """Token buckets by the principal a credential spends for (``Principal.budget``): API keys, a token's minter
    included, so the table is as small as the key list. Commands and reads take one token each; a media edge's
    transcripts their characters (``media.budget``)."""

    def __init__(self, *, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    async def acquire(self, subject: str, *, cost: float = 1.0, burst: float | None = None) -> float | None:
        """``take``, as the cluster's limiter is called."""
        return self.take(subject, cost=cost, burst=burst)

    def take(self, subject: str, *, cost: float = 1.0, burst: float | None = None) -> float | None:
        """Spend ``cost`` tokens of ``subject``: None when allowed, else the seconds until they are back. ``burst``
        (at most the bucket's): spend only while the bucket holds more than its burst minus this, keeping the rest
        for other takes (``SharedBuckets.take`` alike)."""
        if not self.enabled:
            return None
        now = self._clock()
        bucket = self._buckets.get(subject)
        if bucket is None:
            bucket = self._buckets[subject] = _Bucket(float(self.burst), now)
        bucket.tokens = min(float(self.burst), bucket.tokens + max(0.0, now - bucket.at) * self.rate_per_s)
        bucket.at = now
        needed = cost + self.burst - (self.burst if burst is None else burst)
        if bucket.tokens >= needed:
            bucket.tokens -= cost
            return None
        return (needed - bucket.tokens) / self.rate_per_s

    @staticmethod
    def retry_after(wait_s: float) -> str:
        return str(max(1, math.ceil(wait_s)))


class SharedRateLimits(RateLimiter):
    """Cluster mode: the cluster's buckets in Redis, and this node's own (the base class) whenever Redis does not
    answer in time. ``on_fallback()`` counts each request charged locally for that reason."""

    def __init__(
        self,
        shared: SharedBuckets,
        *,
        door: str = "commands",
        on_fallback: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(rate_per_s=shared.rate_per_s, burst=shared.burst, clock=clock)
        self.shared = shared
        self.door = door  # what the buckets limit, for the log
        self.on_fallback = on_fallback
        self.shared_available = True
        self._retry_at = 0.0

    async def acquire(self, subject: str, *, cost: float = 1.0, burst: float | None = None) -> float | None:
        if not self.enabled:
            return None
        if self._clock() >= self._retry_at:
            try:
                wait_s = await self.shared.take(subject, cost=cost, burst=burst)
            except SharedBucketsUnavailable as err:
                if self.shared_available:
                    logger.warning(
                        "rate limits (%s): Redis unavailable (%s); each node limits on its own meanwhile",
                        self.door,
                        err,
                    )
                self.shared_available = False
                self._retry_at = self._clock() + SHARED_RETRY_S
            else:
                if not self.shared_available:
                    logger.info("rate limits (%s): Redis is back; limits are the cluster's again", self.door)
                self.shared_available = True
                return wait_s
        self.on_fallback()
        return self.take(subject, cost=cost, burst=burst)

    async def aclose(self) -> None:
        await self.shared.aclose()
