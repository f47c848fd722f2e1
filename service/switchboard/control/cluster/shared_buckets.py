"""SharedBuckets: in cluster mode, the write rate limits of every node are one set of buckets, kept in Redis.

Each credential has one bucket for the whole cluster, held as a GCRA "theoretical arrival time" (``tat``): a bucket
of ``burst`` tokens refilled at ``rate_per_s`` is the same as a schedule where each command moves ``tat`` one
emission interval (``1 / rate_per_s``) later, and a command is allowed while ``tat`` stays within ``burst`` intervals
of now. One Lua script reads, decides and writes atomically, on Redis's own clock (the nodes' clocks never meet), and
sets the key to expire once the bucket would be full again: an idle credential leaves nothing behind.

The key is a digest of the credential's identity (itself never a secret: see ``api.auth.Principal.subject``) under a
prefix naming the database, so clusters sharing one Redis do not share buckets.

Redis decides nothing that matters for correctness here either: a call that fails or does not answer within
``timeout_s`` raises ``SharedBucketsUnavailable`` and the caller charges its node's own buckets instead. Nor can a
value written into a bucket by anyone else hold a caller back for long: a ``tat`` further ahead than ``burst``
intervals, which no command can set, counts as a bucket just emptied (one interval's wait), and a value that is not a
number as a full bucket.
"""

from __future__ import annotations

import asyncio
import hashlib

import redis.asyncio as aioredis
from sqlalchemy.engine import make_url

KEY_PREFIX = "switchboard:rate:"  # + the database + ":" + the digest of the credential
TIMEOUT_S = 0.05

# KEYS[1]: the bucket. ARGV: emission interval (s), burst for this take, now (s; empty: Redis's clock), cost (tokens;
# empty: 1), the bucket's own burst (empty: the burst for this take).
# Returns {1} when allowed, {0, wait_s} when not (as a string: Lua numbers come back truncated to integers).
GCRA_SCRIPT = """
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local cost = tonumber(ARGV[4]) or 1
local full = tonumber(ARGV[5]) or burst
if now == nil then
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil or tat < now then
    tat = now
elseif tat > now + full * interval then
    -- further ahead than any take could have put it (a take with a smaller burst than the bucket's may find it
    -- further than its own burst, and must leave it so): not ours (written by another hand, or under a bigger burst
    -- setting). Counted as a bucket just emptied, and written back so that it refills from here.
    tat = now + full * interval
    redis.call('SET', KEYS[1], string.format('%.6f', tat), 'PX', math.max(1, math.ceil(full * interval * 1000)))
end
local new_tat = tat + interval * cost
local allowed_at = new_tat - burst * interval
if allowed_at - now > 0.000001 then  -- the tat is kept to the microsecond: closer than that is on time
    return {0, string.format('%.6f', allowed_at - now)}
end
local ttl_ms = math.max(1, math.ceil((new_tat - now) * 1000))
redis.call('SET', KEYS[1], string.format('%.6f', new_tat), 'PX', ttl_ms)
return {1}
"""


# What a call to Redis that failed raises: redis-py's errors, the socket's, a deadline, and the RuntimeError uvloop
# raises when a closed transport is written to (a connection Redis reset). Any of them is Redis being unavailable.
REDIS_ERRORS: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, TimeoutError, RuntimeError)


class SharedBucketsUnavailable(Exception):
    """Redis did not answer in time (or at all): charge the node's own buckets."""


def key_prefix(database_url: str) -> str:
    """The prefix of this cluster's buckets: named after its database, as its event channel is."""
    db = make_url(database_url)
    return f"{KEY_PREFIX}{db.host}:{db.port or 5432}/{db.database}:"


class SharedBuckets:
    """Token buckets by credential, shared by every node through Redis (see the module docstring)."""

    def __init__(self, url: str, *, rate_per_s: float, burst: float, prefix: str, timeout_s: float = TIMEOUT_S) -> None:
        # a client of its own: short timeouts (the fan-out's subscriber connection waits for ever, by design)
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._script = self._redis.register_script(GCRA_SCRIPT)
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.prefix = prefix
        self.timeout_s = timeout_s

    def key(self, subject: str) -> str:
        return self.prefix + hashlib.sha256(subject.encode()).hexdigest()[:32]

    async def take(
        self, subject: str, *, now: float | None = None, cost: float = 1.0, burst: float | None = None
    ) -> float | None:
        """Spend ``cost`` tokens of ``subject``: None when allowed, else the seconds until they are back. ``now``:
        the time in seconds (default: Redis's clock); ``burst``: what the bucket may hold for this take (default the
        bucket's own: a smaller one keeps the rest for other takes). Raises ``SharedBucketsUnavailable``."""
        limit = self.burst if burst is None else burst
        args: list[str | float] = [
            1.0 / self.rate_per_s,
            limit,
            "" if now is None else repr(now),
            repr(cost),
            self.burst,
        ]
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await self._script(keys=[self.key(subject)], args=args)
        except REDIS_ERRORS as err:
            raise SharedBucketsUnavailable(repr(err)) from None
        if int(answer[0]) == 1:
            return None
        wait = answer[1]
        return float(wait.decode() if isinstance(wait, bytes) else wait)

    async def aclose(self) -> None:
        await self._redis.aclose()
