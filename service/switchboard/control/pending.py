"""PendingCreates: the session creates under way on this node, by id.

Creates run concurrently (their rows share the store's group commits); what used to serialize them all behind one
lock is now kept per id: a second create of an id waits for the first one's outcome, and the creates under way count
toward the node's limits (``max_sessions``, a key's quota) as if their sessions were live already.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager


class PendingCreates:
    def __init__(self) -> None:
        self._by_id: dict[str, tuple[str | None, asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def of_owner(self, owner: str) -> int:
        """How many of the creates under way are ``owner``'s."""
        return sum(1 for holder, _ in self._by_id.values() if holder == owner)

    async def wait(self, sid: str) -> None:
        """Until no create of ``sid`` is under way. Whoever goes on without awaiting anything in between finds the
        outcome of the one before (its session live, or its row stored, or nothing)."""
        while (found := self._by_id.get(sid)) is not None:
            await asyncio.shield(found[1])

    @contextmanager
    def hold(self, sid: str, owner: str | None) -> Iterator[None]:
        """``sid`` is being created (for ``owner``) until the block ends, whatever ends it. The caller has waited for
        any create of ``sid`` before (``wait``) without awaiting since."""
        assert sid not in self._by_id, sid
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._by_id[sid] = (owner, done)
        try:
            yield
        finally:
            del self._by_id[sid]
            done.set_result(None)
