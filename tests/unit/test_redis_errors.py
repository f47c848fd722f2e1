"""Redis decides nothing: a call to it that fails in any way (here the RuntimeError uvloop raises when a connection
Redis reset is written to, seen in a chaos run as a 500 on a command) makes the rate limits each node's own for a
moment, never an error for the caller."""

from __future__ import annotations

from typing import Any

from switchboard.api.rate_limit import SharedRateLimits
from switchboard.control.cluster.shared_buckets import SharedBuckets


async def test_a_command_is_limited_by_the_nodes_own_bucket_when_the_call_to_redis_breaks() -> None:
    shared = SharedBuckets("redis://127.0.0.1:1/0", rate_per_s=1.0, burst=2, prefix="t:")

    async def broken(**_: Any) -> Any:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    shared._script = broken  # type: ignore[method-assign,assignment]
    fallbacks: list[int] = []
    limits = SharedRateLimits(shared, on_fallback=lambda: fallbacks.append(1))
    try:
        assert await limits.acquire("key:a") is None
        assert await limits.acquire("key:a") is None
        assert await limits.acquire("key:a") is not None  # the node's own bucket of 2 is spent
        assert not limits.shared_available and len(fallbacks) == 3
    finally:
        await limits.aclose()
