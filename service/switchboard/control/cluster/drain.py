"""Drain: what a cluster node does on SIGTERM before it stops serving HTTP, so that a rolling deploy interrupts no
call for more than a moment.

1. It takes no new session (the node reads ``draining``: placement sends new sessions elsewhere, and no node adopts
   its sessions while it still runs them).
2. It suspends each of its sessions as a shutdown does (what was heard committed, tools given their grace, every
   write durable) and lets go of it in the database.
3. It wakes the other nodes (through Redis; without it they look every ``LEASE_S / 2``), which adopt the sessions
   through the ordinary recovery path, and waits, bounded, until each one is owned again: meanwhile it keeps
   serving HTTP, so a command it receives for a session that moved is forwarded to the new owner. With no other
   live node (the last one of a cluster stopping, or every other restarting at once) nobody can adopt them: it
   stops waiting, and they wait, durable, for the next node that starts.

Then the process stops as usual. A command for a session being handed over answers 503 ``session_moving``
(``Retry-After: 1``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ...store import DATABASE_ERRORS, NodeState
from ..host import SessionHost

logger = logging.getLogger("switchboard.control.cluster.drain")

ADOPTION_POLL_S = 0.1
RECORD_RETRY_S = 0.2
ADOPTERS_POLL_S = 1.0  # how often a drain looks whether any node is left to adopt its sessions


async def drain(host: SessionHost, *, wake: Callable[[], Awaitable[None]] | None, timeout_s: float) -> list[str]:
    """Hand every session of this node to the others (bounded by ``timeout_s``); returns those still not adopted
    when it gave up waiting (the others adopt them on their next round) or found no other live node (the next node
    to start adopts them)."""
    lease = host.lease
    if lease is None or lease.deposed is not None:
        return []
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            await _until_recorded(lease.start_draining)
            handed = await host.hand_off_all()
            if wake is not None:
                await wake()
            waiting = await _adopted(host, handed, lease.node_id)
    except TimeoutError:
        waiting = await _unowned(host, list(lease.fence.lost))
        logger.warning("drain: gave up after %.1fs; %d session(s) not adopted yet", timeout_s, len(waiting))
        return waiting
    logger.info("drain: %d session(s) handed over in %.2fs", len(handed) - len(waiting), time.monotonic() - started)
    return waiting


async def _until_recorded(start_draining: Callable[[], Awaitable[None]]) -> None:
    """Record the drain, again while the database answers with a transient error (a reset connection, a stall past
    its timeout): a drain given up at its first step stops the node without handing anything over, and its sessions
    wait out its lease (bounded by the drain's own timeout)."""
    while True:
        try:
            await start_draining()
            return
        except DATABASE_ERRORS as err:
            logger.warning("drain: could not record the drain (%r); trying again", err)
            await asyncio.sleep(RECORD_RETRY_S)


async def _adopted(host: SessionHost, sids: list[str], me: str) -> list[str]:
    """Until every one of ``sids`` is owned again (polled: the adopters tell nobody), or no other node is live to
    adopt them; returns those left waiting for the next node."""
    loop = asyncio.get_running_loop()
    waiting = sids
    look_at = loop.time() + ADOPTERS_POLL_S
    while waiting:
        await asyncio.sleep(ADOPTION_POLL_S)
        waiting = await host.store.nodes.unowned(waiting)
        if waiting and loop.time() >= look_at:
            look_at = loop.time() + ADOPTERS_POLL_S
            if not await _adopters(host, me):
                break
    if waiting:
        logger.info("drain: no other live node; %d session(s) wait for the next one to start", len(waiting))
    return waiting


async def _adopters(host: SessionHost, me: str) -> bool:
    """Whether a node other than this one is live, holding its lease (judged on the database's clock)."""
    live = await host.store.nodes.list_nodes(states=[NodeState.LIVE])
    return any(node.id != me and node.leased for node in live)


async def _unowned(host: SessionHost, sids: list[str]) -> list[str]:
    try:
        return await host.store.nodes.unowned(sids)
    except Exception:  # the database is going away too: the lease passes and the others adopt them
        return sids
