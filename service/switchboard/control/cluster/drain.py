"""Drain: what a cluster node does on SIGTERM before it stops serving HTTP, so that a rolling deploy interrupts no
call for more than a moment.

1. It takes no new session (the node reads ``draining``: placement sends new sessions elsewhere, and no node adopts
   its sessions while it still runs them).
2. It suspends each of its sessions as a shutdown does (what was heard committed, tools given their grace, every
   write durable) and lets go of it in the database.
3. It wakes the other nodes (through Redis; without it they look every ``LEASE_S / 2``), which adopt the sessions
   through the ordinary recovery path, and waits, bounded, until each one is owned again: meanwhile it keeps
   serving HTTP, so a command it receives for a session that moved is forwarded to the new owner.

Then the process stops as usual. A command for a session being handed over answers 503 ``session_moving``
(``Retry-After: 1``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..host import SessionHost

logger = logging.getLogger("switchboard.control.cluster.drain")

ADOPTION_POLL_S = 0.1


async def drain(host: SessionHost, *, wake: Callable[[], Awaitable[None]] | None, timeout_s: float) -> list[str]:
    """Hand every session of this node to the others (bounded by ``timeout_s``); returns those still not adopted
    when it gave up waiting (the others adopt them on their next round)."""
    lease = host.lease
    if lease is None or lease.deposed is not None:
        return []
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            await lease.start_draining()
            handed = await host.hand_off_all()
            if wake is not None:
                await wake()
            await _adopted(host, handed)
    except TimeoutError:
        waiting = await _unowned(host, list(lease.fence.lost))
        logger.warning("drain: gave up after %.1fs; %d session(s) not adopted yet", timeout_s, len(waiting))
        return waiting
    logger.info("drain: %d session(s) handed over in %.2fs", len(handed), time.monotonic() - started)
    return []


async def _adopted(host: SessionHost, sids: list[str]) -> None:
    """Until every one of ``sids`` is owned again (polled: the adopters tell nobody)."""
    waiting = sids
    while waiting:
        await asyncio.sleep(ADOPTION_POLL_S)
        waiting = await host.store.nodes.unowned(waiting)


async def _unowned(host: SessionHost, sids: list[str]) -> list[str]:
    try:
        return await host.store.nodes.unowned(sids)
    except Exception:  # the database is going away too: the lease passes and the others adopt them
        return sids
