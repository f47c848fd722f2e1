"""The cluster's rate-limit buckets: the GCRA script against a real Redis, on an explicit clock (seconds), each test
under a key prefix of its own."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from switchboard.api.rate_limit import SHARED_RETRY_S, RateLimiter, SharedRateLimits
from switchboard.control.cluster.shared_buckets import SharedBuckets, SharedBucketsUnavailable, key_prefix
from tests.e2e.cluster_support import RedisServer

REDIS_URL = "redis://127.0.0.1:6379/0"
T0 = 1_800_000_000.0  # an epoch-sized clock: the script keeps microseconds at this size


async def _reachable() -> bool:
    client = aioredis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        return bool(await client.ping())
    except (aioredis.RedisError, OSError):
        return False
    finally:
        await client.aclose()


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    if not await _reachable():
        pytest.skip("Redis at 127.0.0.1:6379 is unreachable")
    name = f"test:rate:{uuid.uuid4().hex}:"
    yield name
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{name}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.fixture
async def buckets(prefix: str) -> AsyncIterator[SharedBuckets]:
    shared = SharedBuckets(REDIS_URL, rate_per_s=2.0, burst=4, prefix=prefix, timeout_s=1.0)
    yield shared
    await shared.aclose()


async def test_a_full_bucket_allows_its_burst_then_says_when_a_token_is_back(buckets: SharedBuckets):
    assert [await buckets.take("key:a", now=T0) for _ in range(4)] == [None] * 4
    assert await buckets.take("key:a", now=T0) == pytest.approx(0.5)  # one token at 2/s
    assert await buckets.take("key:a", now=T0 + 0.2) == pytest.approx(0.3)
    assert RateLimiter.retry_after(0.3) == "1"
    # another credential has a bucket of its own
    assert await buckets.take("key:b", now=T0) is None


async def test_a_bucket_written_by_another_hand_holds_its_caller_back_one_interval_at_most(buckets: SharedBuckets):
    """Whoever can write Redis could put every bucket far in the future (a key set without expiry), and every command
    of every caller was then refused for as long: now a bucket no command could have set counts as just emptied."""
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        await client.set(buckets.key("key:a"), f"{T0 + 1e9:.6f}")  # no expiry
        await client.set(buckets.key("key:b"), "not a number")
    finally:
        await client.aclose()
    assert await buckets.take("key:a", now=T0) == pytest.approx(0.5)  # one interval at 2/s, not a billion seconds
    assert await buckets.take("key:a", now=T0 + 0.5) is None
    assert await buckets.take("key:b", now=T0) is None  # unreadable: a full bucket


async def test_a_take_with_a_smaller_burst_never_refunds_what_the_whole_bucket_spent(buckets: SharedBuckets):
    """A take with a smaller burst (a media edge's interim transcripts: half the bucket) found the bucket spent past
    its own burst by takes of the whole one (final transcripts) and took that for a forged value: it clamped the
    bucket back to its own burst, giving back what had been spent, and finals then took ~50 times their budget."""
    assert await buckets.take("key:m", now=T0, cost=4) is None  # the whole bucket (burst 4), spent at once
    assert await buckets.take("key:m", now=T0, cost=1, burst=2) is not None  # an interim: refused
    assert await buckets.take("key:m", now=T0, cost=4) == pytest.approx(2.0)  # still empty: 4 tokens at 2/s


async def test_refused_commands_spend_nothing_and_the_bucket_refills_at_its_rate(buckets: SharedBuckets):
    for _ in range(4):
        assert await buckets.take("key:a", now=T0) is None
    for _ in range(10):  # refusals do not push the next token further away
        assert await buckets.take("key:a", now=T0) == pytest.approx(0.5)
    assert await buckets.take("key:a", now=T0 + 0.5) is None
    assert await buckets.take("key:a", now=T0 + 0.5) == pytest.approx(0.5)
    # 1.5 s later: three tokens back, not more
    assert [await buckets.take("key:a", now=T0 + 2.0) for _ in range(3)] == [None] * 3
    assert await buckets.take("key:a", now=T0 + 2.0) == pytest.approx(0.5)
    # idle long enough to be full again: the burst, and no more than the burst
    later = T0 + 100.0
    assert [await buckets.take("key:a", now=later) for _ in range(4)] == [None] * 4
    assert await buckets.take("key:a", now=later) == pytest.approx(0.5)


async def test_the_bucket_matches_a_node_s_own_buckets_step_by_step(buckets: SharedBuckets):
    now = [T0]
    local = RateLimiter(rate_per_s=2.0, burst=4, clock=lambda: now[0])
    for step in (0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.3, 0.05, 0.7, 0.0, 0.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0):
        now[0] += step
        shared, own = await buckets.take("key:a", now=now[0]), local.take("key:a")
        assert (shared is None) == (own is None), (now[0] - T0, shared, own)
        if own is not None:
            assert shared == pytest.approx(own, abs=1e-5)


async def test_the_key_is_a_digest_that_vanishes_once_the_bucket_is_full_again(buckets: SharedBuckets, prefix: str):
    subject = "key:0123456789abcdef01234567"
    await buckets.take(subject)  # Redis's own clock
    await buckets.take(subject)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key.decode() async for key in client.scan_iter(match=f"{prefix}*")]
        assert keys == [buckets.key(subject)] and subject not in keys[0]
        # two tokens spent at 2/s: full again within 1 s, and the key goes then
        ttl_ms = await client.pttl(keys[0])
        assert 0 < ttl_ms <= 1000
    finally:
        await client.aclose()


async def test_an_unreachable_redis_is_reported_within_the_timeout(prefix: str):
    shared = SharedBuckets("redis://127.0.0.1:1/0", rate_per_s=2.0, burst=4, prefix=prefix, timeout_s=0.05)
    try:
        with pytest.raises(SharedBucketsUnavailable):
            await shared.take("key:a")
    finally:
        await shared.aclose()


def test_clusters_sharing_a_redis_have_buckets_of_their_own():
    one = key_prefix("postgresql+asyncpg://u@db:5432/one")
    assert one == "switchboard:rate:db:5432/one:"
    assert one != key_prefix("postgresql+asyncpg://u@db:5432/two")


async def test_a_node_limits_on_its_own_while_redis_is_away_and_shares_again_once_it_is_back(tmp_path: Path):
    """Never open: with Redis gone the node's own buckets apply (counted), and Redis is asked again a moment later."""
    server = RedisServer(tmp_path)
    server.start()
    now = [0.0]
    fallbacks: list[None] = []
    shared = SharedBuckets(server.url, rate_per_s=0.01, burst=2, prefix="test:rate:", timeout_s=1.0)
    limits = SharedRateLimits(shared, on_fallback=lambda: fallbacks.append(None), clock=lambda: now[0])
    try:
        assert [await limits.acquire("key:a") for _ in range(2)] == [None, None]
        assert await limits.acquire("key:a") == pytest.approx(100.0, abs=0.1)
        assert fallbacks == [] and limits.shared_available

        server.stop()
        assert [await limits.acquire("key:a") for _ in range(2)] == [None, None]  # this node's own bucket
        assert await limits.acquire("key:a") == pytest.approx(100.0)
        assert len(fallbacks) == 3 and not limits.shared_available

        server.start()  # empty: a fresh bucket in Redis
        assert await limits.acquire("key:b") is None
        assert len(fallbacks) == 4  # not asked again yet
        now[0] += SHARED_RETRY_S
        assert await limits.acquire("key:b") is None
        assert len(fallbacks) == 4 and limits.shared_available
    finally:
        await limits.aclose()
        server.stop()


async def test_a_take_may_cost_several_tokens_and_keep_part_of_the_bucket_for_others(buckets: SharedBuckets):
    """A media transcript costs its characters, and interim ones spend only the first half of the bucket: the same
    arithmetic in Redis as in a node's own buckets (what a node falls back to)."""
    local = RateLimiter(rate_per_s=2.0, burst=4, clock=lambda: 0.0)
    for take, now in ((buckets.take, {"now": T0}), (_local(local), {})):
        assert await take("key:m", cost=1.5, burst=2, **now) is None  # 2.5 left: above half, the interim takes
        assert await take("key:m", cost=1.0, burst=2, **now) == pytest.approx(0.25)  # it would dig into the other half
        assert await take("key:m", cost=2.5, **now) is None  # a take of the whole bucket still has it
        assert await take("key:m", cost=1.0, **now) == pytest.approx(0.5)


def _local(limits: RateLimiter) -> Any:
    async def take(subject: str, **kw: Any) -> float | None:
        return limits.take(subject, **kw)

    return take
